"""`dtrain plan`: what a config will do, worked out from shapes before launching it: the layout,
the steps, the memory and traffic per rank, and with `--memory-limit` whether it fits."""
