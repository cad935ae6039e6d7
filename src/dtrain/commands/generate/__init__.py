"""`dtrain generate`: what a trained run's model says (command.py) and its prompts (text.py);
decoding is `loop.decode`'s, the run's tokenizer and chat template `models.tokenizer`'s."""
