"""Decoding for `dtrain generate` and the task evaluation's generation: the next token, greedy
or sampled (temperature, top-k, top-p, from a generator seeded per prompt), until a stop token,
the number of new tokens asked for or the end of the model's window.

The built-in GPT decodes here with its own key/value cache (or, to check it, without one:
the whole sequence again at every step); a Hugging Face model decodes by its own `generate`,
which keeps its cache. Under several ranks every rank runs the same steps (FSDP gathers each
block's weights for each of them): rank 0's token is every rank's, and `generate` is told that
ranks are in step (`synced_gpus`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain.models import GPT
from dtrain.parallel import StageModel, unwrap
from dtrain.process import dist
from dtrain.tasks import logits_of


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else drawn from the softmax of
    the logits / temperature, kept to the `top_k` likeliest and to the smallest set whose
    probability reaches `top_p` (None: no such limit)."""

    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Generated:
    """The new tokens (the stop token left out) and why decoding stopped."""

    ids: list[int]
    stop: str  # "eos" (a stop token), "length" (max_new_tokens) or "window" (the model's)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from the last position's logits (vocabulary,)."""
    if sampling.greedy or generator is None:
        return int(logits.argmax())
    scores = logits.float().cpu() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        # Keep each token whose predecessors' probability is below top_p (the first always).
        dropped = (cumulative - torch.softmax(ordered, dim=-1)) >= sampling.top_p
        scores = scores.scatter(0, order[dropped], float("-inf"))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


def _generator(sampling: Sampling) -> torch.Generator | None:
    return None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)


def gpt_generate(
    model: nn.Module,
    ids: list[int],
    sampling: Sampling,
    stop_ids: frozenset[int],
    device: torch.device,
    vocab: int | None = None,
    cached: bool = True,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> Generated:
    """The built-in GPT's continuation of `ids`. `model` is the model as built for this launch
    (wrapped; called, not unwrapped, so that FSDP gathers its weights); `vocab`: the
    tokenizer's size, when the model's vocabulary is padded beyond it (those ids are never
    chosen). Without `cached`, each step runs the whole sequence again."""
    gpt = inner_gpt(model)
    cache = gpt.new_cache() if cached else None
    return stepwise(model, ids, sampling, stop_ids, device, gpt.seq_len, vocab, cache, autocast)


def stepwise(
    model: Callable[..., Any],
    ids: list[int],
    sampling: Sampling,
    stop_ids: frozenset[int],
    device: torch.device,
    window: int,
    vocab: int | None = None,
    cache: Any = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    source: int = 0,
) -> Generated:
    """Decoding one token a step by calling `model` on the tokens (with the built-in GPT's
    `cache`, only those it has not seen); `source`: the rank whose token every rank takes (a
    pipeline's last stage holds the logits)."""
    generator, tokens = _generator(sampling), list(ids)
    new: list[int] = []
    pending = list(ids)  # what the model has not seen yet
    while True:
        if len(new) == sampling.max_new_tokens:
            return Generated(new, "length")
        if len(tokens) == window:
            return Generated(new, "window")
        step = torch.tensor([pending if cache is not None else tokens], device=device)
        with torch.no_grad(), autocast():
            logits = logits_of(model(step, cache=cache) if cache is not None else model(step))
        logits = logits[0, -1]
        if vocab is not None and vocab < logits.numel():
            logits = logits[:vocab]
        token = dist.broadcast_object(next_token(logits, sampling, generator), source)
        if token in stop_ids:
            return Generated(new, "eos")
        tokens.append(token)
        new.append(token)
        pending = [token]


def is_built_in(model: nn.Module) -> bool:
    """Whether `model` is the built-in GPT (decoded here), not a Hugging Face model (peft's
    wrapper of a LoRA run has a `generate` of its own whatever it wraps: the modules say)."""
    if isinstance(model, StageModel):  # (a pipeline stage's part holds blocks, not the GPT)
        return model.built_in
    return any(isinstance(m, GPT) for m in model.modules())


def window_of(model: nn.Module) -> int:
    """The model's context in tokens: the built-in GPT's, or a Hugging Face model's positions."""
    if isinstance(model, StageModel):
        return model.seq_len if model.built_in and model.seq_len else _positions(model.config)
    if is_built_in(model):
        return inner_gpt(model).seq_len
    inner: Any = unwrap(model)  # and inside a LoRA run's peft wrapper, the model it adapts
    return _positions(
        (inner.get_base_model() if hasattr(inner, "get_base_model") else inner).config
    )


def _positions(config: Any) -> int:
    return int(
        getattr(config, "max_position_embeddings", None)
        or getattr(config, "n_positions", None)
        or 1 << 30
    )


def inner_gpt(model: nn.Module) -> GPT:
    """The GPT inside `model` (a DDP wrapper's, LoRA's)."""
    found = next((m for m in model.modules() if isinstance(m, GPT)), None)
    assert found is not None, "not a built-in GPT"
    return found


def hf_generate(
    model: nn.Module,
    ids: list[int],
    sampling: Sampling,
    stop_ids: frozenset[int],
    pad_id: int,
    window: int,
    device: torch.device,
) -> Generated:
    """A Hugging Face model's continuation of `ids`, by its own `generate` (its key/value
    cache), seeded from `sampling.seed` when it samples."""
    room = window - len(ids)
    limit = min(sampling.max_new_tokens, room)
    options: dict[str, Any] = {"do_sample": not sampling.greedy}
    if sampling.greedy:  # (the folder's generation_config may set sampling's values)
        options.update(temperature=None, top_k=None, top_p=None)
    else:
        options.update(
            temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0
        )
        torch.manual_seed(sampling.seed)
    prompt = torch.tensor([ids], device=device)
    with torch.no_grad():  # (inside DDP's wrapper: FSDP2 shards the module in place)
        out = unwrap(model).generate(  # type: ignore[operator]
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=limit,
            eos_token_id=sorted(stop_ids) or None,
            pad_token_id=pad_id,
            synced_gpus=dist.world_size() > 1,
            **options,
        )
    new = [int(t) for t in out[0, len(ids) :]]
    for i, token in enumerate(new):
        if token in stop_ids:
            return Generated(new[:i], "eos")
    if len(new) < sampling.max_new_tokens and len(new) == room:
        return Generated(new, "window")
    return Generated(new, "length")
