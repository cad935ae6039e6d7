"""`dtrain eval`: the command (its config, layout, evaluation run and result file) and the
checkpoint it evaluates (chosen.py: which one, its local copy, its weights)."""
