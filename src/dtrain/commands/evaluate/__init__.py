"""`dtrain eval`: the command (its evaluation run and result file); the run's config and the
checkpoint it evaluates are read by `run.trained`, as `dtrain generate` reads them."""
