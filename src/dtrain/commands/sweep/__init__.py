"""`dtrain sweep`: many runs of one config (a grid or a random search), their sweep folder and
`sweep.yaml`, and their launch one after another or as a SLURM job array."""
