"""The benchmarks keep working as dtrain changes: every one imports, and those that drive dtrain
in-process (checkpoint save/load, the memory plan) run against today's code. The figures
themselves are measured by `make bench`, never asserted here."""

from __future__ import annotations

import math
import subprocess
import sys

from conftest import REPO, child_env

sys.path.append(str(REPO / "bench"))  # after everything else: its module names are plain


def test_every_benchmark_imports_and_is_listed() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "run_all.py"), "--only", "nothing"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # argparse's error: an unknown name, after every module imported
    assert "unknown benchmark(s) nothing; choose from overhead, checkpoint, memory, frontier, " \
           "startup, pipeline, images, peers, exit_codes" in proc.stderr
    import language_model  # run on its own (`make bench` leaves it out: ten minutes)
    assert callable(language_model.run)
    import bpe_vs_bytes  # run on its own too: ten minutes a side
    assert callable(bpe_vs_bytes.run)
    import ema_cost  # run on its own: the EMA figures of docs/after_training.md
    assert callable(ema_cost.run)
    import hf_memory  # run on its own: the loading figures of docs/fine-tuning.md
    assert callable(hf_memory.main)
    import hf_export_memory  # run on its own: the export figures of docs/after_training.md
    assert callable(hf_export_memory.measure)
    import quantize_speed  # run on its own: int8 against fp32, eager and compiled
    assert callable(quantize_speed.run)
    import quantize_quality  # run on its own: what int8 costs trained runs, through dtrain export
    assert callable(quantize_quality.run)
    import generate_speed  # run on its own: dtrain generate against transformers' generate
    assert callable(generate_speed.measure)
    import task_eval_cost  # run on its own: dtrain eval --tasks against lm-eval on the export
    assert callable(task_eval_cost.measure)


def test_checkpoint_benchmark_runs(tmp_path) -> None:
    import checkpoint_io
    figures = checkpoint_io.run(tmp_path, rounds=1)
    assert [f.name.split(",")[0] for f in figures] == [
        "checkpoint: save throughput dtrain/(torch.save+fsync)",
        "checkpoint: load throughput dtrain/(torch.load+load_state_dict)",
        "checkpoint: async save"]
    assert all(math.isfinite(f.value) and f.value > 0 for f in figures), figures


def test_memory_benchmark_plans_its_model() -> None:
    import memory
    (ddp_state, ddp_total), (fsdp_state, fsdp_total) = memory.planned("ddp"), memory.planned("fsdp")
    assert ddp_state > 2 * 2**30  # 151 M parameters with AdamW: 2.3 GiB
    assert abs(2 * fsdp_state - ddp_state) < 2**20  # half, to the rows an uneven shard adds
    assert 0 < fsdp_total < ddp_total


def test_cuda_check_without_a_device_says_so_and_exits_0() -> None:
    env = dict(child_env(), CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "bench" / "cuda_check.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cuda_check: no CUDA device visible; nothing checked"


def test_cuda_check_reads_the_plans_prediction() -> None:
    import cuda_check
    predicted = cuda_check.plan_total("configs/gpt_text.yaml", ["train.precision=bf16"])
    assert 0.05 < predicted < 1.0  # GiB: the 1.9 M-parameter GPT at batch 32, as `dtrain plan` prints
