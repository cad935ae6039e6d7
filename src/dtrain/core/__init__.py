"""What every layer may use, in the standard library alone: errors that end a run with one
line, logging, import paths, signals, URLs, text fitted to a terminal, and the rule of a
monitored metric."""
