"""Built-in models (image classifiers and a GPT-style language model), torchvision classifiers by
name, and users' models by import path; `hf.py` builds Hugging Face models, `lora.py` adds
low-rank adapters, `spec.py` says what kind of model a run trains, `quantize.py` makes int8
copies of a model (torchao), `tokenizer.py` reads a language model's tokenizer (the model
folder's or the token folder's).

Every builder returns a plain nn.Module; `build` seeds the initialisation from `run.seed` so that
every rank starts from the same weights.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.config import ModelConfig, registry
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import load_callable, require
from dtrain.models.kv_cache import KVCache, LayerCache
from dtrain.models.spec import spec_of


class ConvBlock(nn.Sequential):
    """conv 3x3 -> GroupNorm -> ReLU (-> 2x2 max-pool). GroupNorm, not BatchNorm, keeps the
    model's result independent of how a batch is split into micro-batches or ranks."""

    def __init__(self, cin: int, cout: int, pool: bool) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.GroupNorm(min(8, cout), cout),
            nn.ReLU(inplace=True),
        ]
        if pool:
            layers.append(nn.MaxPool2d(2))
        super().__init__(*layers)


class SimpleCNN(nn.Module):
    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            ConvBlock(in_channels, w, pool=True),
            ConvBlock(w, 2 * w, pool=True),
            ConvBlock(2 * w, 4 * w, pool=True),
            ConvBlock(4 * w, 4 * w, pool=False),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes)
        )

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
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetSmall(nn.Module):
    """A small residual CNN for 32x32 inputs: three stages of basic blocks."""

    def __init__(
        self, num_classes: int, in_channels: int = 3, width: int = 16, blocks_per_stage: int = 1
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        stages, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            blocks = [
                BasicBlock(cin if j == 0 else cout, cout, stride=1 if i == 0 or j else 2)
                for j in range(blocks_per_stage)
            ]
            stages.append(nn.Sequential(*blocks))
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim),
            nn.GELU(),
            nn.Linear(mlp_ratio * dim, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TransformerClassifier(nn.Module):
    """A small vision transformer: patch embedding, a stack of identical blocks, a linear head."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 32,
        patch_size: int = 4,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise UserError(
                f"config error: model.args.patch_size: {patch_size} does not divide "
                f"the image size {image_size}"
            )
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        # (tokens, dim), not (1, tokens, dim): FSDP shards dim 0, which must not be of size 1.
        self.pos_embed = nn.Parameter(torch.randn((image_size // patch_size) ** 2, dim) * 0.02)
        self.blocks = nn.ModuleList(
            TransformerBlock(dim, heads, dropout=dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


class SelfAttention(nn.Module):
    """Multi-head self-attention through F.scaled_dot_product_attention (causal for language)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, causal: bool = False) -> None:
        super().__init__()
        if dim % heads:
            raise UserError(
                f"config error: model.args: dim {dim} is not divisible by heads {heads}"
            )
        self.head_dim, self.dropout, self.causal = dim // heads, dropout, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """With `mask` (bool, True where a query may see a key), that mask replaces causality.
        With `cache` (generation), `x` follows the tokens whose keys and values it holds: they
        join them, and each query sees them all and the new tokens up to its own."""
        # The heads are counted from the projection's width, and the tokens from its output,
        # not from x: under tensor parallelism this rank's projection holds its own heads only,
        # and with sequence parallelism x its part of the sequence (parallel/tensor.py).
        qkv = self.qkv(x)
        batch, tokens = qkv.shape[:2]
        qkv = qkv.view(batch, tokens, 3, -1, self.head_dim)
        q, k, v = qkv.unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        causal = self.causal and mask is None
        if cache is not None:
            k, v = cache.extend(k, v)
            mask = cache.mask(tokens, causal, x.device)
            causal = False
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
        )
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class GPTBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout, causal=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), mask, cache))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """A decoder-only transformer language model: token and position embeddings, a stack of
    GPTBlocks, a final norm and an output head tied to the token embedding.

    `position_ids` (batch, length), as Hugging Face models take them for packed sequences: a
    document starts wherever a position does not follow the one before it by 1; each token
    attends to the tokens of its own document alone, at its positions.

    `cache` (a `KVCache`, for generation): `tokens` continue the sequence whose keys and values
    it holds, at the positions after it; training never passes one."""

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 256,
        dim: int = 256,
        depth: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        for module in self.modules():  # GPT-2's initialisation: N(0, 0.02), biases 0
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                bias = getattr(module, "bias", None)  # an Embedding has none
                if isinstance(bias, torch.Tensor):
                    nn.init.zeros_(bias)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        start = 0 if cache is None else cache.length
        length = start + tokens.shape[1]
        if length > self.seq_len:
            raise ValueError(
                f"sequence of {length} tokens, longer than the model's seq_len {self.seq_len}"
            )
        mask = None if position_ids is None else block_causal(position_ids)
        if position_ids is None:
            position_ids = torch.arange(start, length, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(position_ids))
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None if cache is None else cache.layers[i])
        return self.head(self.norm(x))

    def new_cache(self) -> KVCache:
        """An empty key/value cache for generating with this model."""
        return KVCache(len(self.blocks))


def block_causal(position_ids: torch.Tensor) -> torch.Tensor:
    """The (batch, 1, length, length) attention mask of packed documents: causal, and within
    the document of each query (documents split where positions do not count up by 1)."""
    first = position_ids[:, :1] - 1
    documents = (torch.diff(position_ids, prepend=first, dim=1) != 1).cumsum(dim=1)
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    same = documents[:, :, None] == documents[:, None, :]
    return (same & causal)[:, None]


def model_info(cfg: ModelConfig, info: dict[str, Any]) -> dict[str, Any]:
    """What rebuilding the model needs besides its config: the datasets' info, with the number
    of classes of the config when it sets one (saved in checkpoints for `dtrain export`)."""
    return {**info, "num_classes": cfg.num_classes or info.get("num_classes")}


class Weights(enum.Enum):
    """What `build` gives the model's parameters."""

    LOAD = "load"  # its own: drawn from the seed, or read from the files it names (`hf:`)
    LATER = "later"  # left for the caller to fill (nothing drawn, nothing read): FSDP's reads
    NONE = "none"  # shapes alone, on the meta device: `dtrain plan` planning a run


