"""Users' own models and datasets, loaded by the launcher through `module:function` import paths.

Tests use them to slow a run down, pause inside a save, or record which samples were served,
so that faults are injected from outside the product, as a user's code would cause them.
"""

from __future__ import annotations

import gc
import os
import time

import torch
from torch import nn

from dtrain.data import synthetic
from dtrain.models import SimpleCNN


class SlowCNN(SimpleCNN):
    """SimpleCNN that sleeps in every training forward (to make a run long enough to kill), and
    whose state_dict() waits while the file named by $PAUSE_SAVE_FILE exists (a save in progress
    that a test can kill). With $PAUSE_TRAIN_FILE and $PAUSE_TRAIN_AFTER=N, the training forwards
    after the N-th wait while that file exists (a run held at a known step, however slow the
    machine, until a test has seen what it waits for)."""

    def __init__(self, sleep_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sleep_s = sleep_s
        self.training_forwards = 0
        self.register_state_dict_post_hook(_pause_while_flagged)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.training_forwards += 1
            if self.training_forwards > int(os.environ.get("PAUSE_TRAIN_AFTER", "0")):
                _wait_while(os.environ.get("PAUSE_TRAIN_FILE"))
            if self.sleep_s:
                time.sleep(self.sleep_s)
        return super().forward(x)


def _wait_while(flag: str | None) -> None:
    while flag and os.path.exists(flag):
        time.sleep(0.05)


def _pause_while_flagged(module, state_dict, prefix, local_metadata) -> None:
    _wait_while(os.environ.get("PAUSE_SAVE_FILE"))


def slow_cnn(cfg) -> nn.Module:
    args = dict(cfg.args)
    return SlowCNN(sleep_s=args.pop("sleep_s", 0.05), num_classes=10, in_channels=3, **args)


class ServedLog(torch.utils.data.Dataset):
    """Writes every index it serves to $SERVED_DIR/rank<RANK>.<pid>.txt."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        folder = os.environ["SERVED_DIR"]
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.{os.getpid()}.txt"), "a") as f:
            f.write(f"{index}\n")
        return self.dataset[index]


class Images(torch.utils.data.Dataset):
    """A user's own image dataset: float images scaled to about [-2, 2], with labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = (images.float() / 255 - 0.5) / 0.25, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


def served_synthetic(cfg):
    """The synthetic dataset, logging which training samples are served."""
    train = Images(*synthetic.generate(cfg.synthetic.train_size, "train"))
    val = Images(*synthetic.generate(cfg.synthetic.val_size, "val"))
    served = ServedLog(train)
    served.num_classes = len(synthetic.CLASSES)
    served.sample_shape = (3, synthetic.IMAGE_SIZE, synthetic.IMAGE_SIZE)
    return served, val


class FaultyCNN(SimpleCNN):
    """SimpleCNN that misbehaves on one rank at one training forward call, as a user's buggy
    model or a broken node would: fault is one of 'raise', 'stall', 'kill', 'nan', 'nan_from'.
    With `first_attempt_only`, torchrun's restarted workers behave."""

    def __init__(self, fault: str, at_call: int, on_rank: int = 1, first_attempt_only: bool = False,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.fault, self.at_call, self.on_rank = fault, at_call, on_rank
        armed = not first_attempt_only or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.armed = armed and int(os.environ.get("RANK", "0")) == on_rank
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.training:
            return out
        self.calls += 1
        if self.armed and (self.calls == self.at_call or (self.fault == "nan_from" and self.calls >= self.at_call)):
            if self.fault == "raise":
                raise RuntimeError(f"injected failure in forward call {self.calls}")
            if self.fault == "stall":
                time.sleep(3600)
            if self.fault == "kill":
                os.kill(os.getpid(), 9)
            if self.fault in ("nan", "nan_from"):
                return out * float("nan")
        return out


def faulty_cnn(cfg) -> nn.Module:
    args = dict(cfg.args)
    return FaultyCNN(num_classes=10, in_channels=3, **args)


def empty_data(cfg):
    images, labels = synthetic.generate(10, "val")
    empty = Images(images[:0], labels[:0])
    empty.num_classes, empty.sample_shape = 10, (3, 32, 32)
    return empty, Images(images, labels)


class InfGradCNN(SimpleCNN):
    """SimpleCNN whose loss stays finite while its gradients become infinite at one training
    forward call (on every rank, or on `on_rank`): a backward hook scales the output's gradient
    by inf, as an overflowing custom backward would."""

    def __init__(self, at_call: int, on_rank: int = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at_call, self.calls = at_call, 0
        self.armed = on_rank < 0 or int(os.environ.get("RANK", "0")) == on_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.armed and self.calls == self.at_call:
                out.register_hook(lambda grad: grad * float("inf"))
        return out


def inf_grad_cnn(cfg) -> nn.Module:
    args = dict(cfg.args)
    return InfGradCNN(num_classes=10, in_channels=3, **args)


# Python-level ways to read a tensor's value on the host: on a GPU each waits for the device.
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "__index__")


class CountingCNN(SimpleCNN):
    """SimpleCNN that counts, in its process, every Python-level read of a tensor's value on the
    host, and at each training forward appends the running count to $READS_DIR/rank<RANK>.txt,
    with the number of objects out of the cyclic garbage collector's sight (gc.freeze)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reads = [0]
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kw):
                self.reads[0] += 1
                return _original(tensor, *args, **kw)
            setattr(torch.Tensor, name, counted)
        self.path = os.path.join(os.environ["READS_DIR"], f"rank{os.environ.get('RANK', '0')}.txt")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with open(self.path, "a") as f:
                f.write(f"{self.reads[0]} {gc.get_freeze_count()}\n")
        return super().forward(x)


def counting_cnn(cfg) -> nn.Module:
    return CountingCNN(num_classes=10, in_channels=3, **dict(cfg.args))


class AttemptServedLog(torch.utils.data.Dataset):
    """Writes every training index it serves, in order, to a file of this process of its own:
    $SERVED_DIR/<start time ns>.<host>.ws<WORLD_SIZE>.rank<RANK>.txt. An elastic test attributes
    the files to the run's attempts (which world size, which rank, in which order)."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        import socket
        self.dataset = dataset
        self.name = (f"{time.time_ns()}.{socket.gethostname()}.ws{os.environ.get('WORLD_SIZE', '1')}"
                     f".rank{os.environ.get('RANK', '0')}.txt")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        with open(os.path.join(os.environ["SERVED_DIR"], self.name), "a") as f:
            f.write(f"{index}\n")
        return self.dataset[index]


def attempt_served_synthetic(cfg):
    """The synthetic dataset, each process logging the training samples it serves, in order."""
    train = Images(*synthetic.generate(cfg.synthetic.train_size, "train"))
    val = Images(*synthetic.generate(cfg.synthetic.val_size, "val"))
    served = AttemptServedLog(train)
    served.num_classes = len(synthetic.CLASSES)
    served.sample_shape = (3, synthetic.IMAGE_SIZE, synthetic.IMAGE_SIZE)
    return served, val


class Bigram(nn.Module):
    """A language model whose forward takes the tokens alone (no position_ids)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


def bigram(cfg) -> nn.Module:
    return Bigram(**dict(cfg.args))


def cnn_of_this_code(cfg) -> nn.Module:
    """SimpleCNN (width 8 unless model.args says otherwise) whose code changes between launches
    while its config does not: with $CNN_EXTRA_LAYER set it has one more layer."""
    model = SimpleCNN(num_classes=10, in_channels=3, width=cfg.args.get("width", 8))
    if os.environ.get("CNN_EXTRA_LAYER"):
        model.extra = nn.Linear(2, 2)
    return model


class MlpLM(nn.Module):
    """A language model of the user's own: an embedding, residual MLP blocks and a head (no
    attention: each token's logits from its own embedding)."""

    def __init__(self, vocab_size: int, dim: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(MlpBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class MlpBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                 nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def mlp_lm(cfg) -> nn.Module:
    return MlpLM(**dict(cfg.args))


def split_mlp_lm(model: MlpLM, stage: int, stages: int) -> nn.Module:
    """The user's splitter (parallel.pp.split): the blocks cut evenly, the embedding on the
    first stage and the head on the last; with $SPLIT_WRONG the blocks of a stage run in the
    reverse order (not the model's forward)."""
    per = len(model.blocks) // stages
    parts = list(model.blocks[stage * per:(stage + 1) * per])
    if os.environ.get("SPLIT_WRONG"):
        parts.reverse()
    if stage == 0:
        parts.insert(0, model.embed)
    if stage == stages - 1:
        parts.append(model.head)
    return nn.Sequential(*parts)


def split_mlp_lm_new_head(model: MlpLM, stage: int, stages: int) -> nn.Module:
    """A splitter that makes a module of its own for the last stage: refused."""
    part = split_mlp_lm(model, stage, stages)
    return nn.Sequential(part, nn.Linear(model.head.out_features, 4)) if stage else part


def split_mlp_lm_no_head(model: MlpLM, stage: int, stages: int) -> nn.Module:
    """A splitter that leaves the head out: refused."""
    part = split_mlp_lm(model, stage, stages)
    return part[:-1] if stage == stages - 1 else part
