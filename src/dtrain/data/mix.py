"""Token folders mixed by weight (`data.tokens.mix`): one training set that draws from each
source its share, and one validation set that keeps each window's source. `build` is the
builder of `data.name: tokens`, for one folder (data/tokens.py) and for a mix.

The training order is a pure function of (seed, epoch, position), so that the resumable sampler
hands the dataset positions unshuffled (`orders_itself`) and a resume at any position, onto any
world size, continues exactly as it does for one folder:

- which source position p of an epoch draws from repeats every MIX_PERIOD positions: a pattern
  in which each source holds its quota (its weight, normalised, in 1/MIX_PERIOD ths) laid out so
  that after any n positions each source has drawn within one sample of quota x n / MIX_PERIOD
  (`Interleave`);
- a source's k-th draw of the run is window k mod n of its order for cycle k // n (n: its
  windows), a permutation seeded by the run's seed, the source and the cycle: a source that runs
  out starts a fresh order, and one that is not used up continues where it stood next epoch.

An epoch is as many samples as the sources hold training windows together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dtrain.config import DataConfig
from dtrain.config.data import MIX_PERIOD, mix_names, mix_shares
from dtrain.core.errors import UserError
from dtrain.data import masks as loss_masks
from dtrain.data import tokens as one_folder
from dtrain.data.loaders import NO_SAMPLES, Datasets, Stacked
from dtrain.data.sampler import SampleKey, epoch_and_index, index_of, sample_random, seeded_order
from dtrain.data.tokens import Folder, enough_windows, masks_note, read_folder
from dtrain.data.windows import Windows, check_ids, count_windows
from dtrain.files import names

# Orders of sources' cycles each process keeps (a batch seldom spans more than two per source).
_KEPT_ORDERS = 16


def quotas(weights: Sequence[float]) -> np.ndarray:
    """The weights, normalised, as whole parts of MIX_PERIOD (largest remainders round up):
    every quota is at least 1, as the config allows no weight below 1/MIX_PERIOD of the total."""
    raw = np.asarray(mix_shares(weights), dtype=np.float64) * MIX_PERIOD
    whole = np.floor(raw).astype(np.int64)
    short = MIX_PERIOD - int(whole.sum())
    whole[np.argsort(-(raw - whole), kind="stable")[:short]] += 1
    return whole


class Interleave:
    """Which source each position of an epoch draws from, and how many draws of a source come
    before a position. One period of MIX_PERIOD positions is laid out by earliest deadline:
    at each position, of the sources that would otherwise fall behind their quota there, the
    one whose next draw is due soonest. That keeps every source's count within one sample of
    quota x position / MIX_PERIOD at every position (a plain largest-deficit round robin can
    stray past one sample with three or more sources)."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.quotas = quotas(weights)
        shares = self.quotas.tolist()
        counts = [0] * len(shares)
        pattern = []
        for t in range(1, MIX_PERIOD + 1):  # in plain ints: a period is built in milliseconds
            chosen = min(
                (s for s, q in enumerate(shares) if MIX_PERIOD * counts[s] < q * t),
                key=lambda s: (counts[s] + 1) / shares[s],
            )
            pattern.append(chosen)
            counts[chosen] += 1
        self.pattern = np.array(pattern, dtype=np.int64)
        # before[t, s]: draws of source s in positions [0, t) of the period
        drawn = self.pattern[:, None] == np.arange(len(shares))
        self.before = np.concatenate([np.zeros((1, len(shares)), np.int64), drawn.cumsum(0)])

    def source_at(self, positions: np.ndarray) -> np.ndarray:
        return self.pattern[positions % MIX_PERIOD]

    def drawn_before(self, positions: np.ndarray, sources: np.ndarray) -> np.ndarray:
        """Draws of each `sources[i]` in the epoch's positions [0, positions[i])."""
        periods, inside = np.divmod(positions, MIX_PERIOD)
        return periods * self.quotas[sources] + self.before[inside, sources]


