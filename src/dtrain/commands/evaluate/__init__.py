"""`dtrain eval`: the command (its config, layout, evaluation run and result file), the
checkpoint it evaluates (chosen.py: which one, its local copy, its weights) and `--profile`
(profiled.py: the evaluation under the torch profiler, where its time went)."""
