"""The `dtrain` commands besides `train` (run/), one module or package each: eval, export,
convert, verify, runs, doctor, plan, sweep, tokenize, and the configuration reference. None
imports another."""
