"""Pipeline parallelism for models other than the built-in GPT: a Hugging Face decoder cut at
its layers (its config's base_model_pp_plan) and a model of the user's own cut by their splitter
(parallel.pp.split=module:function), each training as DDP or one process does with the same
global batch; the checkpoint keeps the whole model's names; cuts that cannot work are one line
and exit 2, before any process group where the plan can tell, else on every rank at start-up."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import dtrain, latest, launch
from test_tensor_parallel import _close, _losses
from test_tokens import token_folder

COMMON = [
    "task.name=language_model",
    "optim.name=adamw",
    "optim.lr=0.003",
    "ckpt.monitor=val_loss",
    "ckpt.monitor_mode=min",
    "train.eval_every_epochs=0",
]
MLP = [
    *COMMON,
    "model.name=user_code:mlp_lm",
    "model.args={vocab_size: 256, dim: 32, depth: 4}",
    "data.name=text",
    "data.text.corpus=python_docs",
    "data.text.seq_len=16",
]
SPLIT = ["parallel.pp.size=2", "parallel.pp.split=user_code:split_mlp_lm"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama folder (grouped-query attention, the head tied to the token embedding, 4 layers),
    a Mistral one whose sliding window is on, a GPT-2 one (no base_model_pp_plan), a token
    folder, and the job that trains the Llama."""
    import transformers

    root = tmp_path_factory.mktemp("hf_pp")
    torch.manual_seed(0)
    sizes = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=600,
        max_position_embeddings=128,
    )
    config = transformers.LlamaConfig(**sizes, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama")
    mistral = transformers.MistralConfig(**sizes, sliding_window=16)
    transformers.MistralForCausalLM(mistral).save_pretrained(root / "mistral")
    gpt2 = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=600,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    tokens = token_folder(root / "tokens")
    job = [
        *COMMON,
        f"model.name=hf:{root / 'llama'}",
        "model.args={}",
        "data.name=tokens",
        f"data.root={tokens}",
        "data.tokens.seq_len=32",
        "train.max_steps=8",
    ]
    return root, job


def _whole_names(run_dir, out) -> set[str]:
    """The parameter names of the run's latest checkpoint converted to one file."""
    converted = dtrain("convert", "--checkpoint", str(latest(run_dir)), "--to", "full",
                       "--out", str(out))
    assert converted.returncode == 0, converted.stderr[-2000:]
    return set(torch.load(out / "checkpoint.pt", weights_only=False)["model"])


def test_a_hugging_face_decoder_is_cut_at_its_layers(llama) -> None:
    """pp 2 x dp 2 (1F1B, 4 micro-batches) of a Llama folder: DDP's losses on 4 ranks within
    1e-5 over 8 steps, the tied head's gradients summed between the stages; the checkpoint holds
    the Hugging Face model's own names, one process evaluates it to the run's val_loss, and it
    resumes as pp 2 x tp 2 (the layers split by the config's base_model_tp_plan) with DDP's
    losses to step 12."""
    root, job = llama
    ddp = launch(root / "runs" / "ddp", [*job, "data.batch_size=2", "train.max_steps=12"], nproc=4)
    pp = launch(
        root / "runs" / "pp",
        [*job, "data.batch_size=4", "parallel.pp.size=2"],
        nproc=4,
        timeout=600,
    )
    assert ddp.returncode == 0 and pp.returncode == 0, (ddp.stderr[-2000:], pp.stderr[-2000:])
    _close(_losses(pp.run_dir), _losses(ddp.run_dir), range(1, 9))
    banner = re.sub(r"\n\S+ \S+ +", " ", pp.stderr)  # (its lines joined where it wraps them)
    assert "stage(s) [0] of 2, schedule 1f1b, 4 micro-batches a step" in banner
    names = _whole_names(pp.run_dir, root / "one")
    import transformers

    whole = transformers.LlamaForCausalLM.from_pretrained(root / "llama").state_dict().keys()
    assert set(names) == set(whole) and "model.layers.3.mlp.down_proj.weight" in names
    final = [
        r
        for r in map(json.loads, (pp.run_dir / "metrics.jsonl").read_text().splitlines())
        if "val_loss" in r
    ][-1]
    evaluated = dtrain("eval", str(pp.run_dir), timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert f"val_loss {final['val_loss']:.5f}" in evaluated.stdout
    resumed = launch(
        pp.run_dir,
        [
            *job,
            "data.batch_size=8",
            "parallel.pp.size=2",
            "parallel.tp.size=2",
            "train.max_steps=12",
        ],
        nproc=4,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(step 8, epoch 0)" in resumed.stderr
    _close(_losses(pp.run_dir), _losses(ddp.run_dir), range(1, 13))


def test_a_users_splitter_cuts_a_model_of_their_own(tmp_path) -> None:
    """The user's model cut by their splitter into 2 stages (2 micro-batches): the losses of one
    process with the same batch within 1e-5 over 8 steps, its checkpoint under the model's own
    names; a splitter whose stages do not run the model's forward (its blocks reversed) is one
    line and exit 2 on every rank before a step."""
    one = launch(tmp_path / "one", [*MLP, "data.batch_size=8", "train.max_steps=8"])
    pp = launch(
        tmp_path / "pp",
        [*MLP, *SPLIT, "data.batch_size=8", "train.max_steps=8", "parallel.pp.microbatches=2"],
        nproc=2,
    )
    assert one.returncode == 0 and pp.returncode == 0, (one.stderr[-2000:], pp.stderr[-2000:])
    _close(_losses(pp.run_dir), _losses(one.run_dir), range(1, 9))
    names = _whole_names(pp.run_dir, tmp_path / "whole")
    assert {"embed.weight", "blocks.3.mlp.3.weight", "head.bias"} <= set(names)
    wrong = launch(
        tmp_path / "wrong",
        [*MLP, *SPLIT, "data.batch_size=8", "train.max_steps=2", "parallel.pp.microbatches=2"],
        nproc=2,
        env={"SPLIT_WRONG": "1"},
    )
    assert wrong.returncode != 0 and "exitcode  : 2" in wrong.stderr
    assert (
        "dtrain: config error: parallel.pp.split: model user_code:mlp_lm's stages, run one "
        "after another, do not give the whole model's logits"
    ) in wrong.stderr
    assert not (tmp_path / "wrong" / "checkpoints").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["model.name=hf:{root}/gpt2"],
            "parallel.pp.size: dtrain cannot cut model hf:{root}/gpt2 "
            "into stages (it cuts the built-in gpt, and a Hugging Face decoder by its config's "
            "base_model_pp_plan); give a splitter (parallel.pp.split=module:function) or set "
            "parallel.pp.size=1",
        ),
        (
            ["model.name=hf:{root}/mistral"],
            "parallel.pp.size: model hf:{root}/mistral's config sets "
            "sliding_window, which dtrain's stages do not apply",
        ),
        (
            [
                "model.name=hf:{root}/llama",
                "parallel.pp.stages_per_rank=3",
                "parallel.pp.schedule=interleaved_1f1b",
            ],
            "parallel.pp: 6 stages (pp 2 x 3 per rank) for the 4 blocks of model hf:{root}/llama",
        ),
        (
            [*MLP, "parallel.pp.split=user_code:split_mlp_lm_new_head"],
            "parallel.pp.split: stage 1's parameter '1.weight' is not one of the model's",
        ),
        (
            [*MLP, "parallel.pp.split=user_code:split_mlp_lm_no_head"],
            "parallel.pp.split: the model's parameter 'head.weight' is in no stage (2 in all)",
        ),
        (
            [*MLP, "parallel.pp.split=user_code:no_such_splitter"],
            "parallel.pp.split: 'user_code' has no callable 'no_such_splitter'",
        ),
    ],
)
def test_cuts_that_cannot_work_are_one_line(llama, extra, message) -> None:
    """`dtrain plan` refuses each before any process group: one line, exit 2."""
    root, job = llama
    extra = [e.replace("{root}", str(root)) for e in extra]
    planned = dtrain(
        "plan", "--nproc", "2", *job, "data.batch_size=4", "parallel.pp.size=2", *extra
    )
    lines = planned.stderr.strip().splitlines()
    assert planned.returncode == 2 and len(lines) == 1, planned.stderr
    assert f"dtrain: config error: {message.replace('{root}', str(root))}" in lines[0]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_plan_counts_what_each_stage_keeps_for_its_backward(checkpointing) -> None:
    """`dtrain plan`'s activations of a pipeline stage rank (traced on the meta device, from
    the whole model) are what the real stage's forward saves for its backward on a
    micro-batch (counted by autograd's hooks on real tensors; with activation checkpointing,
    the blocks' inputs and, at the peak, the largest block's own recomputed), times the
    micro-batches that 1F1B holds in flight on each (the pipeline's depth on the first, one
    on the last)."""
    from dtrain import config, models, parallel, tasks
    from dtrain.commands.plan import command as plan
    from dtrain.commands.plan import facts as plan_facts
    from dtrain.commands.plan import footprint
    from dtrain.parallel.blocks import checkpoint_activations
    from dtrain.parallel.cuts import cut_of
    cfg = config.load(None, [
        *COMMON, "model.name=gpt", "model.args={dim: 32, depth: 4, heads: 4}", "data.name=text",
        "data.text.corpus=python_docs", "data.text.seq_len=32", "data.batch_size=16",
        "parallel.pp.size=2", f"model.activation_checkpointing={str(checkpointing).lower()}"])
    facts = plan_facts.model_facts(cfg, 2, 1)
    info = facts.shapes.info
    task = tasks.build(cfg.task, info)
    held = parallel.stage_blocks(facts.model, cfg.parallel.pp, 2, "gpt", facts.blocks)
    traced = footprint.stage_activations(facts.model, cfg, lambda n: task.example_input(info, n),
                                         held, 4)
    model = models.build(cfg.model, info, 0)
    params = {id(p) for p in model.parameters()}

    def saved_by(run) -> int:
        saved: dict[int, int] = {}

        def pack(t):
            base = t._base if t._base is not None else t
            if id(base) not in params:
                saved[id(base)] = base.numel() * base.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return sum(saved.values())

    x, measured = task.example_input(info, 4), []
    for stage in range(2):
        part = cut_of(model, cfg.parallel.pp, 2, "gpt").part(stage)
        inputs, own = x, []
        for block in part.units():  # each block's own, on its real input
            block_input = []
            handle = block.register_forward_pre_hook(lambda _m, a: block_input.append(a[0]))
            saved_by(lambda: part(inputs))
            handle.remove()
            own.append(saved_by(lambda: block(block_input[0])))
        if checkpointing:
            for block in part.units():
                checkpoint_activations(block)
        kept = saved_by(lambda: part(inputs))
        measured.append(kept + max(own) if checkpointing else kept)
        x = part(inputs).detach().requires_grad_()
    assert traced == measured and all(measured)
    shown = plan.report(cfg, nproc=2)
    at_once = [traced[0] * 2, traced[1]]  # (1F1B: 2 micro-batches in flight on the first)
    rank = at_once.index(max(at_once))
    assert f"{plan.size_text(at_once[rank])} in fp32 on stage rank {rank};" in shown
