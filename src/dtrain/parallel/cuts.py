"""Where a model is cut into pipeline stages: `Cut` makes each stage's part of the model. The
built-in GPT and a Hugging Face decoder are cut at their blocks (`GPTPart`, `HFPart`); any other
model by a splitter of the user's (parallel.pp.split=module:function, `UserPart`).

A part holds the whole model's own modules, never copies: what a rank holds is named as in the
whole model (`StageModel`), so that a checkpoint of a pipeline run is one of any other layout.
Before a run cuts the model, `Cut.check_whole` runs its stages one after another and compares
their logits with the whole model's: a cut that drops a step the model's forward takes (a
scaled embedding, a mask of its own) is refused in one line, not trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from dtrain.config import PipelineConfig
from dtrain.core.errors import UserError
from dtrain.core.imports import load_callable

# What a stage of a Hugging Face decoder runs: its base model's parts by the names of its
# config's `base_model_pp_plan` (the token embedding, the layers, the final norm), and the head.
HF_PLAN_PARTS = ("embed_tokens", "layers", "norm")
# The logits the stages give may differ from the whole model's by rounding alone.
AGREE = 1e-4


class Part(nn.Module):
    """One stage of a model: `forward` takes the previous stage's output (the first stage, the
    token windows) and the last gives the logits; `units` are its blocks (what FSDP shards and
    activation checkpointing recomputes)."""

    def __init__(self, stage: int, stages: int) -> None:
        super().__init__()
        self.stage, self.first, self.last = stage, stage == 0, stage == stages - 1

    def units(self) -> list[nn.Module]:
        return []


class GPTPart(Part):
    """The built-in GPT's blocks [first, end) under their own names, with the embeddings on the
    first stage and the final norm and head on the last (with the embedding it is tied to,
    unused here: the last stage holds the tied weight under its name, with its optimizer
    state)."""

    tok_emb: nn.Embedding
    pos_emb: nn.Embedding
    drop: nn.Module
    norm: nn.Module
    head: nn.Linear

    def __init__(self, gpt: Any, first: int, end: int, stage: int, stages: int) -> None:
        super().__init__(stage, stages)
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(first, end)})
        if self.last:
            self.tok_emb, self.norm, self.head = gpt.tok_emb, gpt.norm, gpt.head

    def units(self) -> list[nn.Module]:
        return list(self.blocks.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.last else x


class HFPart(Part):
    """A Hugging Face decoder's layers [first, end) under the whole model's names
    (`model.layers.3...`), the token embedding on the first stage, the final norm and head on
    the last. Each stage makes the causal mask and the rotary position embeddings of its input
    itself (the plan passes them between the layers; for whole windows they are the same on
    every stage), so that only the hidden states travel between stages."""

    def __init__(self, model: Any, first: int, end: int, stage: int, stages: int) -> None:
        super().__init__(stage, stages)
        self.config, self.base_name = model.config, model.base_model_prefix
        whole_base, head = getattr(model, self.base_name), model.get_output_embeddings()
        base = nn.Module()
        tied = head.weight is whole_base.embed_tokens.weight
        if self.first or (self.last and tied):
            base.embed_tokens = whole_base.embed_tokens
        base.layers = nn.ModuleDict({str(i): whole_base.layers[i] for i in range(first, end)})
        if hasattr(whole_base, "rotary_emb"):  # (buffers alone, none of them saved)
            base.rotary_emb = whole_base.rotary_emb
        if self.last:
            base.norm = whole_base.norm
        self.add_module(self.base_name, base)
        self.head_name = next(n for n, m in model.named_children() if m is head)
        if self.last:
            self.add_module(self.head_name, head)

    def units(self) -> list[nn.Module]:
        return list(cast(Any, getattr(self, self.base_name)).layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        base = cast(Any, getattr(self, self.base_name))
        if self.first:
            x = base.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device)[None]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=x,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        rotary = base.rotary_emb(x, position_ids=positions) if hasattr(base, "rotary_emb") else None
        for layer in base.layers.values():
            x = layer(x, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        if self.last:
            x = getattr(self, self.head_name)(base.norm(x))
        return x


class UserPart(Part):
    """The module a user's splitter returns for a stage, which runs it as it is."""

    def __init__(self, inner: nn.Module, blocks: list[nn.Module], stage: int, stages: int) -> None:
        super().__init__(stage, stages)
        self.inner, self._blocks = inner, blocks

    def units(self) -> list[nn.Module]:
        inside = {id(m) for m in self.inner.modules()}
        return [block for block in self._blocks if id(block) in inside]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Cut:
    """`model` cut into `stages` stages: `part(stage)` is a stage's part of it."""

    def __init__(self, model: nn.Module, stages: int, make: Callable[[int], Part]) -> None:
        self.model, self.stages, self._make = model, stages, make

    def part(self, stage: int) -> Part:
        return self._make(stage)

    def tied(self) -> set[int]:
        """The parameters (by id) that the first stage and the last both hold: a tied embedding
        and head, whose gradients the two sum."""
        first, last = self.part(0), self.part(self.stages - 1)
        return {id(p) for p in first.parameters()} & {id(p) for p in last.parameters()}

    def check_whole(self, model_name: str, length: int) -> int:
        """Run the stages one after another on a window of `length` tokens (the data's) and
        compare their logits with the whole model's (weights still whole, before any split):
        the vocabulary, or one line where they differ. The random state is left as it was."""
        from dtrain.tasks import logits_of  # (tasks import nothing of parallel)

        model, was_training = self.model, self.model.training
        vocab = _vocab(model)
        device = next(model.parameters()).device
        tokens = (torch.arange(length, device=device)[None] * 7 + 3) % vocab
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                whole = logits_of(model(tokens)).float()
                x = tokens
                for stage in range(self.stages):
                    x = self.part(stage)(x)
                staged = x.float()
        finally:
            model.train(was_training)
        if staged.shape != whole.shape or not torch.allclose(staged, whole, AGREE, AGREE):
            raise UserError(
                f"config error: parallel.pp.split: model {model_name}'s stages, run one after "
                f"another, do not give the whole model's logits (its forward does more than the "
                f"cut runs); give a splitter (parallel.pp.split=module:function) or set "
                f"parallel.pp.size=1"
            )
        return whole.shape[-1]


