"""Reading a checkpoint into a model and optimizer (and a run's parts, `load_run`): opening it
safely, and applying a full or a sharded one so that nothing is changed unless every part was
read."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from dtrain.checkpoint import state as ckpt_state
from dtrain.checkpoint.parts import Contents, SavedPart
from dtrain.checkpoint.state import FULL_FILE, META_FILE, META_KEYS, POSITION, Resumed
from dtrain.config import CkptConfig
from dtrain.core.errors import UserError, first_line
from dtrain.core.logs import log
from dtrain.files.digests import MARKER, marker_damaged, read_marker, verify_files
from dtrain.files.objstore import TIMEOUT_S, is_url
from dtrain.files.remote_store import fetch_checkpoint
from dtrain.files.resume_policy import (
    BATCH_KEYS,
    effective_batch_kept,
    is_length_change,
    training_differences,
)
from dtrain.models.spec import ModelSpec
from dtrain.parallel import unwrap, whole_shapes
from dtrain.process import dist, rng
from dtrain.process.compat import tree_map_tensors


def open_checkpoint(path: str) -> tuple[str, str]:
    """The folder and format of the checkpoint at `path` (its folder, or a bare checkpoint.pt),
    after checking that its save completed and that every file it lists has its size (their
    contents are checked against the marker's digests as they are read)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    marker = read_marker(folder)
    if marker is None:
        if marker_damaged(folder):
            raise UserError(
                f"checkpoint error: {os.path.join(folder, MARKER)} is damaged or not a dtrain "
                f"marker; name another checkpoint"
            )
        if os.path.isdir(path):
            raise UserError(f"checkpoint error: {folder} has no {MARKER} marker (incomplete save)")
        return folder, "full"
    wrong = verify_files(folder, marker)
    if wrong:
        raise UserError(f"checkpoint error: {folder}: {wrong} (truncated or damaged)")
    return folder, marker["format"]


class ConfigChanged(UserError):
    """The checkpoint was made by a config that trains something else: not a damaged checkpoint
    to fall back from, but a question for the user."""


class ModelMismatch(ConfigChanged):
    """The checkpoint reads back whole, but its weights do not fit this run's model (keys or
    shapes): a changed config or changed model code built another model. Not damage (that is
    what digests and markers prove): nothing is set aside, and no config change makes it load."""


def check_config(
    saved: dict[str, Any],
    config: dict[str, Any],
    ckpt: CkptConfig,
    folder: str,
    misfit: str | None = None,
    worlds: tuple[int, int] = (1, 1),
) -> list[str]:
    """The training keys `config` changed since the checkpoint's `saved` config (all of them,
    length changes included); ConfigChanged unless only the run's length changed or the user
    allows changes (ckpt.resume_config_change=allow). `misfit` says why the checkpoint's
    weights do not fit this run's model (`state.shape_mismatch`): ModelMismatch, naming the
    changed keys, allowed or not. `worlds`: the checkpoint's world size and this run's; a batch
    that changed with the layout, keeping the effective batch, is no change."""
    every = training_differences(saved, config)
    if effective_batch_kept(saved, worlds[0], config, worlds[1]):
        every = [c for c in every if not c.startswith(tuple(f"{k}:" for k in BATCH_KEYS))]
    # A longer or shorter run trains the same thing: the run applies it (and says what the
    # schedule does, ckpt.on_length_change); only the other changes need `allow`.
    changes = [c for c in every if not is_length_change(c)]
    shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    if misfit:
        cause = f"the config changed: {shown}" if changes else "its code changed, not the config"
        raise ModelMismatch(
            f"checkpoint error: {folder}: {misfit} ({cause}); this model cannot continue it: "
            f"start anew with another run.name (or ckpt.resume=none)"
        )
    if not changes:
        return every
    if ckpt.resume_config_change != "allow":
        raise ConfigChanged(
            f"checkpoint error: {folder} was saved by a config that trains "
            f"something else ({shown}); to continue it on purpose set "
            f"ckpt.resume_config_change=allow, or start anew with "
            f"ckpt.resume=none or another run.name"
        )
    log.warning(
        f"resuming {folder} with a changed config (ckpt.resume_config_change=allow): {shown}"
    )
    return every


def check_base(saved_info: dict[str, Any], info: dict[str, Any], folder: str) -> None:
    """A LoRA checkpoint holds adapters trained on one base model (`lora_base` in the model
    info: where its weights came from and their digest); on another base they mean nothing, so
    a changed base ends the start (exit 2), as a changed config does."""
    saved, now = saved_info.get("lora_base"), info.get("lora_base")
    if saved is None and now is None:
        return
    if saved is None or now is None:
        what = "a LoRA run's adapters" if saved is not None else "a model without LoRA"
        raise ConfigChanged(
            f"checkpoint error: {folder} holds {what}, and this run's model.lora says "
            f"otherwise; start anew with ckpt.resume=none or another run.name"
        )
    # A checkpoint saved before the base's config.json had a digest is checked by its weights.
    fields = ("digest", "config_digest") if "config_digest" in saved else ("digest",)
    for field in fields:
        if saved.get(field) != now.get(field):
            what = "config.json digest" if field == "config_digest" else "digest"
            raise ConfigChanged(
                f"checkpoint error: {folder}: its LoRA adapters were trained on the base "
                f"{saved.get('weights')} ({what} {saved.get(field)}), and {now.get('weights')} "
                f"now has {what} {now.get(field)}: the base changed; name the base the adapters "
                f"were trained on (model.name, model.init_from)"
            )


def state_options(full: bool, spec: ModelSpec, **options: Any) -> Any:
    """How a checkpoint's model and optimizer state are taken or given: whole on rank 0 (`full`,
    in CPU memory) or as each rank's shards; for a model whose checkpoint does not hold
    everything (LoRA), without the frozen base, which comes from where it came from at the
    start."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if full:
        options.setdefault("cpu_offload", True)
    return StateDictOptions(
        full_state_dict=full, ignore_frozen_params=not spec.holds_everything, **options
    )


def model_state(model: nn.Module, full: bool, spec: ModelSpec, **options: Any) -> Any:
    """The model's state as a checkpoint holds it (`state_options`). Without the frozen base,
    a tied weight goes too: the distributed state-dict API leaves out only its first name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=state_options(full, spec, **options))
    left_out = spec.left_out(unwrap(model))
    return {k: v for k, v in state.items() if k not in left_out}


