"""`dtrain generate`: what a trained run's model says to a prompt.

    dtrain generate --run-dir DIR [--checkpoint latest|best|PATH] [--weights model|ema]
                    (--prompt TEXT | --prompts FILE | --interactive)
                    [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
                    [--format text|jsonl] [--config X] [section.key=value ...]

The run and its checkpoint are read as `dtrain eval` reads them (`run.trained`: the run's
config.yaml with --config and the overrides on top; the checkpoint chosen by rank 0, full or
sharded, local or in an object store, every file checked against the marker's digests; a LoRA
run's adapters on their base). The model is built from the checkpoint's own record of the
data's vocabulary and window (no data is read but the tokenizer) by the run's parallel strategy
at this launch's world size: one process, or FSDP ranks under torchrun for a model that does
not fit one device. Read-only: nothing in DIR is written; the text goes to stdout (rank 0),
what was loaded to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable

from torch import nn

from dtrain.commands.generate import text
from dtrain.commands.generate.text import COMMAND
from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url
from dtrain.files import names, remote_copies
from dtrain.loop.decode import (
    Generated,
    Sampling,
    gpt_generate,
    hf_generate,
    is_built_in,
    window_of,
)
from dtrain.models import hf
from dtrain.models.tokenizer import RunTokenizer, run_tokenizer
from dtrain.observe import log, setup_logging
from dtrain.parallel.precision import Precision
from dtrain.process import dist
from dtrain.process import env as env_mod
from dtrain.process.layout import Layout
from dtrain.run.trained import (
    check_ema,
    choose,
    fetched,
    layout_here,
    run_config,
    run_dir_and_overrides,
    trained_model,
)


def sampling_of(args: argparse.Namespace) -> Sampling:
    """The decoding options, checked before anything is read."""
    if args.max_new_tokens < 1:
        raise UserError(
            f"usage error: --max-new-tokens {args.max_new_tokens}: generate at least 1 token"
        )
    if args.temperature < 0:
        raise UserError(f"usage error: --temperature {args.temperature}: 0 (greedy) or more")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"usage error: --top-k {args.top_k}: keep at least 1 token")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"usage error: --top-p {args.top_p}: a probability in (0, 1]")
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        raise UserError(
            "usage error: --top-k and --top-p limit sampling: give --temperature T above 0 "
            "(0, the default, is greedy)"
        )
    return Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)


def main(args: argparse.Namespace) -> int:
    run_dir, overrides = run_dir_and_overrides(args.run, args.overrides, COMMAND)
    sampling = sampling_of(args)
    if args.interactive and os.environ.get("RANK", "0") == "0":  # (rank 0 reads the lines)
        text.check_terminal()
    prompts = [args.prompt] if args.prompt is not None else None
    if args.prompts is not None:
        prompts = text.prompts_in(args.prompts)
    with tempfile.TemporaryDirectory(prefix="dtrain-generate-") as copies:
        records = run_dir  # the folder that holds config.yaml
        if is_url(run_dir):
            records = os.path.join(copies, "run")
            saved = os.path.join(records, names.CONFIG)
            remote_copies.fetch_file(run_dir, names.CONFIG, saved, {}, COMMAND)
        cfg = run_config(records, args.config, overrides, args.trust_remote_code, run_dir, COMMAND)
        _check_language_model(cfg)
        tokenizer = run_tokenizer(cfg.data, cfg.model, COMMAND)
        cfg, layout = layout_here(cfg, env_mod.detect())
        dist.init(layout, cfg.dist)
        setup_logging(dist.rank(), cfg.log.all_ranks)
        try:
            chosen = dist.on_main(
                lambda: choose(
                    run_dir, args.checkpoint, cfg, os.path.join(copies, "listing"), COMMAND
                )
            )
            chosen = fetched(
                chosen, os.path.join(copies, "checkpoint"), dict(cfg.run.storage_options)
            )
            if args.weights == "ema":
                dist.on_main(lambda: check_ema(chosen, COMMAND))
            model, precision = trained_model(cfg, layout, chosen, COMMAND, args.weights)
            replier = Replier(model, tokenizer, sampling, layout, precision)
            # Every prompt is checked before any is answered.
            encoded = [replier.encoded(p) for p in prompts] if prompts is not None else []
            log.info(
                f"generating from {chosen.shown} (step {chosen.step}, {chosen.fmt}; "
                f"{args.weights} weights) with "
                f"{tokenizer.where}{' (chat template)' if tokenizer.chat else ''}, window "
                f"{replier.window} tokens, at world size {dist.world_size()}, mode "
                f"{layout.shown_mode(cfg.parallel.mode)}"
            )
            if prompts is not None:
                for prompt, ids in zip(prompts, encoded, strict=True):
                    _show(prompt, ids, replier.reply(ids), tokenizer, args.format)
                log.info(replier.speed())
            else:
                _converse(replier, tokenizer, args.format)
            dist.barrier()
            return 0
        except UserError as e:
            dist.announce_abort(str(e))
            raise
        finally:
            dist.shutdown()


def _check_language_model(cfg: Config) -> None:
    if cfg.model.name == "gpt" or cfg.model.name.startswith(hf.PREFIXES):
        return
    raise UserError(
        f"{COMMAND} error: model.name {cfg.model.name} is not a language model; dtrain generate "
        f"runs the built-in gpt and hf: models"
    )


class Replier:
    """The loaded model and the run's tokenizer: a prompt's ids (checked against the model's
    window), and what the model says after them."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: RunTokenizer,
        sampling: Sampling,
        layout: Layout,
        precision: Precision,
    ) -> None:
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.device, self.precision = layout.device, precision
        self.seconds, self.tokens = 0.0, 0
        self.built_in, self.window = is_built_in(model), window_of(model)

    def encoded(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise UserError(f"{COMMAND} error: the prompt {prompt!r} has no tokens; give some text")
        if len(ids) >= self.window:
            shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
            raise UserError(
                f"{COMMAND} error: the prompt {shown!r} is {len(ids)} tokens, and the model's "
                f"window is {self.window}: nothing could follow it; shorten it"
            )
        return ids

    def reply(self, ids: list[int]) -> Generated:
        """The model's new tokens after `ids` (timed: `speed`)."""
        started = time.perf_counter()
        generated = self._generated(ids)
        self.seconds += time.perf_counter() - started
        self.tokens += len(generated.ids)
        return generated

    def speed(self) -> str:
        """The decoding speed so far, for the log."""
        rate = self.tokens / self.seconds if self.seconds else 0.0
        return f"{self.tokens} new tokens in {self.seconds:.3f} s of decoding: {rate:.1f} tokens/s"

    def _generated(self, ids: list[int]) -> Generated:
        stop = self.tokenizer.stop_ids
        if self.built_in:
            return gpt_generate(
                self.model,
                ids,
                self.sampling,
                stop,
                self.device,
                vocab=self.tokenizer.size,
                autocast=self.precision.autocast,
            )
        return hf_generate(
            self.model, ids, self.sampling, stop, self.tokenizer.pad_id, self.window, self.device
        )


def _show(
    prompt: str, ids: list[int], generated: Generated, tokenizer: RunTokenizer, fmt: str
) -> None:
    """On rank 0: a chat run's reply, another run's prompt and its continuation (text); or one
    JSON line with the ids (jsonl)."""
    if not dist.is_main():
        return
    said = tokenizer.decode(generated.ids)
    if fmt == "jsonl":
        record = {
            "prompt": prompt,
            "text": said,
            "prompt_ids": ids,
            "ids": generated.ids,
            "stop": generated.stop,
        }
        print(json.dumps(record, ensure_ascii=False), flush=True)
    else:
        print(said if tokenizer.chat else prompt + said, flush=True)


def _converse(replier: Replier, tokenizer: RunTokenizer, fmt: str) -> None:
    """A terminal's lines, read by rank 0, each answered (a line too long for the window is
    said so, and the next is read)."""
    lines: Iterable[str] = text.typed_lines() if dist.is_main() else iter(())
    iterator = iter(lines)
    while True:
        line = dist.broadcast_object(next(iterator, None))
        if line is None:
            return
        try:
            ids = replier.encoded(line)
        except UserError as e:
            if dist.is_main():
                print(f"dtrain: {e}", file=sys.stderr, flush=True)
            continue
        _show(line, ids, replier.reply(ids), tokenizer, fmt)
