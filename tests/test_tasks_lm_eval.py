"""`dtrain eval --tasks`: a checkpoint scored on language-model tasks in lm-eval's format, through
dtrain's own model for the harness. A tiny `hf:` Llama trained a few steps on token data; a
local multiple-choice task (a dozen questions, scored by log-likelihood) and a generation task
(exact match). The numbers equal lm-eval's own on the folder `dtrain export --format hf` writes,
metric for metric, in one process and under FSDP on 2 ranks; bad input is one line, exit 2.
A run with `train.eval_tasks` records the same numbers at each evaluation and keeps the best
checkpoint by one."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, child_env, dtrain, launch, torchrun_cmd, without_module
from test_chat_data import save_tiny_llama, write_jsonl

from dtrain.commands.tokenize import command as tokenize
from dtrain.commands.tokenize.settings import Settings
from dtrain.data.text import python_docs

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler:UserWarning")

SEQ = 64
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ)
LM = ["task.name=language_model", "model.args={}", "data.name=tokens", "optim.name=adamw",
      "optim.weight_decay=0.0", "sched.name=none", "ckpt.monitor=val_loss",
      "ckpt.monitor_mode=min", "train.eval_every_epochs=0", f"data.tokens.seq_len={SEQ}"]
WORDS = ["the module", "a function", "the import statement", "a class", "the loop", "a string",
         "the list", "a dictionary", "the file", "an exception", "the value", "a method"]
MC_TASK = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_TASK = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
REFERENCE = """\
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
out = lm_eval.simple_evaluate(model="hf", model_args="pretrained=" + sys.argv[1] + ",dtype=float32",
                              tasks=["tiny_mc", "tiny_gen"], device="cpu", batch_size=1,
                              task_manager=TaskManager(include_path=".", include_defaults=False),
                              bootstrap_iters=0, log_samples=True)
