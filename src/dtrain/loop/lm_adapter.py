"""dtrain's model for the language-model evaluation harness (lm-eval): a trained model, as the
run's strategy built it (whole, DDP or FSDP shards), and the run's tokenizer, answering the
harness's three questions: a continuation's log-likelihood, a text's rolling log-likelihood and
what the model says until a stop sequence.

Text is encoded and scored the way the harness scores a Hugging Face model (its `TemplateLM`:
the same split of context and continuation, the same left truncation to the model's window, the
beginning-of-sequence token before a text with nothing before it), so that the numbers equal
the harness's own on the exported folder.

The harness sees one process: every rank is handed every request and computes every metric.
The forwards are spread here: the scoring batches go round the groups of ranks that run a batch
together (each rank, or under tensor and pipeline parallelism each tp group and pipeline:
`parallel.Spread`), every group runs as many forwards as every other (FSDP gathers each block's
weights for all of them at once; a group short of a batch runs its first one again and throws
the answer away), and the answers of the ranks that hold logits are gathered to every rank.
Generation runs in step on every rank, one request at a time (the token of a rank that holds
logits is every rank's), as `dtrain generate` decodes; a pipeline's stages, which keep no cache,
run the whole sequence again at each step. This module imports lm-eval: it is loaded
only after `lm_tasks` has found it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from dtrain.loop.decode import Sampling, gpt_generate, hf_generate, stepwise
from dtrain.models.tokenizer import RunTokenizer
from dtrain.parallel import Evaluator, Spread, unwrap
from dtrain.process import dist
from dtrain.tasks import logits_of

DEFAULT_MAX_GEN_TOKS = 256  # the harness's own default for a generation task

Scored = tuple[float, bool]  # a continuation's log-likelihood, and whether greedy decoding says it


class DtrainLM(TemplateLM):
    """`model` (as built for this launch, in eval mode), `tokenizer` (the run's), `window`: the
    model's context in tokens; `built_in`: the built-in GPT (decoded with its cache, its logits
    cut to the tokenizer's vocabulary), else a Hugging Face model (its own `generate`);
    `spread`: which ranks score together (None: each rank its own batches)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: RunTokenizer,
        window: int,
        device: torch.device,
        built_in: bool,
        batch_size: int = 8,
        autocast: Callable[[], Any] = contextlib.nullcontext,
        spread: Spread | None = None,
    ) -> None:
        super().__init__()
        self.model, self.run_tokenizer, self.window = model, tokenizer, window
        self._device, self.built_in, self.batch_size = device, built_in, max(1, batch_size)
        self.autocast = autocast
        self.spread = spread or Spread(dist.world_size(), dist.rank())

    # --- what the harness asks of a TemplateLM

    @property
    def eot_token_id(self) -> int:
        return self.run_tokenizer.pad_id

    @property
    def prefix_token_id(self) -> int:
        return self.run_tokenizer.prefix_id

    @property
    def tokenizer_name(self) -> str:
        return self.run_tokenizer.where

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """As the harness encodes for a Hugging Face model: a text that begins with the
        beginning-of-sequence token's text gets no second one."""
        bos = self.run_tokenizer.bos_id
        if (
            add_special_tokens is None
            and bos is not None
            and string.startswith(self.run_tokenizer.decode([bos]))
        ):
            add_special_tokens = False
        ids = self.run_tokenizer.encode_text(string, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], **kwargs: Any
    ) -> list[Scored]:
        return self.scored([(context, continuation) for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text in disjoint windows of the model's context, each token predicted from as
        much before it as the window holds; the windows' log-likelihoods summed per text."""
        windows: list[tuple[list[int], list[int]]] = []
        owners: list[int] = []
        for i, request in enumerate(requests):
            (text,) = request.args
            for window in get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.window,
                context_len=1,
            ):
                windows.append(make_disjoint_window(window))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.scored(windows), strict=True):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first of the request's stop sequences (and the end
        of text); the context is cut on the left to leave room for the tokens asked for."""
        said = []
        for request in requests:
            context, options = request.args
            options = dict(options or {})
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            until.append(self.run_tokenizer.decode([self.eot_token_id]))
            new = int(options.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            ids = self.tok_encode(context, left_truncate_len=max(1, self.window - new))
            text = self.run_tokenizer.decode(self._generated(ids, new))
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            said.append(text)
        return said

    # --- the forwards

    def scored(self, pairs: list[tuple[list[int], list[int]]]) -> list[Scored]:
        """The log-likelihood of each (context, continuation), the longest first in batches
        that go round the groups; every rank gets every answer."""
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        groups = self.spread.groups
        mine = batches[self.spread.group :: groups]
        rounds = -(-len(batches) // groups)  # every group runs as many forwards
        answers: dict[int, Scored] = {}
        for round_ in range(rounds):
            if round_ < len(mine):
                batch = mine[round_]
                answers.update(zip(batch, self._forward([pairs[i] for i in batch]), strict=True))
            elif batches:
                self._forward([pairs[i] for i in batches[0]])  # in step with the others
        gathered: dict[int, Scored] = {}
        for part in dist.gather_objects(answers if self.spread.counts else {}):
            gathered.update(part)
        return [gathered[i] for i in range(len(pairs))]

    def _forward(self, pairs: list[tuple[list[int], list[int]]]) -> list[Scored]:
        rows, spans = [], []
        for context, continuation in pairs:
            whole = (context + continuation)[-(self.window + 1) :][:-1]
            rows.append(whole)
            spans.append((len(whole) - len(continuation), continuation))
        width = max(len(row) for row in rows)
        padded = [row + [0] * (width - len(row)) for row in rows]  # right: nothing before moves
        inputs = torch.tensor(padded, dtype=torch.long, device=self._device)
        with torch.no_grad(), self.autocast():
            logits = logits_of(self.model(inputs))
        if self.built_in and self.run_tokenizer.size < logits.shape[-1]:
            logits = logits[..., : self.run_tokenizer.size]  # (a vocabulary padded beyond it)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for row, (start, continuation) in zip(logprobs, spans, strict=True):
            predicted = row[start : start + len(continuation)]
            target = torch.tensor(continuation, dtype=torch.long, device=predicted.device)
            chosen = predicted.gather(1, target.unsqueeze(1)).squeeze(1)
            greedy = bool((predicted.argmax(dim=-1) == target).all())
            out.append((float(chosen.sum()), greedy))
        return out

    def _generated(self, ids: list[int], new: int) -> list[int]:
        sampling = Sampling(new, 0.0, None, None, 0)
        stop = self.run_tokenizer.stop_ids
        if isinstance(self.model, Evaluator):  # a pipeline's stages, one after another
            vocab = self.run_tokenizer.size if self.built_in else None
            return stepwise(
                self.model,
                ids,
                sampling,
                stop,
                self._device,
                self.window,
                vocab,
                autocast=self.autocast,
                source=self.spread.source,
            ).ids
        if self.built_in:
            vocab = self.run_tokenizer.size
            return gpt_generate(
                self.model, ids, sampling, stop, self._device, vocab, autocast=self.autocast
            ).ids
        pad = self.run_tokenizer.pad_id
        model = unwrap(self.model)  # (a DDP wrapper has no `generate`; FSDP's module is itself)
        return hf_generate(model, ids, sampling, stop, pad, self.window, self._device).ids
