"""Built-in models, torchvision classifiers by name, and users' models by import path.

Every builder returns a plain nn.Module; `build` seeds the initialisation from `run.seed` so that
every rank starts from the same weights.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from dtrain.config import ModelConfig
from dtrain.data import Datasets
from dtrain.imports import load_callable
from dtrain.errors import UserError


class ConvBlock(nn.Sequential):
    """conv 3x3 -> GroupNorm -> ReLU (-> 2x2 max-pool). GroupNorm, not BatchNorm, keeps the
    model's result independent of how a batch is split into micro-batches or ranks."""

    def __init__(self, cin: int, cout: int, pool: bool) -> None:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                   nn.GroupNorm(min(8, cout), cout), nn.ReLU(inplace=True)]
        if pool:
            layers.append(nn.MaxPool2d(2))
        super().__init__(*layers)


class SimpleCNN(nn.Module):
    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            ConvBlock(in_channels, w, pool=True), ConvBlock(w, 2 * w, pool=True),
            ConvBlock(2 * w, 4 * w, pool=True), ConvBlock(4 * w, 4 * w, pool=False))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convs with BatchNorm and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetSmall(nn.Module):
    """A small residual CNN for 32x32 inputs: three stages of basic blocks."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 16,
                 blocks_per_stage: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        stages, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            blocks = [BasicBlock(cin if j == 0 else cout, cout, stride=1 if i == 0 or j else 2)
                      for j in range(blocks_per_stage)]
            stages.append(nn.Sequential(*blocks))
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TransformerClassifier(nn.Module):
    """A small vision transformer: patch embedding, a stack of identical blocks, a linear head."""

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32,
                 patch_size: int = 4, dim: int = 128, depth: int = 4, heads: int = 4,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if image_size % patch_size:
            raise UserError(f"config error: model.args.patch_size: {patch_size} does not divide "
                            f"the image size {image_size}")
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        # (tokens, dim), not (1, tokens, dim): FSDP shards dim 0, which must not be of size 1.
        self.pos_embed = nn.Parameter(torch.randn((image_size // patch_size) ** 2, dim) * 0.02)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, dropout=dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


BUILTINS: dict[str, Callable[..., nn.Module]] = {
    "simple_cnn": SimpleCNN,
    "resnet_small": ResNetSmall,
    "transformer": TransformerClassifier,
}


def build(cfg: ModelConfig, data: Datasets, seed: int) -> nn.Module:
    """The model named by `model.name`, initialised identically on every rank from `seed`."""
    num_classes = cfg.num_classes or data.num_classes
    if not num_classes:
        raise UserError("config error: model.num_classes: the dataset does not say how many "
                        "classes it has; set model.num_classes")
    torch.manual_seed(seed)
    args: dict[str, Any] = dict(cfg.args)
    try:
        if cfg.name in BUILTINS:
            if cfg.name == "transformer":
                args.setdefault("image_size", data.image_size)
            return BUILTINS[cfg.name](num_classes=num_classes, in_channels=data.in_channels, **args)
        if cfg.name.startswith("tv:"):
            return _torchvision(cfg.name[3:], num_classes, args)
        if ":" in cfg.name:
            model = load_callable(cfg.name, "model.name")(cfg)
            if not isinstance(model, nn.Module):
                raise UserError(f"config error: model.name: {cfg.name} returned "
                                f"{type(model).__name__}, not an nn.Module")
            return model
    except TypeError as e:
        raise UserError(f"config error: model.args: {e}") from None
    raise UserError(f"config error: model.name: unknown model '{cfg.name}'; use one of "
                    f"{', '.join(BUILTINS)}, tv:NAME or module:function")


def _torchvision(name: str, num_classes: int, args: dict) -> nn.Module:
    import torchvision
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        import difflib
        close = difflib.get_close_matches(name, available, n=1)
        hint = f" (did you mean 'tv:{close[0]}'?)" if close else ""
        raise UserError(f"config error: model.name: torchvision has no model '{name}'{hint}")
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **args)
