"""Checkpoints: dtrain's save and load against torch.save / torch.load of the same state, and how
long an asynchronous save (ckpt.async=true) blocks training, as a fraction of a synchronous one.

One process, a transformer with AdamW state after one step. dtrain's save is the whole of
`Checkpointer.save` (state dicts, RNG states, a temporary folder, fsync, rename, marker, `latest`,
rotation); its load is `Checkpointer.resume` (checks, torch.load with weights_only, model and
optimizer state, RNG states). The plain side is `torch.save({"model": ..., "optimizer": ...})`
and `torch.load` + `load_state_dict`; it is also timed with an fsync, which dtrain does so that a
checkpoint survives a crash of the machine. dtrain's save includes the content digest of every
file (xxh3-128, computed as the bytes are written) and its load the check of every file read
against them (computed while it is read). Saves and loads alternate, ROUNDS times: the figure is
the median of the rounds' ratios, the detail their range and what hashing alone costs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

MODEL = ["model.name=transformer", "model.args={dim: 384, depth: 8, heads: 8}", "optim.name=adamw"]


def _setup(work: Path, asynchronous: bool):
    import torch
    import torch.nn.functional as F
    from dtrain import checkpoint, config, data, models
    from dtrain.loop import optim
    from dtrain.loop.state import TrainState

    cfg = config.load(None, [*MODEL, f"run.out_dir={work}", f"run.name={'async' if asynchronous else 'sync'}",
                             f"ckpt.async={str(asynchronous).lower()}", "ckpt.keep_last=2",
                             "ckpt.keep_best=0", "data.synthetic.train_size=16",
                             "data.synthetic.val_size=16"])
    info = data.build(cfg.data, cfg.run.seed).info
    model = models.build(cfg.model, info, cfg.run.seed)
    optimizer = optim.build_optimizer(model, cfg.optim)
    images = torch.randn(4, 3, 32, 32)
    F.cross_entropy(model(images), torch.tensor([0, 1, 2, 3])).backward()
    optimizer.step()  # the optimizer state exists only after a step
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    state = TrainState()
    checkpointer = common.checkpointer(cfg, model, optimizer, info, checkpoint.Store(run_dir), state)
    return cfg, model, optimizer, checkpointer, state


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(work: Path, rounds: int = 7) -> list[Figure]:
    import torch
    torch.set_num_threads(1)  # as in the training processes of the other benchmarks
    os.sync()  # earlier writes (other benchmarks') must not be flushed during the timed saves
    _, model, optimizer, ours, state = _setup(work, asynchronous=False)
    _, _, _, background, async_state = _setup(work, asynchronous=True)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(t.numel() * t.element_size() for s in optimizer.state.values()
                       for t in s.values() if isinstance(t, torch.Tensor))
    plain_file = work / "plain.pt"

    def plain_save(sync: bool) -> None:
        with open(plain_file, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def plain_load() -> None:
        loaded = torch.load(plain_file, weights_only=True)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])

    def dtrain_save() -> None:
        state.step += 1
        ours.save(state.step, 0, {})

    dtrain_save(), plain_save(True), ours.resume(), plain_load()  # warm-up: first-touch costs
    times: dict[str, list[float]] = {k: [] for k in (
        "dtrain save", "torch.save", "torch.save+fsync", "dtrain load", "torch.load", "async blocked")}
    for _ in range(rounds):
        times["dtrain save"].append(_timed(dtrain_save))
        times["torch.save"].append(_timed(lambda: plain_save(False)))
        times["torch.save+fsync"].append(_timed(lambda: plain_save(True)))
        times["dtrain load"].append(_timed(ours.resume))
        times["torch.load"].append(_timed(plain_load))
        async_state.step += 1
        times["async blocked"].append(_timed(lambda: background.save(async_state.step, 0, {})))
        background.wait()  # the write itself, not counted: training would go on meanwhile
    t = {k: common.median(v) for k, v in times.items()}
    mb = state_bytes / 1e6
    save = [p / d for p, d in zip(times["torch.save+fsync"], times["dtrain save"], strict=True)]
    load = [p / d for p, d in zip(times["torch.load"], times["dtrain load"], strict=True)]
    hashed = _hash_seconds(os.path.join(ours.store.dir, ours.store.complete()[0].name))
    return [
        Figure("checkpoint: save throughput dtrain/(torch.save+fsync)",
               common.median(save), "x", ">= 0.9",
               f"{mb / t['dtrain save']:.0f} vs {mb / t['torch.save+fsync']:.0f} MB/s ({mb:.0f} MB), "
               f"{_range(save)}; torch.save without fsync: {mb / t['torch.save']:.0f} MB/s; "
               f"hashing the files alone: {hashed * 1e3:.0f} ms "
               f"({100 * hashed / t['dtrain save']:.0f} % of a save)"),
        Figure("checkpoint: load throughput dtrain/(torch.load+load_state_dict)",
               common.median(load), "x", ">= 0.9",
               f"{mb / t['dtrain load']:.0f} vs {mb / t['torch.load']:.0f} MB/s, {_range(load)}; "
               f"verified while read"),
        Figure("checkpoint: async save, training blocked / sync save", t["async blocked"] / t["dtrain save"],
               "x", "<= 0.3", f"{t['async blocked'] * 1e3:.0f} vs {t['dtrain save'] * 1e3:.0f} ms"),
    ]


def _range(ratios: list[float]) -> str:
    return f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} rounds"


def _hash_seconds(folder: str) -> float:
    """How long digesting a checkpoint's files takes from the page cache (xxh3-128)."""
    from dtrain.files.digests import file_digest

    files = [os.path.join(root, n) for root, _, names in os.walk(folder) for n in names]
    return _timed(lambda: [file_digest(f) for f in files])

if __name__ == "__main__":
    common.run_standalone(run)
