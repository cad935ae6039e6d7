"""`dtrain plan --memory-limit`: what fits in the memory of one node, per mode, and the largest
value of a key that does; checked against figures computed here and against the frontier that
real 2-rank launches under a memory cgroup find."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest
from conftest import REPO, dtrain

from dtrain import config, models
from dtrain.commands.plan import command as plan, fit as plan_fit

sys.path.insert(0, str(REPO / "bench"))
import cgroup  # noqa: E402
import frontier  # noqa: E402

MIB = 2**20
# A weight-bound transformer small enough to launch in seconds: 3.2 M parameters a block.
SMALL = ["model.name=transformer", "model.args={dim: 512, depth: 8, heads: 8, patch_size: 4}",
         "optim.name=adamw", "optim.lr=0.001", "data.batch_size=2"]


def _adamw_state_bytes(overrides: list[str]) -> int:
    """Parameters, gradients and AdamW's two moments of a model built for real, plus AdamW's
    scalar step per parameter: what one DDP rank holds."""
    cfg = config.load(None, overrides)
    model = models.build(cfg.model, {"num_classes": 10, "in_channels": 3, "image_size": 32}, 0)
    params = list(model.parameters())
    return sum(4 * 4 * p.numel() for p in params) + 4 * len(params)


def _activations(overrides: list[str]) -> int:
    estimate = plan.estimate(config.load(None, overrides), nproc=2)
    return estimate.memory_for("ddp", "fp32").activations or 0


# A pure function of the depth that the JSON test asks for more than once (depth 8's for the
# peak and again for the job's bytes): each depth's worked out once.
@functools.cache
def _ddp_peak(depth: int) -> int:
    """A DDP rank's peak: the process, its state, what the forward saved, and the backward of
    the last block (twice one block's activations: those of depth d less those of d - 1)."""
    at = [*SMALL, f"model.args.depth={depth}"]
    activations = _activations(at)
    block = activations - _activations([*SMALL, f"model.args.depth={depth - 1}"])
    return plan_fit.PROCESS_BYTES + _adamw_state_bytes(at) + activations + 2 * block


def _ddp_job_bytes(depth: int) -> int:
    return plan_fit.AGENT_BYTES + 2 * _ddp_peak(depth) + plan_fit.NODE_BYTES


def test_plan_json_says_what_fits_and_the_largest_depth() -> None:
    limit = 2 * 2**30
    result = dtrain("plan", "--nproc", "2", "--memory-limit", "2GiB", "--grow",
                    "model.args.depth", "--format", "json", *SMALL, timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert set(found) == {"ddp", "fsdp", "fsdp+ac"}
    assert all(set(v) == {"fits", "peak_bytes_per_rank", "largest"} for v in found.values())
    # DDP's peak per rank and the job's bytes, worked out here from a model built for real
    peak = _ddp_peak(8)
    assert abs(found["ddp"]["peak_bytes_per_rank"] - peak) <= 1024, (found["ddp"], peak)
    assert found["ddp"]["fits"] == (_ddp_job_bytes(8) <= limit)
    # The largest depth: it fits and one more does not
    largest = found["ddp"]["largest"]
    assert _ddp_job_bytes(largest) <= limit < _ddp_job_bytes(largest + 1), largest
    # FSDP holds half the state: it fits more blocks, and checkpointing at least as many
    assert found["fsdp"]["largest"] > 1.5 * largest
    assert found["fsdp+ac"]["largest"] >= found["fsdp"]["largest"]
    assert found["fsdp"]["peak_bytes_per_rank"] < peak


def test_plan_text_suggests_fsdp_or_a_smaller_micro_batch() -> None:
    cfg = config.load(None, [*SMALL, "model.args.depth=10"])
    fits = plan_fit.fit(cfg, nproc=2, limit=2 * 2**30)
    assert not fits["ddp"].fits and fits["fsdp"].fits
    text = plan_fit.render(cfg, 2, 1, 2 * 2**30, "", "text")
    assert "suggested: parallel.mode=fsdp " in text
    assert "ddp      no" in text and "fsdp     yes" in text

    # an activation-bound GPT whose batch of 64 fits no mode: a smaller micro-batch, accumulated
    gpt = config.load(None, ["task.name=language_model", "model.name=gpt",
                             "model.args={dim: 128, depth: 8, heads: 4, seq_len: 256}",
                             "data.name=text", "data.text.corpus=python_docs",
                             "ckpt.monitor=val_loss", "data.batch_size=64"])
    limit = 1536 * MIB
    assert not any(f.fits for f in plan_fit.fit(gpt, nproc=2, limit=limit).values())
    text = plan_fit.render(gpt, 2, 1, limit, "", "text")
    suggested = text.splitlines()[-1]
    batch = int(suggested.split("data.batch_size=")[1].split()[0])
    accum = int(suggested.split("train.grad_accum=")[1].split()[0])
    assert 1 <= batch < 64 and accum == math.ceil(64 / batch), suggested
    smaller = config.load(None, ["task.name=language_model", "model.name=gpt",
                                 "model.args={dim: 128, depth: 8, heads: 4, seq_len: 256}",
                                 "data.name=text", "data.text.corpus=python_docs",
                                 "ckpt.monitor=val_loss", f"data.batch_size={batch}",
                                 f"train.grad_accum={accum}"])
    assert plan_fit.fit(smaller, nproc=2, limit=limit)["fsdp+ac"].fits


@pytest.mark.parametrize("args, message", [
    (["--memory-limit", "6 parsecs"], "plan error: --memory-limit '6 parsecs' is not a size"),
    (["--memory-limit", "0GiB"], "plan error: --memory-limit '0GiB' must be more than 0 bytes"),
    (["--memory-limit", "6GiB", "--grow", "optim.lr"],
     "plan error: --grow optim.lr: its value 0.1 is not an integer"),
    (["--memory-limit", "6GiB", "--grow", "model.depthh"],
     "plan error: --grow model.depthh: no such config key"),
    (["--grow", "data.batch_size"], "plan error: --grow and --format json need --memory-limit"),
])
def test_plan_memory_limit_errors_are_one_line(args: list[str], message: str) -> None:
    result = dtrain("plan", "--nproc", "2", *args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"dtrain: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_sizes_parse_as_memory_limits_do() -> None:
    assert plan_fit.parse_size("6GiB") == plan_fit.parse_size("6G") == 6 * 2**30
    assert plan_fit.parse_size("512MiB") == 512 * MIB
    assert plan_fit.parse_size("1.5GB") == 3 * 2**29
    assert plan_fit.parse_size("123456") == 123456


@pytest.mark.slow
def test_the_measured_frontier_is_where_plan_puts_it(tmp_path: Path) -> None:
    """The largest depth that trains 3 steps, evaluates and checkpoints at 2 ranks in DDP with
    the whole job in a 3 GiB cgroup, found by bisection from plan's answer, is plan's answer
    within 10 % (or 1 below 10)."""
    why = cgroup.available()
    if why:
        pytest.skip(f"no memory cgroup to measure the frontier in: {why}")
    limit = 3 * 2**30
    base = frontier.overrides(tmp_path, ["model.name=transformer",
                                         "model.args={dim: 512, depth: 8, heads: 8, patch_size: 4}",
                                         "data.synthetic.train_size=16",
                                         "data.synthetic.val_size=4", "data.batch_size=2"], "ddp")
    planned = frontier.planned(base, 2, limit)["ddp"].largest
    assert planned and planned > 5, planned
    measured, probes = frontier.largest(lambda v: frontier.probe(tmp_path, base, v, limit).fits,
                                        planned)
    assert abs(planned - measured) <= max(1, 0.1 * measured), (planned, measured, probes)
    assert not list((tmp_path / "runs").glob("probe-*")), "a probe's run directory was left"