def trained_shapes(model: nn.Module, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The names and full shapes of what a checkpoint of `model` holds (the module's own
    state_dict has the names and global shapes the distributed state-dict API uses)."""
    left_out = spec.left_out(model)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in left_out}


def local_folder(
    path: str,
    into: str,
    options: dict[str, Any],
    timeout_s: float = TIMEOUT_S,
    every_rank: bool = False,
) -> str:
    """`path` itself, or for a checkpoint in an object store its local copy below `into` (of a
    full checkpoint, only rank 0 reads the files, the others the marker, unless `every_rank`
    reads the whole: a pipeline stage's ranks, which hold different parts). What one rank met
    fetching it (a store that did not answer, a damaged marker), every rank raises: none is
    left waiting for a rank that stopped."""
    if not is_url(path):
        return path
    local, failure = "", None
    try:
        local = fetch_checkpoint(
            path,
            into,
            options,
            lambda marker: marker.get("format") != "full" or dist.is_main() or every_rank,
            timeout_s,
        )
    except UserError as e:
        failure = e
    met = [e for e in dist.gather_objects(failure) if e is not None]
    if met:
        raise met[0]
    return local


def apply_full(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    data: dict[str, Any] | None,
    folder: str,
    spec: ModelSpec,
    broadcast: bool = True,
) -> None:
    """Rank 0 holds the file (memory-mapped); the others receive their part by broadcast, or
    without `broadcast` hold it too (a pipeline's stages each take their own part). Without an
    optimizer (evaluation), the model's weights only."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    data = data or {"model": {}, "optimizer": {}}
    options = state_options(
        True,
        spec,
        cpu_offload=False,
        # (a stage's part takes its own keys of the whole: all there, as checked before)
        strict=spec.holds_everything and broadcast,
        broadcast_from_rank0=broadcast and dist.is_distributed(),
    )
    try:
        set_model_state_dict(model, data["model"], options=options)
        if optimizer is not None:
            with _own_implementation(optimizer):
                set_optimizer_state_dict(model, optimizer, data["optimizer"], options=options)
    except (RuntimeError, KeyError, ValueError, AssertionError) as e:
        raise UserError(f"checkpoint error: {folder}: {first_line(e)}") from None


def apply_sharded(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    folder: str,
    spec: ModelSpec,
    extra: dict[str, Any] | None = None,
) -> None:
    """Read every shard into new tensors first; apply them only when all were read. `extra`
    (tensors by part name, e.g. the EMA weights) is filled by the same read, for the caller to
    apply. Without an optimizer (evaluation), the model's weights only."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = state_options(False, spec, strict=spec.holds_everything)
    own = model_state(model, False, spec, strict=spec.holds_everything)
    staged = {"model": tree_map_tensors(torch.empty_like, own)}
    if optimizer is not None:
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
        staged["optimizer"] = tree_map_tensors(torch.empty_like, optimizer_state)
    staged.update(extra or {})
    ckpt_state.read_sharded(folder, staged)
    if optimizer is not None:
        # Each group's parameters by name are this rank's own: DCP keeps one rank's list, and
        # a pipeline stage's ranks hold different parameters (the groups' settings are alike).
        groups = cast(list, optimizer_state["param_groups"])
        for read, own in zip(staged["optimizer"]["param_groups"], groups, strict=True):
            read["params"] = own["params"]
    set_model_state_dict(model, staged["model"], options=options)
    if optimizer is not None:
        with _own_implementation(optimizer):
            set_optimizer_state_dict(model, optimizer, staged["optimizer"], options=options)


# How the optimizer computes its step, not what it learned: chosen for this run's placement (a
# sharded run's SGD cannot be fused, a single process's can), so the checkpoint's do not apply.
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


@contextlib.contextmanager
def _own_implementation(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    kept = [{k: g[k] for k in _IMPLEMENTATION if k in g} for g in optimizer.param_groups]
    yield
    for group, flags in zip(optimizer.param_groups, kept, strict=True):
        group.update(flags)


def load_run(
    contents: Contents,
    local: str,
    shown: str | None,
    ckpt: CkptConfig,
    device: torch.device,
    random_rank: int,
) -> tuple[Resumed, list[str]]:
    """Read the checkpoint at `local` (a local path, or the local copy of the store's `shown`),
    check it against the run's model and config, then apply it to the run's `contents`: where
    it came from, and the training keys changed since (`check_config`). Every rank calls it;
    its random states are those of `random_rank` (the layout's)."""
    full_data: dict[str, Any] | None = None  # rank 0's; the others receive what they need
    model, optimizer, spec = contents.model, contents.optimizer, contents.spec
    # The model's keys and full shapes, to refuse a checkpoint of another model up front (the
    # module's own state_dict has the names and global shapes the distributed state-dict API
    # uses; importing that API costs half a second, not to be paid before a fresh start).
    whole = whole_shapes(model)
    pipeline = whole is not None
    ours = whole or trained_shapes(unwrap(model), spec)

    def read() -> tuple[str, str, dict[str, Any], str | None]:
        nonlocal full_data
        folder, fmt = open_checkpoint(local)
        if fmt == "full":  # verified against the marker's digest before it is applied
            full_data = ckpt_state.load_checked(os.path.join(folder, FULL_FILE), mmap=True)
            meta = {k: full_data[k] for k in META_KEYS if k in full_data}
            saved = {k: tuple(v.shape) for k, v in full_data["model"].items()}
        else:
            meta = ckpt_state.load_checked(os.path.join(folder, META_FILE))
            saved = ckpt_state.dcp_model_shapes(folder)
        # A checkpoint of another model is refused before anything is loaded into this one.
        return folder, fmt, meta, ckpt_state.shape_mismatch(ours, saved)

    try:
        folder, fmt, meta, misfit = dist.on_main(read)
        folder = local if shown else folder
        named = shown or folder
        worlds = (meta["world_size"], dist.world_size())
        saved_config = meta.get("config", {})
        changes = check_config(saved_config, contents.config, ckpt, named, misfit, worlds)
        check_base(meta["model_info"], contents.model_info, named)
        # The sharded parts are read with the rest and taken only after it was applied.
        staged = {}
        for name, part in contents.sharded.items():
            whole = (full_data or {}).get(name) if fmt == "full" else None
            tensors = part.staging(SavedPart(name, folder, fmt, whole, device))
            if tensors is not None:
                staged[name] = tensors
        if fmt == "full":
            # A pipeline stage's ranks hold different parts: each reads the file (rank 0
            # checked it above), none waits on a broadcast of keys it does not have.
            if pipeline and not dist.is_main():
                full_data = ckpt_state.load_checked(os.path.join(folder, FULL_FILE), mmap=True)
            apply_full(model, optimizer, full_data, folder, spec, broadcast=not pipeline)
        else:
            apply_sharded(model, optimizer, folder, spec, staged)
        for name, tensors in staged.items():
            contents.sharded[name].load_state_dict(tensors)
    except UserError as e:  # a damaged file of a store's checkpoint: named by its URL
        if shown and local in str(e):
            raise type(e)(str(e).replace(local, shown)) from None
        raise
    finally:
        full_data = None
    return _restore_meta(contents, meta, shown or folder, device, random_rank), changes


def _restore_meta(
    contents: Contents, meta: dict[str, Any], folder: str, device: torch.device, random_rank: int
) -> Resumed:
    """The random states and the parts, as the checkpoint's metadata `meta` holds them."""
    saved_world, position = meta["world_size"], meta[POSITION]
    if saved_world == dist.world_size():
        rng.restore(meta["rng"][random_rank], device)
    else:
        log.warning(
            f"world size changed from {saved_world} to {dist.world_size()}: resuming "
            f"at the same sample of the epoch; random states are re-seeded"
        )
        rng.reseed(contents.seed + 7919 * (position["step"] + 1) + random_rank)
    for name, part in contents.parts.items():
        saved = position if name == POSITION else meta["extra"].get(name)
        if saved is None:
            log.warning(f"{folder} holds no state for '{name}': it starts anew")
        else:
            part.load_state_dict(saved)
    log.info(f"resumed from {folder} (step {position['step']}, epoch {position['epoch']})")
    return Resumed(path=folder, step=position["step"], world_size=saved_world)
