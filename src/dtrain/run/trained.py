"""A trained run read back by the commands that use its checkpoints (`dtrain eval`, `dtrain
generate`): its config (the run's own, with the command's on top), the layout at this launch's
world size, the checkpoint (latest, best or a PATH, as rank 0 finds it), its local copy when it
lies in an object store, and its model weights, loaded the way a resume loads them.

`command` in each function: the command's name, which its lines begin with ("eval error: ...").
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from dtrain import config, parallel
from dtrain.checkpoint.load import (
    apply_full,
    apply_sharded,
    local_folder,
    open_checkpoint,
    trained_shapes,
)
from dtrain.checkpoint.state import (
    FULL_FILE,
    META_FILE,
    dcp_model_shapes,
    load_checked,
    load_file,
    shape_mismatch,
)
from dtrain.config import Config, registry
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url
from dtrain.files import names, remote_copies
from dtrain.files.store import MARKER, Store, read_marker
from dtrain.files.store_protocol import CheckpointStore
from dtrain.models.spec import spec_of
from dtrain.parallel import unwrap
from dtrain.parallel.precision import Precision
from dtrain.process import dist
from dtrain.process.env import Env
from dtrain.process.layout import Layout
from dtrain.run.pieces import layout_of
from dtrain.run.weights import prepare_base

# ---------------------------------------------------------------------------------------------
# The run's config, with the command's --config and overrides on top; its layout here


def run_config(
    run_dir: str,
    config_path: str | None,
    overrides: list[str],
    trusted: bool,
    shown: str,
    command: str,
) -> Config:
    """`DIR/config.yaml` (the resolved config the run trained with), the mapping of `config_path`
    merged over it, then the `section.key=value` overrides; checked like any config. Code that
    config.yaml names and this command would run (a `module:function`, a model folder's own) is
    refused unless `trusted` (--trust-remote-code), before any of it is imported; `shown`: the
    run directory in that line (its URL)."""
    saved = os.path.join(run_dir, names.CONFIG)
    if not os.path.isdir(run_dir):
        raise UserError(f"{command} error: --run-dir {run_dir}: no such directory")
    if not os.path.isfile(saved):
        raise UserError(
            f"{command} error: --run-dir {run_dir}: not a run directory (it has no config.yaml); "
            f"name the folder a training run wrote"
        )
    merged = config.read_yaml(saved)
    saved_values = config.flatten(merged)  # (before anything is merged over it)
    if config_path:
        _merge(merged, config.read_yaml(config_path))
    for text in overrides:
        key, value = config.parse_override(text)
        config.set_dotted(merged, key, value)
    # Where the weights come from is the checkpoint: the files a fine-tuning run started from
    # (model.init_from, model.pretrained) are neither needed nor checked here, but for a LoRA
    # run's, which hold its frozen base (checked against the checkpoint's digest).
    cfg = config.from_dict(merged)
    if not trusted:  # what the user's --config or overrides name is theirs to run
        named = registry.code_named(cfg).items()
        from_run = {k: v for k, v in named if saved_values.get(k) == v}
        registry.refuse_code(from_run, f"--run-dir {shown}: its {names.CONFIG}")
    if not spec_of(cfg.model).holds_everything:  # the base's weights come from where they did
        return cfg
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, init_from=None, pretrained=False)
    )


def _merge(base: dict, top: dict) -> None:
    """`top`'s keys into `base`, section by section; a model's `args` is one value (as in
    overrides), replaced whole."""
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key != "args":
            _merge(base[key], value)
        else:
            base[key] = value


def layout_here(cfg: Config, env: Env) -> tuple[Config, Layout]:
    """The training layout at this launch's world size, and the config it was resolved from
    (the parallel section as the strategy uses it at this world size)."""
    cfg = dataclasses.replace(cfg, parallel=parallel.for_world_size(cfg.parallel, env.world_size))
    layout = layout_of(cfg, env)
    return cfg, layout


def run_dir_and_overrides(
    run_option: str | None, words: list[str], command: str
) -> tuple[str, list[str]]:
    """The run directory (`--run-dir DIR`, or the one word that is a path) and the overrides."""
    dirs, overrides = config.paths_and_overrides(words)
    if run_option is not None:
        dirs.insert(0, run_option)
    if len(dirs) != 1:
        got = f" (got {', '.join(dirs)})" if dirs else ""
        raise UserError(
            f"usage error: dtrain {command} takes one run directory, as --run-dir DIR or DIR{got}; "
            f"overrides are section.key=value"
        )
    return dirs[0], overrides


# ---------------------------------------------------------------------------------------------
# The checkpoint


@dataclass(frozen=True)
class Chosen:
    """The checkpoint a command reads, as rank 0 found it."""

    folder: str
    fmt: str  # "full" | "sharded"
    file: str | None  # the full checkpoint's file
    step: int | None
    saved_world_size: int | None
    url: str | None = None  # in an object store: where it is (`folder` is then a local copy)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.folder))

    @property
    def shown(self) -> str:
        return self.url or self.folder

    def file_shown(self, name: str) -> str | None:
        """How messages name the checkpoint's file `name`: by its URL for a store's (a local
        copy's path is gone when the message is read); None: by its path."""
        return f"{self.url}/{name}" if self.url else None


def choose(run_dir: str, which: str, cfg: Config, listing_dir: str, command: str) -> Chosen:
    """`latest` (the last complete checkpoint saved, as resuming counts it), `best` (by
    ckpt.monitor, as rotation keeps it) or a PATH: its folder or checkpoint.pt. Its save must
    have completed and every file it lists must have its size. A run or a checkpoint in an
    object store is only named here (`fetched` makes the local copy)."""
    options = dict(cfg.run.storage_options)
    store: CheckpointStore
    if is_url(run_dir):  # listing only: Store.prepare would move folders
        store = remote_copies.listing(run_dir, options, listing_dir)
        remote_copies.checkpoints(store, command, run_dir)
    else:
        store = Store(run_dir)
    if which == "latest":
        saved = store.complete()
        if not saved:
            raise UserError(
                f"{command} error: --checkpoint latest: no complete checkpoint in "
                f"{store.location}; name one with --checkpoint PATH"
            )
        path = saved[0].path
    elif which == "best":
        monitor, mode = cfg.ckpt.monitor, cfg.ckpt.monitor_mode
        best = store.best(monitor, mode)
        if best is None:
            raise UserError(
                f"{command} error: --checkpoint best: no checkpoint in {store.location} records a "
                f"value of ckpt.monitor {monitor}; use --checkpoint latest or a PATH"
            )
        path = best.path
    else:
        path = which
    if is_url(path):
        marker = remote_copies.marker_of(path, options, command)
        url = remote_copies.checkpoint_folder(path)
        return Chosen(
            url,
            str(marker.get("format", "full")),
            None,
            marker.get("step"),
            marker.get("world_size"),
            url,
        )
    if which not in ("latest", "best"):
        if not os.path.exists(path):
            raise UserError(
                f"{command} error: --checkpoint {path} not found; name a checkpoint folder (or its "
                f"{FULL_FILE}), latest or best"
            )
        folder_like = os.path.isdir(path) and any(
            os.path.exists(os.path.join(path, f)) for f in (MARKER, FULL_FILE, META_FILE)
        )
        if not folder_like and os.path.basename(path) != FULL_FILE:
            raise UserError(
                f"{command} error: --checkpoint {path} is not a checkpoint (no {MARKER} marker); "
                f"name a folder of {os.path.join(run_dir, 'checkpoints')}, latest or best"
            )
    folder, fmt = open_checkpoint(path)
    marker = read_marker(folder) or {}
    if fmt == "full":
        file = os.path.join(folder, FULL_FILE) if marker or os.path.isdir(path) else path
    else:
        file = None
    return Chosen(folder, fmt, file, marker.get("step"), marker.get("world_size"))


def fetched(chosen: Chosen, into: str, options: dict[str, Any]) -> Chosen:
    """A checkpoint in an object store as this process's local copy below `into` (of a full
    one, rank 0 fetches the files; every rank fetches its marker), each file checked by its
    digest as it is read; any other checkpoint as it is."""
    if chosen.url is None:
        return chosen
    local = local_folder(chosen.url, into, options)
    file = os.path.join(local, FULL_FILE) if chosen.fmt == "full" else None
    return dataclasses.replace(chosen, folder=local, file=file)


def load_weights(model: nn.Module, chosen: Chosen, cfg: Config, command: str) -> None:
    """The checkpoint's model weights into `model` (wrapped for this launch), by the functions a
    resume loads them with (`checkpoint.load`): a full checkpoint is read by rank 0
    (memory-mapped) and sent to the ranks, each its part; a sharded one is read by every rank,
    its own part, through DCP. A checkpoint of another model is refused with resuming's line
    before anything is loaded; a LoRA checkpoint's adapters go onto their base, checked by its
    digest, as resuming does."""
    spec = spec_of(cfg.model)
    ours = trained_shapes(unwrap(model), spec)

    def refuse_other_model(theirs: dict[str, tuple[int, ...]]) -> None:
        problem = shape_mismatch(ours, theirs)
        if problem:
            raise UserError(f"checkpoint error: {chosen.shown}: {problem}")

    if chosen.fmt == "full":
        held: dict[str, Any] = {}  # rank 0's memory-mapped weights; never broadcast whole

        def read() -> dict[str, Any]:
            assert chosen.file is not None
            saved = load_checked(chosen.file, mmap=True, shown=chosen.file_shown(FULL_FILE))
            weights = saved.get("model")
            if not isinstance(weights, dict):
                raise UserError(
                    f"{command} error: {chosen.file_shown(FULL_FILE) or chosen.file} holds no "
                    f"model weights (not a dtrain checkpoint)"
                )
            refuse_other_model({k: tuple(v.shape) for k, v in weights.items()})
            held["model"] = weights
            return dict(saved.get("model_info") or {})

        prepare_base(model, cfg, dist.on_main(read), chosen.shown)
        apply_full(model, None, held or None, chosen.folder, spec)
        return

    def read_sharded() -> dict[str, Any]:
        refuse_other_model(dcp_model_shapes(chosen.folder))
        meta = load_checked(
            os.path.join(chosen.folder, META_FILE), shown=chosen.file_shown(META_FILE)
        )
        return dict(meta.get("model_info") or {})

    prepare_base(model, cfg, dist.on_main(read_sharded), chosen.shown)
    try:
        with warnings.catch_warnings():
            # DCP's note that one process reads alone: what evaluating in one process means.
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single"
            )
            apply_sharded(model, None, chosen.folder, spec)
    except UserError:
        if not os.path.isdir(chosen.folder):
            raise UserError(
                f"{command} error: {chosen.shown} was removed while it was read (the training "
                f"that is running rotated it out, ckpt.keep_last); run dtrain {command} again"
            ) from None
        raise


def check_ema(chosen: Chosen, command: str) -> None:
    """`--weights ema` of a checkpoint without them: refused before anything is built."""
    from dtrain.loop import ema  # only `--weights ema` needs it

    if not ema.has_ema(chosen.folder):
        raise UserError(
            f"{command} error: {chosen.shown} was saved without EMA weights (train.ema.decay "
            f"unset); use --weights model"
        )


def trained_model(
    cfg: Config, layout: Layout, chosen: Chosen, command: str, weights: str = "model"
) -> tuple[nn.Module, Precision]:
    """The run's model as the run's strategy builds it at this world size, from the data's
    vocabulary and window as the checkpoint recorded them (no data is read), with the
    checkpoint's weights (`weights` "ema": their moving average, train.ema, over the
    parameters it averages); in eval mode."""
    precision = Precision.for_run(cfg.train.precision, cfg.train.loss_scale_init, layout)
    strategy = parallel.strategy(cfg.parallel, layout)
    model, _, _ = strategy.build(cfg.model, saved_info(chosen), cfg.run.seed, precision)
    load_weights(model, chosen, cfg, command)
    if weights == "ema":
        from dtrain.loop import ema  # only `--weights ema` needs it

        ema.load_ema_into(model, chosen.folder)
    return model.eval(), precision


def saved_info(chosen: Chosen) -> dict[str, Any]:
    """What the datasets said when the checkpoint's run was built (its `model_info`: the
    vocabulary, the window), read on rank 0 from the checkpoint's metadata, so that its model
    can be built without its data. Only read here: `load_weights` checks every file it loads
    against the marker's digests."""

    def read() -> dict[str, Any]:
        if chosen.fmt == "full":
            assert chosen.file is not None
            saved = load_file(chosen.file, mmap=True, shown=chosen.file_shown(FULL_FILE))
        else:
            meta = os.path.join(chosen.folder, META_FILE)
            saved = load_file(meta, shown=chosen.file_shown(META_FILE))
        return dict(saved.get("model_info") or {})

    return dist.on_main(read)