def build(
    cfg: ModelConfig, info: dict[str, Any], seed: int, weights: Weights = Weights.LOAD
) -> nn.Module:
    """The model named by `model.name` (see registry.MODELS), initialised identically on every
    rank from `seed`, with LoRA adapters when model.lora.r is set. `info` is what the datasets
    say (number of classes, channels, image size, vocabulary, ...). A builder that reads weights
    from files takes `weights` as a keyword and is told what to do with them; under
    `Weights.NONE` every builder runs on the meta device."""
    with torch.device("meta") if weights is Weights.NONE else contextlib.nullcontext():
        return _built(cfg, info, seed, weights)


def _built(cfg: ModelConfig, info: dict[str, Any], seed: int, weights: Weights) -> nn.Module:
    builder = registry.MODELS.builder(cfg.name)
    told = {"weights": weights} if "weights" in inspect.signature(builder).parameters else {}
    torch.manual_seed(seed)
    try:
        model = builder(cfg, info, **told)
    except (TypeError, ValueError, RuntimeError, ArithmeticError) as e:
        # A builder's (or torch's) refusal of a value: the config's, one line naming the key.
        raise UserError(
            f"config error: model.args: {cfg.name} cannot be built with {cfg.args} "
            f"({first_line(e)})"
        ) from None
    spec = spec_of(cfg)
    if spec.adapters:
        # The adapters' initialisation is seeded on its own: what building the base drew from
        # the generator depends on how it was built (from a file, shard by shard, ...).
        torch.manual_seed(seed)
    return spec.adapt(model, cfg.num_classes or info.get("num_classes"))


