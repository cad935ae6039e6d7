"""`dtrain generate`: what a trained run's model says (command.py), decoding with a key/value
cache, greedy or sampled (decode.py), and the run's tokenizer, chat template and prompts
(text.py)."""
