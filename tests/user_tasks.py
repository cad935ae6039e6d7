"""A user's own task, model and data, loaded by import path: a regression on dict batches, the
way a Hugging Face-style dataset yields them, and broken tasks for the error messages."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from dtrain.models import GPT


class Points(Dataset):
    """{"x": 8 features, "y": a noisy linear function of them}, the same for a given seed."""

    def __init__(self, count: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 8, generator=gen)
        weights = torch.linspace(-1.0, 1.0, 8)
        self.y = self.x @ weights + 0.1 * torch.randn(count, generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index]}


def points(cfg):
    return Points(cfg.synthetic.train_size, 1), Points(cfg.synthetic.val_size, 2)


class Regressor(nn.Module):
    """A small MLP; with `kill_at`, the first torchrun attempt of rank 1 dies at that forward."""

    def __init__(self, kill_at: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.kill_at = kill_at if first_attempt and os.environ.get("RANK") == "1" else 0
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.kill_at:
                os.kill(os.getpid(), 9)
        return self.net(x).squeeze(-1)


def regressor(cfg) -> nn.Module:
    return Regressor(kill_at=cfg.args.get("kill_at", 0))  # ignores the tests' CNN width


class Regression:
    def loss(self, model, batch):
        return F.mse_loss(model(batch["x"]), batch["y"])

    def metrics(self, model, batch):
        error = model(batch["x"]) - batch["y"]
        return {"loss": error.square(), "abs_error": error.abs()}


def regression(cfg):
    return Regression()


class NotScalar(Regression):
    def loss(self, model, batch):
        return (model(batch["x"]) - batch["y"]).square()  # forgot the mean


class NotPerSample(Regression):
    def metrics(self, model, batch):
        return {"loss": (model(batch["x"]) - batch["y"]).square().mean()}


def not_scalar(cfg):
    return NotScalar()


def not_per_sample(cfg):
    return NotPerSample()


def no_metrics(cfg):
    class Half:
        def loss(self, model, batch):
            return model(batch["x"]).mean()
    return Half()


class DictOutputCNN(nn.Module):
    """A classifier that returns {"logits": ...}, as many libraries' models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        return {"logits": self.body(x)}


def dict_output_cnn(cfg) -> nn.Module:
    return DictOutputCNN()


class OwnLossGPT(GPT):
    """A language model in the Hugging Face style: keyword inputs, its own loss in `.loss`."""

    class Output:
        def __init__(self, loss, logits):
            self.loss, self.logits = loss, logits

    def forward(self, input_ids, labels):  # type: ignore[override]
        logits = super().forward(input_ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        return self.Output(loss, logits)


def own_loss_gpt(cfg) -> nn.Module:
    return OwnLossGPT(vocab_size=256, seq_len=32, dim=32, depth=1, heads=2)


class TokenDicts(Dataset):
    """Byte windows of the built-in corpus as {"input_ids", "labels"} dicts."""

    def __init__(self, split: str) -> None:
        from dtrain.data.text import python_docs
        data = torch.frombuffer(bytearray(python_docs()[:20000]), dtype=torch.uint8).long()
        data = data[:16000] if split == "train" else data[16000:]
        self.windows = data.unfold(0, 33, 32)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window[:-1], "labels": window[1:]}


def token_dicts(cfg):
    return TokenDicts("train"), TokenDicts("val")


class SlowGPT(GPT):
    """A GPT that sleeps in every training forward: slow enough to be killed mid-run."""

    def forward(self, tokens):  # type: ignore[override]
        if self.training:
            import time
            time.sleep(0.05)
        return super().forward(tokens)


def slow_gpt(cfg) -> nn.Module:
    return SlowGPT(**cfg.args)


def five_classes(cfg):
    """The synthetic images with labels folded into five classes (another head than the
    built-in set's ten), as float images a user's dataset would give."""
    from user_code import Images
    from dtrain.data import synthetic
    train = Images(*synthetic.generate(cfg.synthetic.train_size, "train"))
    val = Images(*synthetic.generate(cfg.synthetic.val_size, "val"))
    train.labels, val.labels = train.labels % 5, val.labels % 5
    train.num_classes = 5
    return train, val


class InitWeightsNet(nn.Module):
    """A user's model that initialises itself in `init_weights()`, called by its constructor:
    truncated normals, Xavier and constants, as transformer codebases do."""

    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.empty(64, width))
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(2))
        self.head = nn.Linear(width, 10)
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.embed, std=0.02)
        for layer in self.layers:
            nn.init.xavier_uniform_(layer[0].weight)
            nn.init.trunc_normal_(layer[2].weight, std=0.02, a=-0.04, b=0.04)
            nn.init.constant_(layer[0].bias, 0.01)
            nn.init.zeros_(layer[2].bias)
        nn.init.normal_(self.head.weight, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)[:, :64] @ self.embed
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def init_weights_net(cfg) -> nn.Module:
    return InitWeightsNet(**{k: v for k, v in cfg.args.items() if k == "width"})


class OrthogonalNet(InitWeightsNet):
    """Its constructor draws an orthogonal matrix (a QR decomposition of the whole weight):
    it cannot be built shard by shard, so FSDP builds it whole, saying why."""

    def init_weights(self) -> None:
        super().init_weights()
        nn.init.orthogonal_(self.layers[0][0].weight)


def orthogonal_net(cfg) -> nn.Module:
    return OrthogonalNet(**{k: v for k, v in cfg.args.items() if k == "width"})


def rmsprop(groups, cfg):
    """A user's optimizer by import path: called with the parameter groups and the config."""
    return torch.optim.RMSprop(groups, lr=cfg.lr)


def halving(optimizer, cfg, total_steps):
    """A user's schedule by import path: the lr halves every 2 steps."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