# ---------------------------------------------------------------------------------------------
# Builders, by registry.MODELS: (model config, datasets' info) -> nn.Module


def _num_classes(cfg: ModelConfig, info: dict[str, Any]) -> int:
    num_classes = cfg.num_classes or info.get("num_classes")
    if not num_classes:
        raise UserError(
            "config error: model.num_classes: the dataset does not say how "
            "many classes it has; set model.num_classes"
        )
    return num_classes


def _classifier(
    cls: Callable[..., nn.Module], cfg: ModelConfig, info: dict[str, Any], **defaults: Any
) -> nn.Module:
    return cls(
        num_classes=_num_classes(cfg, info),
        in_channels=info.get("in_channels", 3),
        **{**defaults, **cfg.args},
    )


def build_simple_cnn(cfg: ModelConfig, info: dict[str, Any]) -> nn.Module:
    return _classifier(SimpleCNN, cfg, info)


def build_resnet_small(cfg: ModelConfig, info: dict[str, Any]) -> nn.Module:
    return _classifier(ResNetSmall, cfg, info)


def build_transformer(cfg: ModelConfig, info: dict[str, Any]) -> nn.Module:
    return _classifier(TransformerClassifier, cfg, info, image_size=info.get("image_size", 32))


def build_gpt(cfg: ModelConfig, info: dict[str, Any]) -> nn.Module:
    """The vocabulary and window length come from the data (text, token files); a vocabulary
    pinned in model.args may be larger than the data's (nanoGPT pads 50257 to 50304 for
    speed), never smaller."""
    args: dict[str, Any] = dict(cfg.args)
    for key in ("vocab_size", "seq_len"):
        if key not in args and key not in info:
            raise UserError(
                f"config error: model.args.{key}: the data does not say it "
                f"(data.name: text and tokens do); set model.args.{key}"
            )
        args.setdefault(key, info.get(key))
    data_vocab = info.get("vocab_size")
    if data_vocab and args["vocab_size"] < data_vocab:
        raise UserError(
            f"config error: model.args.vocab_size: {args['vocab_size']} is smaller than the "
            f"data's vocabulary ({data_vocab}); leave it unset to take the data's"
        )
    return GPT(**args)


def build_user(cfg: ModelConfig, info: dict[str, Any]) -> nn.Module:
    """A user's model builder by import path, called with the model config."""
    model = load_callable(cfg.name, "model.name")(cfg)
    if not isinstance(model, nn.Module):
        raise UserError(
            f"config error: model.name: {cfg.name} returned "
            f"{type(model).__name__}, not an nn.Module"
        )
    return model


def build_torchvision(cfg: ModelConfig, info: dict[str, Any]) -> nn.Module:
    """`tv:NAME`: torchvision's classifier NAME, untrained, with the data's number of classes."""
    import torchvision

    name = cfg.name.removeprefix("tv:")
    num_classes = _num_classes(cfg, info)
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        close = difflib.get_close_matches(name, available, n=1)
        hint = f" (did you mean 'tv:{close[0]}'?)" if close else ""
        raise UserError(f"config error: model.name: torchvision has no model '{name}'{hint}")
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **cfg.args)


def build_timm(cfg: ModelConfig, info: dict[str, Any]) -> nn.Module:
    """`timm:NAME`: timm's model NAME, untrained, with the data's classes and channels (its
    pretrained weights, with model.pretrained, come from the local Hugging Face cache)."""
    timm = require("timm", "timm", f"model.name: {cfg.name}")
    name = cfg.name.removeprefix("timm:")
    available = timm.list_models()
    if timm.models.get_arch_name(name) not in available:
        close = difflib.get_close_matches(name, available, n=1)
        hint = f" (did you mean 'timm:{close[0]}'?)" if close else ""
        raise UserError(f"config error: model.name: timm has no model '{name}'{hint}")
    args = {"in_chans": info.get("in_channels", 3), **cfg.args}
    return timm.create_model(name, pretrained=False, num_classes=_num_classes(cfg, info), **args)