def cut_of(model: nn.Module, cfg: PipelineConfig, pp: int, model_name: str) -> Cut:
    """The cut of `model` into pp x stages-per-rank stages that parallel.pp asks for, after
    checking that it can be made (`dtrain plan` asks the same of the model on the meta
    device)."""
    from dtrain.models import GPT  # (models import nothing of parallel)

    stages = pp * cfg.local_stages
    if cfg.split != "auto":
        return _user_cut(model, stages, load_callable(cfg.split, "parallel.pp.split"))
    part: type[GPTPart] | type[HFPart]
    if isinstance(model, GPT):
        depth, part = len(model.blocks), GPTPart
    elif _hf_decoder(model, model_name):
        base = getattr(model, cast(Any, model).base_model_prefix)
        depth, part = len(base.layers), HFPart
    else:
        raise UserError(
            f"config error: parallel.pp.size: dtrain cannot cut model {model_name} into stages "
            f"(it cuts the built-in gpt, and a Hugging Face decoder by its config's "
            f"base_model_pp_plan); give a splitter (parallel.pp.split=module:function) or set "
            f"parallel.pp.size=1"
        )
    if stages > depth:
        raise UserError(
            f"config error: parallel.pp: {stages} stages (pp {pp} x {cfg.local_stages} per "
            f"rank) for the {depth} blocks of model {model_name}; use fewer stages or a deeper "
            f"model"
        )
    return Cut(model, stages, lambda s: part(model, *blocks_of(s, stages, depth), s, stages))


def blocks_of(stage: int, stages: int, depth: int) -> tuple[int, int]:
    """The blocks [first, end) of `stage`: as even a cut as there is, the earlier stages taking
    one more where it is not (the last also holds the head)."""
    per, extra = divmod(depth, stages)
    first = stage * per + min(stage, extra)
    return first, first + per + (stage < extra)


def _hf_decoder(model: nn.Module, model_name: str) -> bool:
    """Whether `model` is a Hugging Face causal LM whose config's `base_model_pp_plan` names the
    parts `HFPart` runs, as Llama's, Mistral's and Qwen's do; one line where its config asks
    for a step between them that the stages do not take."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    base = getattr(model, getattr(model, "base_model_prefix", "") or "-", None)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not (
        set(plan) == set(HF_PLAN_PARTS)
        and base is not None
        and all(hasattr(base, name) for name in HF_PLAN_PARTS)
        and isinstance(head, nn.Linear)
    ):
        return False
    sliding = getattr(config, "use_sliding_window", True) is not False
    asked = {
        "sliding_window": sliding and getattr(config, "sliding_window", None) is not None,
        "layer_types": set(getattr(config, "layer_types", None) or ()) - {"full_attention"},
        "final_logit_softcapping": getattr(config, "final_logit_softcapping", None) is not None,
        "attn_logit_softcapping": getattr(config, "attn_logit_softcapping", None) is not None,
    }
    for key, on in asked.items():
        if on:
            raise UserError(
                f"config error: parallel.pp.size: model {model_name}'s config sets {key}, "
                f"which dtrain's stages do not apply (they attend causally over the whole "
                f"window); set it off in model.args, give a splitter "
                f"(parallel.pp.split=module:function) or set parallel.pp.size=1"
            )
    return True


def _user_cut(model: nn.Module, stages: int, split: Callable) -> Cut:
    """A splitter's cut: `split(model, stage, stages)` returns the module of each stage, made of
    the model's own modules (checked: every parameter in some stage, none that is not the
    model's)."""
    from dtrain.parallel.blocks import find_blocks

    blocks = [b for b in find_blocks(model) if b is not model]
    names = {id(p): n for n, p in model.named_parameters()}
    made: dict[int, Part] = {}

    def part(stage: int) -> Part:
        if stage not in made:
            inner = split(model, stage, stages)
            if not isinstance(inner, nn.Module):
                raise UserError(
                    f"config error: parallel.pp.split: the splitter returned "
                    f"{type(inner).__name__} for stage {stage}, not a torch module"
                )
            made[stage] = UserPart(inner, blocks, stage, stages)
        return made[stage]

    held: set[int] = set()
    for stage in range(stages):
        for name, param in part(stage).named_parameters():
            if id(param) not in names:
                raise UserError(
                    f"config error: parallel.pp.split: stage {stage}'s parameter "
                    f"'{name.removeprefix('inner.')}' is not one of the model's; a splitter "
                    f"returns parts of the model it is given, not new ones"
                )
            held.add(id(param))
    missing = [n for i, n in names.items() if i not in held]
    if missing:
        raise UserError(
            f"config error: parallel.pp.split: the model's parameter '{missing[0]}' is in no "
            f"stage ({len(missing)} in all); each must be in one"
        )
    return Cut(model, stages, part)


def _vocab(model: nn.Module) -> int:
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    embedding = embedding or getattr(model, "tok_emb", None)
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else 2
