"""The training loop and what it is made of: the `Trainer` (trainer.py), the components the
run hands it (components.py: what learns, where batches come from, what watches it, the
callbacks; saving.py: its checkpoints), where a run is (state.py), gradient checks, early
stopping, EMA weights, evaluation (one function), optimizers and schedules; a language
model's decoding (decode.py) and its evaluation on lm-eval's tasks (lm_tasks.py, lm_adapter.py)."""