said = {s["doc"]["prompt"]: s["filtered_resps"][0] for s in out["samples"].get("tiny_gen", [])}
print(json.dumps(said))
print(json.dumps(out["results"]))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tasks")
    model = save_tiny_llama(root / "model", LLAMA, template=None)
    corpus = root / "corpus.txt"
    corpus.write_text(python_docs()[:40_000].decode())
    tokenize.tokenize(Settings([str(corpus)], str(root / "plain"), tokenizer_path=str(model)),
                      io.StringIO())
    trained = launch(root / "runs" / "hf", [
        *LM, f"model.name=hf:{model}", f"data.root={root / 'plain'}", "data.batch_size=4",
        "train.max_steps=20", "optim.lr=0.01", "ckpt.format=full"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(MC_TASK)
    (tasks / "gen.yaml").write_text(GEN_TASK)
    write_jsonl(tasks / "mc.jsonl", [
        {"question": f"Question {i}: what does Python call {w}?",
         "choices": [f" {w}", f" {WORDS[(i + 3) % 12]}", " zq xv", f" {WORDS[(i + 7) % 12]}"],
         "answer": i % 4} for i, w in enumerate(WORDS)])
    write_jsonl(tasks / "gen.jsonl", [
        {"prompt": f"In Python, {w} is", "answer": " the"} for w in WORDS[:6]])
    return {"root": root, "run": trained.run_dir, "tasks": tasks}


def scores(result: subprocess.CompletedProcess, run_dir: Path) -> dict[str, float]:
    assert result.returncode == 0, result.stderr[-3000:]
    saved = sorted((run_dir / "evals").glob("*.json"), key=lambda p: p.stat().st_mtime)[-1]
    return {k: v for k, v in json.loads(saved.read_text()).items() if k.startswith("task_")}


def lm_eval_on_the_exported_folder(run, tasks: Path, out: Path) -> tuple[dict, dict[str, str]]:
    """lm-eval's own scores of the run's model, exported to `out` (once), on the tasks in
    `tasks`; and its continuations of the generation task's prompts, by prompt."""
    if not out.exists():
        exported = dtrain("export", "--run-dir", str(run["run"]), "--format", "hf", "--out",
                          str(out))
        assert exported.returncode == 0, exported.stderr[-3000:]
    done = subprocess.run([sys.executable, "-c", REFERENCE, str(out)], cwd=tasks,
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said, results = map(json.loads, done.stdout.strip().splitlines()[-2:])
    return {f"task_{task}_{key.split(',')[0]}": float(v) for task, row in results.items()
            for key, v in row.items() if key.endswith(",none") and "_stderr" not in key}, said


@pytest.fixture(scope="module")
def crafted(run, tmp_path_factory) -> dict[str, Path]:
    """The tasks with the generation task's answers, for every other prompt, the continuation
    lm-eval's model gives it on the exported folder (the others a snowman): its exact match is
    0.5 only where a model continues each prompt as lm-eval's does."""
    out = tmp_path_factory.mktemp("exported") / "folder"
    _, said = lm_eval_on_the_exported_folder(run, run["tasks"], out)
    tasks = tmp_path_factory.mktemp("crafted") / "tasks"
    shutil.copytree(run["tasks"], tasks)
    prompts = [json.loads(line)["prompt"] for line in (tasks / "gen.jsonl").read_text().splitlines()]
    write_jsonl(tasks / "gen.jsonl", [
        {"prompt": prompt, "answer": said[prompt] if i % 2 == 0 else "\u2603"}
        for i, prompt in enumerate(prompts)])
    return {"tasks": tasks, "exported": out}


def test_the_adapter_scores_what_lm_evals_hf_model_scores_on_the_exported_folder(run, crafted,
                                                                                  tmp_path):
    """Every metric as lm-eval's own, the crafted generation task's exact match 0.5."""
    tasks = crafted["tasks"]
    ours = scores(dtrain("eval", "--run-dir", str(run["run"]), "--tasks", str(tasks),
                         timeout=300), run["run"])
    assert set(ours) == {"task_tiny_mc_acc", "task_tiny_mc_acc_norm", "task_tiny_gen_exact_match"}
    theirs, _ = lm_eval_on_the_exported_folder(run, tasks, crafted["exported"])
    assert ours == theirs and theirs["task_tiny_gen_exact_match"] == 0.5
    # From a folder outside any git repository: the same scores, and no line of git's (the
    # harness's own record of the machine, which would run `git describe` there, is not made).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    there = subprocess.run([sys.executable, "-m", "dtrain", "eval", "--run-dir", str(run["run"]),
                            "--tasks", str(tasks)], cwd=elsewhere, env=child_env(),
                           capture_output=True, text=True, timeout=300)
    assert scores(there, run["run"]) == ours
    assert "git" not in there.stderr, there.stderr[-2000:]


@pytest.mark.slow
def test_fsdp_on_two_ranks_scores_what_one_process_scores(run):
    files = f"{run['tasks'] / 'mc.yaml'},{run['tasks'] / 'gen.yaml'}"
    one = scores(dtrain("eval", "--run-dir", str(run["run"]), "--tasks", files, timeout=300),
                 run["run"])
    two = subprocess.run([*torchrun_cmd(2), "-m", "dtrain", "eval", "--run-dir", str(run["run"]),
                          "--tasks", files, "parallel.mode=fsdp"], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert "world size 2" in two.stdout, two.stderr[-3000:]
    assert scores(two, run["run"]) == pytest.approx(one, abs=1e-9)


def test_bad_input_is_one_line_and_exit_2(run, tmp_path) -> None:
    not_a_task = tmp_path / "notes.yaml"
    not_a_task.write_text("title: my notes\n")
    hub = tmp_path / "hub.yaml"
    hub.write_text(textwrap.dedent(MC_TASK).replace("dataset_path: json", "dataset_path: cais/mmlu"))
    cases = [
        ([str(not_a_task)], None,
         f"eval error: --tasks {not_a_task} is not a task file: lm-eval's task config names its "
         f"`task` and `output_type` (multiple_choice, generate_until, loglikelihood, ...)"),
        ([str(hub)], None,
         f"eval error: --tasks {hub}: task tiny_mc: dataset_path cais/mmlu is not a local file's "
         f"reader; nothing is downloaded: use dataset_path: json (or csv, parquet, text, arrow) "
         f"with dataset_kwargs.data_files"),
        ([str(run["tasks"])], without_module(tmp_path / "no_lm_eval", "lm_eval"),
         "missing dependency: --tasks (lm-eval tasks) needs the 'tasks' extra: pip install "
         "'dtrain[tasks]'"),
    ]
    for tasks, env, line in cases:
        result = dtrain("eval", "--run-dir", str(run["run"]), "--tasks", *tasks, env=env)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.strip().splitlines()[-1] == f"dtrain: {line}"


def evaluations(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "val_loss" in r]


def test_a_run_scores_its_tasks_at_each_evaluation_and_keeps_the_best_by_one(run, tmp_path):
    """train.eval_tasks: each evaluation's record holds the task metrics that `dtrain eval
    --tasks` gives on the checkpoint of its step, exactly, and (train.ema) those of the averaged
    weights that `--weights ema` gives; ckpt.monitor on a task metric picks `best`; a resume
    that changes the tasks (no training key) still scores them."""
    model = run["root"] / "model"
    scored = launch(tmp_path / "runs" / "scored", [
        *LM, f"model.name=hf:{model}", f"data.root={run['root'] / 'plain'}", "data.batch_size=4",
        "train.max_steps=20", "optim.lr=0.01", "ckpt.format=full", "train.eval_every_steps=5",
        "ckpt.every_steps=5", "ckpt.keep_last=4", f"train.eval_tasks=[{run['tasks']}]",
        "ckpt.monitor=task_tiny_mc_acc", "ckpt.monitor_mode=max", "train.ema.decay=0.5"],
        timeout=600)
    assert scored.returncode == 0, scored.stderr[-3000:]
    records = evaluations(scored.run_dir)
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    names = {"task_tiny_mc_acc", "task_tiny_mc_acc_norm", "task_tiny_gen_exact_match"}
    tasks = [{k: v for k, v in r.items() if k in names} for r in records]
    averaged = [{k: v for k, v in r.items() if k.startswith("task_") and k.endswith("_ema")}
                for r in records]
    assert all(set(t) == names for t in tasks)
    assert all(set(a) == {f"{name}_ema" for name in names} for a in averaged)
    again = dtrain("eval", "--run-dir", str(scored.run_dir), "--weights", "ema", "--tasks",
                   str(run["tasks"]), timeout=300)
    assert scores(again, scored.run_dir) == averaged[-1]
    best = max(records, key=lambda r: (r["task_tiny_mc_acc"], -r["step"]))  # first of equals
    for pick, expected in (("latest", tasks[-1]), ("best", tasks[records.index(best)])):
        again = dtrain("eval", "--run-dir", str(scored.run_dir), "--checkpoint", pick,
                       "--tasks", str(run["tasks"]), timeout=300)
        assert scores(again, scored.run_dir) == expected, pick
        saved = sorted((scored.run_dir / "evals").glob("*.json"), key=lambda p: p.stat().st_mtime)
        assert json.loads(saved[-1].read_text())["step"] == (20 if pick == "latest" else best["step"])
    # The runs table judges the run by the task metric too.
    listed = dtrain("runs", str(tmp_path / "runs"), "--format", "json")
    assert listed.returncode == 0, listed.stderr[-3000:]
    [row] = json.loads(listed.stdout)
    assert row["monitor"] == "task_tiny_mc_acc" and row["best"] == best["task_tiny_mc_acc"]
    resumed = launch(tmp_path / "runs" / "scored", [
        *LM, f"model.name=hf:{model}", f"data.root={run['root'] / 'plain'}", "data.batch_size=4",
        "train.max_steps=25", "optim.lr=0.01", "ckpt.format=full", "train.eval_every_steps=5",
        "ckpt.every_steps=5", "ckpt.keep_last=4", f"train.eval_tasks=[{run['tasks'] / 'mc.yaml'}]",
        "ckpt.monitor=task_tiny_mc_acc", "ckpt.monitor_mode=max", "train.ema.decay=0.5"],
        timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = evaluations(scored.run_dir)[-1]
    assert last["step"] == 25 and "task_tiny_mc_acc" in last and "task_tiny_gen_exact_match" not in last


ROLL_TASK = """\
task: tiny_roll
dataset_path: json
dataset_kwargs:
  data_files:
    test: roll.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: "{{text}}"
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["data.batch_size=2", "parallel.pp.size=2", "parallel.pp.microbatches=2"],  # pp 2 x dp 2
    ["data.batch_size=2", "parallel.tp.size=2"],  # dp 2 x tp 2
], ids=["pp2_dp2", "dp2_tp2"])
def test_a_run_split_by_tp_or_stages_scores_its_tasks_as_one_process(run, crafted, tmp_path,
                                                                      layout):
    """train.eval_tasks under tensor and pipeline parallelism: each tp group and pipeline scores
    its batches between its ranks (a pipeline's last stage holds the logits, its token is every
    rank's in generation); the record equals one process's `dtrain eval --tasks` on the
    checkpoint: the choices, a rolling log-likelihood's perplexity (a continuous number, to
    float tolerance) and the crafted generation task's exact match of 0.5, which the fixture's
    one-process run of the same config and global batch made (a token taken from a stage
    without logits, or batches split across a group, would change it)."""
    tasks = tmp_path / "tasks"
    shutil.copytree(crafted["tasks"], tasks)
    (tasks / "roll.yaml").write_text(ROLL_TASK)
    text = (run["root"] / "corpus.txt").read_text()
    write_jsonl(tasks / "roll.jsonl", [{"text": text[1000 + 700 * i: 1500 + 700 * i]}
                                       for i in range(4)])
    split = launch(tmp_path / "runs" / "split", [
        *LM, f"model.name=hf:{run['root'] / 'model'}", f"data.root={run['root'] / 'plain'}",
        *layout, "train.max_steps=20", "optim.lr=0.01", "train.eval_every_steps=20",
        f"train.eval_tasks=[{tasks}]"], nproc=4, timeout=600)
    assert split.returncode == 0, split.stderr[-3000:]
    [record] = evaluations(split.run_dir)
    recorded = {k: v for k, v in record.items() if k.startswith("task_")}
    one = scores(dtrain("eval", "--run-dir", str(split.run_dir), "--tasks", str(tasks),
                        timeout=300), split.run_dir)
    assert set(recorded) == set(one) == {
        "task_tiny_mc_acc", "task_tiny_mc_acc_norm", "task_tiny_gen_exact_match",
        "task_tiny_roll_word_perplexity", "task_tiny_roll_bits_per_byte"}
    assert recorded == pytest.approx(one, rel=1e-5)
    assert recorded["task_tiny_gen_exact_match"] == 0.5


def test_bad_eval_tasks_are_one_line_and_exit_2(run, tmp_path) -> None:
    not_a_task = tmp_path / "notes.yaml"
    not_a_task.write_text("title: my notes\n")
    lm = [*LM, f"model.name=hf:{run['root'] / 'model'}", f"data.root={run['root'] / 'plain'}"]
    cases = [
        ([*lm, f"train.eval_tasks=[{not_a_task}]"],
         f"config error: train.eval_tasks {not_a_task} is not a task file: lm-eval's task config "
         f"names its `task` and `output_type` (multiple_choice, generate_until, loglikelihood, ...)"),
        ([*lm, "ckpt.monitor=task_tiny_mc_acc", "ckpt.monitor_mode=max"],
         "config error: ckpt.monitor: 'task_tiny_mc_acc' is a task's metric but train.eval_tasks "
         "names no task; add the task's file to train.eval_tasks"),
        ([*lm, f"train.eval_tasks=[{run['tasks'] / 'gen.yaml'}]", "ckpt.monitor=task_tiny_mc_acc"],
         "config error: ckpt.monitor: 'task_tiny_mc_acc' is no metric of the tasks of "
         "train.eval_tasks (tiny_gen); theirs are task_<name>_<metric>"),
        ([f"train.eval_tasks=[{run['tasks']}]"],  # images: no tokenizer
         "config error: train.eval_tasks: the run has no tokenizer: its model (simple_cnn) has no "
         "folder with one and its data (data.name synthetic) is not a token folder with a "
         "tokenizer.json (dtrain tokenize writes one)"),
    ]
    for overrides, line in cases:
        result = launch(tmp_path / "runs" / "bad", overrides)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.strip().splitlines()[-1] == f"dtrain: {line}"
        assert not (tmp_path / "runs").exists()
