"""`dtrain plan`: what a config will do (layout, data, steps, checkpoints, memory per rank and
communication, each parallel strategy beside the chosen one), worked out before launching it;
with `--memory-limit`, whether the job fits on a node and the largest value of a key that does."""
