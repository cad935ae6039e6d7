"""dtrain: trains PyTorch models with DDP or FSDP from a YAML config, the same way under
torchrun, in a SLURM job and as a single process. Its packages, each importing only those below
it: cli and commands, run (the assembly), loop, checkpoint, parallel, tasks, models, data,
observe, process, files, config, core (docs/architecture.md)."""

__version__ = "0.1.0"
