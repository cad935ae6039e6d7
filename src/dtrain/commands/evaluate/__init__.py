"""`dtrain eval`: the command (its evaluation run and result file) and `--profile` (profiled.py:
the evaluation under the torch profiler, where its time went); the run's config and the
checkpoint it evaluates are read by `run.trained`, as `dtrain generate` reads them."""