def _assembled(
    sources: Sequence[Windows], which: np.ndarray, windows: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Window `windows[i]` of source `which[i]`, for each i, as one batch (and its masks): each
    source reads its rows at once, in the dtype of the widest source's ids."""
    dtype = max(
        (torch.from_numpy(np.empty(0, w.tensor_dtype)).dtype for w in sources),
        key=lambda d: d.itemsize,
    )
    length = sources[0].seq_len + 1
    tokens = torch.empty((len(which), length), dtype=dtype)
    masked = sources[0].mask is not None
    mask = torch.empty((len(which), length), dtype=torch.uint8) if masked else None
    for s in np.unique(which).tolist():
        rows = np.flatnonzero(which == s)
        part = sources[s].batch(windows[rows].tolist())
        got, got_mask = (part, None) if isinstance(part, torch.Tensor) else part
        tokens[torch.from_numpy(rows)] = got.to(dtype)
        if mask is not None and got_mask is not None:
            mask[torch.from_numpy(rows)] = got_mask
    return tokens, mask


class MixedWindows:
    """The training set of a mix: keys (epoch, position), served in the `Interleave`'s order."""

    orders_itself = True  # the sampler hands over positions: the order is worked out here

    def __init__(self, sources: Sequence[Windows], weights: Sequence[float], seed: int) -> None:
        self.sources, self.interleave = list(sources), Interleave(weights)
        self.sizes = np.array([len(w) for w in sources], dtype=np.int64)
        self.size = int(self.sizes.sum())
        # what one whole epoch draws of each source, whatever part of it a rank count drops
        self.per_epoch = self.interleave.drawn_before(
            np.full(len(sources), self.size), np.arange(len(sources))
        )
        # each source's orders from a seed of its own, so that sources of one size differ; 62
        # bits, as torch's generators take seeds below 2**64 and the cycle is added to it
        self.seeds = [sample_random(seed, s, 0) >> 2 for s in range(len(sources))]
        self._orders: dict[tuple[int, int], Callable[[np.ndarray], np.ndarray]] = {}

    def __len__(self) -> int:
        return self.size

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_orders": {}}

    def locate(self, keys: Sequence[SampleKey]) -> tuple[np.ndarray, np.ndarray]:
        """The source and the window within it of each key."""
        pairs = np.array([epoch_and_index(k) for k in keys], dtype=np.int64).reshape(-1, 2)
        epochs, positions = pairs[:, 0], pairs[:, 1]
        which = self.interleave.source_at(positions)
        drawn = epochs * self.per_epoch[which] + self.interleave.drawn_before(positions, which)
        cycles, inside = np.divmod(drawn, self.sizes[which])
        windows = np.empty_like(inside)
        for s, cycle in {(int(s), int(c)) for s, c in zip(which, cycles, strict=True)}:
            rows = (which == s) & (cycles == cycle)
            windows[rows] = self._order(s, cycle)(inside[rows])
        return which, windows

    def _order(self, source: int, cycle: int) -> Callable[[np.ndarray], np.ndarray]:
        order = self._orders.get((source, cycle))
        if order is None:
            if len(self._orders) >= _KEPT_ORDERS:
                self._orders.pop(next(iter(self._orders)))
            order = seeded_order(int(self.sizes[source]), self.seeds[source], cycle)
            self._orders[(source, cycle)] = order
        return order

    def _batch(self, keys: Sequence[SampleKey]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        tokens, mask = _assembled(self.sources, *self.locate(keys))
        return tokens if mask is None else (tokens, mask)

    def __getitem__(self, key: SampleKey) -> Any:
        return _first(self._batch([key]))

    def __getitems__(self, keys: list[SampleKey]) -> Stacked:
        return Stacked(self._batch(keys))


class SourcedWindows:
    """The validation set of a mix: every source's validation windows in turn, each batch with
    the source index of its windows last ((tokens, [mask,] source)), from which the language
    model task reports val_loss_<name> per source (tasks.py)."""

    def __init__(self, sources: Sequence[Windows]) -> None:
        self.sources = list(sources)
        self.starts = np.cumsum([0, *(len(w) for w in sources)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _batch(self, keys: Sequence[SampleKey]) -> tuple[torch.Tensor, ...]:
        indices = np.array([index_of(k) for k in keys], dtype=np.int64)
        which = np.searchsorted(self.starts, indices, side="right") - 1
        tokens, mask = _assembled(self.sources, which, indices - self.starts[which])
        source = torch.from_numpy(which)
        return (tokens, source) if mask is None else (tokens, mask, source)

    def __getitem__(self, key: SampleKey) -> Any:
        return _first(self._batch([key]))

    def __getitems__(self, keys: list[SampleKey]) -> Stacked:
        return Stacked(self._batch(keys))


def _first(batch: torch.Tensor | tuple[torch.Tensor, ...]) -> Any:
    return batch[0] if isinstance(batch, torch.Tensor) else tuple(part[0] for part in batch)


# ---------------------------------------------------------------------------------------------
# The sources


def _folders(cfg: DataConfig, splits: Sequence[str]) -> list[Folder]:
    """Each entry's folder, read as data.root would be; they must share one vocabulary and
    either all have loss masks or none (a window's targets count one way)."""
    mix = cfg.tokens.mix or []
    folders = [read_folder(dataclasses.replace(cfg, root=e["root"]), splits) for e in mix]
    first = folders[0]
    for i, folder in enumerate(folders[1:], start=1):
        key = f"config error: data.tokens.mix[{i}].root: {folder.root}"
        if folder.vocab_size != first.vocab_size:
            raise UserError(
                f"{key} has vocabulary {folder.vocab_size}, {first.root} (mix[0]) "
                f"{first.vocab_size}: mixed sources must come from one tokenizer"
            )
        if bool(folder.masks) != bool(first.masks):
            has, lacks = (folder, first) if folder.masks else (first, folder)
            raise UserError(
                f"{key}: {has.root} has loss masks and {lacks.root} has none: the sources of "
                f"a mix must all have masks or none"
            )
    return folders


def _bytes_per_token(folders: Sequence[Folder]) -> float | None:
    """The validation set's bytes of text per token: the sources' ratios weighted by their
    validation tokens (without masks; a masked mix's counted tokens are not known here), when
    every source has one."""
    ratios = [f.bytes_per_token["val"] for f in folders]
    if any(r is None for r in ratios) or any(f.masks for f in folders):
        return None
    tokens = [len(f.spans["val"]) for f in folders]
    return sum(r * t for r, t in zip(ratios, tokens, strict=True) if r) / sum(tokens)


def window_counts(cfg: DataConfig, seq_len: int) -> tuple[int, int, dict[str, Any]]:
    """tokens.window_counts, of a mix the windows of all its sources (for `dtrain plan`)."""
    if cfg.tokens.mix is None:
        return one_folder.window_counts(cfg, seq_len)
    folders = _folders(cfg, names.TOKEN_SPLITS)
    stride = cfg.tokens.stride or seq_len
    train = sum(count_windows(len(f.spans["train"]), seq_len, stride) for f in folders)
    val = sum(count_windows(len(f.spans["val"]), seq_len, seq_len) for f in folders)
    return train, val, _info(cfg, folders, seq_len)


def _info(cfg: DataConfig, folders: Sequence[Folder], seq_len: int) -> dict[str, Any]:
    return {
        **folders[0].info(seq_len),
        "bytes_per_token": _bytes_per_token(folders),
        "documents": any(f.info(seq_len)["documents"] for f in folders),
        "sources": mix_names(cfg),
    }


def build(cfg: DataConfig, seed: int, val_only: bool = False) -> Datasets:
    """`data.name: tokens`: one folder's windows (tokens.build), or of a mix each source's
    windows as one folder's, the training windows drawn by weight (`MixedWindows`), the
    validation windows of all sources with their source (`SourcedWindows`)."""
    if cfg.tokens.mix is None:
        return one_folder.build(cfg, seed, val_only)
    folders = _folders(cfg, ("val",) if val_only else names.TOKEN_SPLITS)
    seq_len = cfg.tokens.seq_len
    assert seq_len is not None, "data.build settles data.tokens.seq_len"
    stride = cfg.tokens.stride or seq_len
    val_sets, train_sets = [], []
    for folder in folders:
        for span in folder.spans.values():
            check_ids(span, folder.vocab_size)
        loss_masks.check_windows(folder.meta, folder.root, seq_len, stride)
        val = Windows(
            folder.spans["val"], seq_len, seq_len, folder.vocab_size, folder.masks.get("val")
        )
        enough_windows(val, ", ".join(folder.files["val"]), seq_len, "data.tokens.seq_len")
        val_sets.append(val)
        if not val_only:
            train = Windows(
                folder.spans["train"], seq_len, stride, folder.vocab_size, folder.masks.get("train")
            )
            enough_windows(train, ", ".join(folder.files["train"]), seq_len, "data.tokens.seq_len")
            train_sets.append(train)
    weights = [e["weight"] for e in cfg.tokens.mix or []]
    train_set: Any = NO_SAMPLES if val_only else MixedWindows(train_sets, weights, seed)
    shares = quotas(weights) / MIX_PERIOD
    parts = [
        f"{name} ({round(share * 100, 2):g} %"
        + ("" if val_only else f", {len(train_sets[i])} windows")
        + ")"
        for i, (name, share) in enumerate(zip(mix_names(cfg), shares, strict=True))
    ]
    notes = [
        f"data: mix of {', '.join(parts)}; vocabulary {folders[0].vocab_size}, windows of "
        f"{seq_len + 1} tokens; {sum(len(v) for v in val_sets)} validation windows, each "
        f"source's val_loss_<name> reported"
    ]
    if folders[0].masks:
        for folder in folders:
            notes.append(f"{folder.root}: {masks_note(folder)}")
    return Datasets(train_set, SourcedWindows(val_sets), _info(cfg, folders, seq_len), notes)
