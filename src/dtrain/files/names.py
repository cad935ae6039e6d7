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
TRACKERS = "trackers.json"  # which MLflow / W&B run this run is, and what they were sent
PROFILE = "profile"  # log.profile's traces
LOCK = ".lock"  # held by rank 0 of the run that owns the directory
SUPERSEDED = "superseded"  # what a rewind or a fresh start left, kept aside


def log_file(rank: int) -> str:
    """Each rank's log: rank 0's `log.txt`, the others' `log.rank<N>.txt`."""
    return "log.txt" if rank == 0 else f"log.rank{rank}.txt"


def is_log_file(name: str) -> bool:
    return name == "log.txt" or (
        name.startswith("log.rank") and name.endswith(".txt") and name[8:-4].isdigit()
    )


# What a run writes directly in its directory: files, and folders of its own (never a link).
RUN_FILES = (CONFIG, METRICS, TRACKERS, LOCK)
RUN_FOLDERS = (CHECKPOINTS, TENSORBOARD, EVALS, PROFILE, SUPERSEDED)

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


# The flags of a loss mask's bytes (data/masks.py): the token counts as a target of the loss;
# the token begins a document (packed windows).
MASK_COUNTED, MASK_STARTS = 1, 2


def loss_mask(token_file: str) -> str:
    """The loss mask beside a token file (`train.bin` -> `train.mask`, `train_003.bin` ->
    `train_003.mask`; a shard pattern maps to the masks' pattern): one byte of flags per token
    (which tokens the loss counts, where documents start: data/masks.py)."""
    return token_file.removesuffix(".bin") + ".mask"
