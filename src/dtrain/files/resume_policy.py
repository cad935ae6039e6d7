"""Which config keys a resumed checkpoint may change: the checkpoint's policy, in one place
(read by resuming, by the run record's config hash, by `dtrain runs` and by the configuration
reference). No torch: `dtrain runs` reads it too."""

from __future__ import annotations

from typing import Any

from dtrain.config import Config, flatten, to_dict

# Keys that do not change what a run trains: where it runs and writes, how it logs, checkpoints
# and communicates, and how fast its data loads. A resumed run may change them freely; any other
# change needs ckpt.resume_config_change=allow.
NOT_TRAINING = (
    "run.name",
    "run.out_dir",
    "run.private",
    "run.storage_options",
    "run.staging_dir",
    "run.upload_every_s",
    "run.store_timeout_s",
    "log.",
    "ckpt.",
    "dist.",
    # How the ranks hold the model (DDP, FSDP, tensor and pipeline parallelism) is not what
    # they train: a checkpoint of one layout resumes under another (its batch:
    # `effective_batch_kept`).
    "parallel.mode",
    "parallel.ddp.",
    "parallel.fsdp.",
    "parallel.tp.",
    "parallel.pp.",
    # Replica groups train what one run over their ranks trains: a resume may add or drop them.
    "parallel.replicas.",
    "slurm.",
    "data.num_workers",
    "data.persistent_workers",
    # When to stop is decided anew from the counts in the checkpoint: a resume may change it.
    "train.early_stop.",
    # An average of the weights never changes the weights trained: it may be switched on or off.
    "train.ema.",
    # Tasks scored at each evaluation only read the weights: a resume may add, drop or change them.
    "train.eval_tasks",
)


def is_training_key(key: str) -> bool:
    return not any(key == k or (k.endswith(".") and key.startswith(k)) for k in NOT_TRAINING)


def training_part(data: dict) -> dict[str, Any]:
    """The flattened config without the keys of NOT_TRAINING."""
    return {k: v for k, v in flatten(data).items() if is_training_key(k)}


# Keys that set how long a run trains, not what it learns: a resume may change them without
# ckpt.resume_config_change=allow ("train 10 epochs more"); ckpt.on_length_change says what the
# learning-rate schedule does then.
LENGTH_KEYS = ("train.epochs", "train.max_steps")


def is_length_change(change: str) -> bool:
    """Whether a `training_differences` line is about the run's length."""
    return change.split(":", 1)[0] in LENGTH_KEYS


def training_differences(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every training key whose value differs, a key on one side only
    included (a section switched on, a new `model.args` entry): that side shows the key's
    default, or `absent` where the config has no default for it (a free-form entry)."""
    a, b = _leaves(training_part(saved)), _leaves(training_part(current))
    defaults = _leaves(training_part(to_dict(Config())))

    def value(side: dict[str, Any], key: str) -> Any:
        return side[key] if key in side else defaults.get(key, _ABSENT)

    return [
        f"{key}: {value(a, key)!r} -> {value(b, key)!r}"
        for key in sorted(a.keys() | b.keys())
        if value(a, key) != value(b, key)
    ]


class _Absent:
    """The value of a key a config does not have (shown as `absent`)."""

    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


# The keys that make the effective batch with the layout: a move to another layout may change
# them where the effective batch stays what it was.
BATCH_KEYS = ("data.batch_size", "train.grad_accum")


def effective_batch_kept(saved: dict, saved_world: int, current: dict, world: int) -> bool:
    """Whether the run of config `current` at `world` ranks takes as many samples per step as
    the run of `saved` at `saved_world` did (per rank batch x ranks reading batches of their
    own x accumulation), so that a change of BATCH_KEYS only follows the layout."""

    def per_step(cfg: dict, ranks: int) -> int:
        parallel = cfg.get("parallel", {})
        # (ranks of a tp group or a pipeline read one batch between them)
        group = parallel.get("tp", {}).get("size", 1) * parallel.get("pp", {}).get("size", 1)
        batch, accum = cfg.get("data", {}).get("batch_size"), cfg.get("train", {}).get("grad_accum")
        return batch * (ranks // group) * accum if batch and accum and group else -1

    return per_step(saved, saved_world) == per_step(current, world) > 0


def _leaves(flat: dict[str, Any]) -> dict[str, Any]:
    """The values of free-form sections (`model.args`, `task.args`) by keys of their own."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, dict):
            out.update(_leaves({f"{key}.{k}": v for k, v in value.items()}))
        else:
            out[key] = value
    return out
