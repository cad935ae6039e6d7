"""Object stores: dtrain's checkpoint save and verified load in an S3 store against s3fs's own
put and get of the same bytes, how long an asynchronous save blocks training there, and token
windows read from the store after the first epoch against the local folder.

One process and one S3 server (moto's, on 127.0.0.1, as in the tests). The model and state are
checkpoint_io's (a transformer with AdamW state after one step). dtrain's save is the whole of
`Checkpointer.save` into the store: state dicts, the file written to the staging folder with its
digest, the upload, the check that it arrived, the marker, `latest`, rotation. The plain side
is `s3fs.put_file` of a file holding the same `torch.save` bytes, already on disk. dtrain's load
is `Checkpointer.resume` (choose, fetch, read verified, apply); the plain side `s3fs.get_file`
then `torch.load` and `load_state_dict`. Token windows: every window of a split read twice; the
second pass timed (the first epoch fetched the node's copy). Sides alternate, ROUNDS times;
figures are medians of the rounds' ratios.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import common  # noqa: E402
from checkpoint_io import MODEL, _range, _timed  # noqa: E402
from common import Figure  # noqa: E402


def _checkpointer(work: Path, url: str, asynchronous: bool):
    import torch
    import torch.nn.functional as F
    from dtrain import checkpoint, config, data, models
    from dtrain.files.objstore import ObjectStore
    from dtrain.files.remote_store import RemoteStore
    from dtrain.loop import optim
    from dtrain.loop.state import TrainState

    name = "async" if asynchronous else "sync"
    cfg = config.load(None, [*MODEL, f"run.out_dir={url}", f"run.name={name}",
                             f"ckpt.async={str(asynchronous).lower()}", "ckpt.keep_last=2",
                             "ckpt.keep_best=0", "data.synthetic.train_size=16",
                             "data.synthetic.val_size=16", f"run.staging_dir={work}"])
    info = data.build(cfg.data, cfg.run.seed).info
    model = models.build(cfg.model, info, cfg.run.seed)
    optimizer = optim.build_optimizer(model, cfg.optim)
    F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3])).backward()
    optimizer.step()
    state = TrainState()
    store = RemoteStore(cfg.run_dir, ObjectStore(str(cfg.run_url)))
    ours = common.checkpointer(cfg, model, optimizer, info, store, state)
    return model, optimizer, ours, state


def _checkpoints(work: Path, bucket: str, fs, rounds: int) -> list[Figure]:
    import torch
    model, optimizer, ours, state = _checkpointer(work / "sync", f"s3://{bucket}/runs", False)
    _, _, background, async_state = _checkpointer(work / "async", f"s3://{bucket}/runs", True)
    plain = work / "plain.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain)
    nbytes = plain.stat().st_size
    got = work / "got.pt"

    def dtrain_save() -> None:
        state.step += 1
        ours.save(state.step, 0, {})

    def plain_load() -> None:
        fs.get_file(f"{bucket}/plain/plain.pt", str(got))
        loaded = torch.load(got, weights_only=True)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])

    def plain_put() -> None:
        fs.put_file(str(plain), f"{bucket}/plain/plain.pt")

    dtrain_save(), plain_put(), ours.resume(), plain_load()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in ("save", "put", "load", "get", "blocked")}
    for _ in range(rounds):
        times["save"].append(_timed(dtrain_save))
        times["put"].append(_timed(plain_put))
        times["load"].append(_timed(ours.resume))
        times["get"].append(_timed(plain_load))
        async_state.step += 1
        times["blocked"].append(_timed(lambda: background.save(async_state.step, 0, {})))
        background.wait()  # the upload itself: training would go on meanwhile
    t = {k: common.median(v) for k, v in times.items()}
    mb = nbytes / 1e6
    save = [p / d for p, d in zip(times["put"], times["save"], strict=True)]
    load = [p / d for p, d in zip(times["get"], times["load"], strict=True)]
    return [
        Figure("object store: checkpoint save throughput dtrain/s3fs put", common.median(save),
               "x", ">= 0.9", f"{mb / t['save']:.0f} vs {mb / t['put']:.0f} MB/s ({mb:.0f} MB), "
               f"{_range(save)}"),
        Figure("object store: verified load throughput dtrain/(s3fs get+torch.load)",
               common.median(load), "x", ">= 0.9",
               f"{mb / t['load']:.0f} vs {mb / t['get']:.0f} MB/s, {_range(load)}"),
        Figure("object store: async save, training blocked / sync save",
               t["blocked"] / t["save"], "x", "<= 0.3",
               f"{t['blocked'] * 1e3:.0f} vs {t['save'] * 1e3:.0f} ms"),
    ]


def _tokens(work: Path, bucket: str, fs, rounds: int) -> list[Figure]:
    import numpy as np
    from dtrain.config import DataConfig
    from dtrain.config.data import TokensConfig
    from dtrain.data import tokens

    folder = work / "tokens"
    folder.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(0).integers(0, 5000, 4_000_000).astype(np.uint16).tofile(
        folder / "train.bin")
    np.random.default_rng(1).integers(0, 5000, 200_000).astype(np.uint16).tofile(
        folder / "val.bin")
    for file in folder.iterdir():
        fs.put_file(str(file), f"{bucket}/tokens/{file.name}")
    keys = TokensConfig(dtype="uint16", vocab_size=5000)

    def windows(root: str, cache_gib: float):
        import dataclasses
        cfg = DataConfig(name="tokens", root=root,
                         tokens=dataclasses.replace(keys, cache_gib=cache_gib))
        span = tokens.read_folder(cfg, ("train",)).spans["train"]
        return tokens.Windows(span, 256, 256, 5000)

    def read_all(w) -> None:
        for start in range(0, len(w) - 64, 64):
            w._batch(list(range(start, start + 64)))

    local, remote = windows(str(folder), 16), windows(f"s3://{bucket}/tokens", 16)
    read_all(local), read_all(remote)  # the first epoch: the node's copy is fetched here
    ratios = []
    for _ in range(rounds):
        ratios.append(_timed(lambda: read_all(local)) / _timed(lambda: read_all(remote)))
    ranged = windows(f"s3://{bucket}/tokens", 0)
    sample = list(range(0, 64))
    ranged_s = _timed(lambda: ranged._batch(sample))
    local_s = _timed(lambda: local._batch(sample))
    return [Figure("object store: token windows after the first epoch, store/local",
                   common.median(ratios), "x", ">= 0.8",
                   f"{_range(ratios)}; 4 M tokens, windows of 256; without the node's copy "
                   f"(ranged reads, cache_gib 0) a batch of 64 windows took "
                   f"{ranged_s * 1e3:.0f} ms vs {local_s * 1e3:.1f} ms")]


def run(work: Path, rounds: int = 5) -> list[Figure]:
    import s3server
    import torch
    torch.set_num_threads(1)
    server = s3server.start()
    try:
        os.environ.update(server.env)
        fs = server.fs()
        bucket = server.bucket()
        return [*_checkpoints(work, bucket, fs, rounds), *_tokens(work, bucket, fs, rounds)]
    finally:
        s3server.stop(server)


if __name__ == "__main__":
    common.run_standalone(run)
