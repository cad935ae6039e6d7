"""The names of the files and folders dtrain writes, each in one place: a run directory's, a
run.out_dir's, a sweep folder's and a token folder's. Readers and writers both take them from
here, so that `dtrain runs`, `verify`, `eval` and a run can never disagree on a name."""

from __future__ import annotations

# A run directory (run.out_dir/run.name)
CONFIG = "config.yaml"  # the resolved config the run trains with
METRICS = "metrics.jsonl"  # one record a line
TENSORBOARD = "tb"  # TensorBoard's event files
CHECKPOINTS = "checkpoints"  # one folder per checkpoint
EVALS = "evals"  # `dtrain eval`'s results, one file each

# A run.out_dir (and so a sweep folder)
RUNS_CSV = "runs.csv"  # one row per run: status, error, wall time, last checkpoint
SWEEP = "sweep.yaml"  # a sweep folder's trials

# A token folder (`dtrain tokenize`, data.name: tokens)
TOKEN_META = "meta.json"  # vocabulary, counts and bytes per token; written last
TOKEN_SPLITS = ("train", "val")


def token_file(split: str) -> str:
    """A split's token file when it is one file (`train.bin`)."""
    return f"{split}.bin"


def token_shards(split: str) -> str:
    """The glob pattern of a split's shards when it is several (`train_*.bin`)."""
    return f"{split}_*.bin"
