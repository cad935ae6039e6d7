"""Chat data: `dtrain tokenize --chat` renders conversations with the tokenizer folder's own chat
template (one without generation markers), its ids are apply_chat_template's, and its loss masks
count the assistant's replies and their end-of-turn token, nothing else; `language_model` then
learns and measures on those tokens alone (checked against a masked cross-entropy computed here
on the saved weights); bad rows are one line naming the row, exit 2 and nothing written."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from conftest import latest, launch, unwrapped

from dtrain import cli, config
from dtrain.commands.tokenize import command as tokenize
from dtrain.commands.tokenize.settings import Settings
from dtrain.core.errors import UserError
from dtrain.data import build, node_copy
from dtrain.data.text import python_docs
from dtrain.models import GPT
from dtrain.tasks import logits_of

# In-process commands run under torch's error recorder, which cannot install its fault handler
# on pytest's captured stderr and says so.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler:UserWarning")

SEQ = 128
SPECIAL = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
# A template as most are: headers and an end-of-turn token, no {% generation %} markers.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GPT_ARGS = f"model.args={{dim: 32, depth: 1, heads: 2, seq_len: {SEQ}}}"


def save_tokenizer(folder: Path, template: str | None = TEMPLATE) -> Path:
    """A byte-level BPE of 400 ids trained on the built-in corpus, saved as a model folder."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator([python_docs()[:60_000].decode()], tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    own = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    if template is not None:
        own.chat_template = template
    own.save_pretrained(folder)
    return folder


def save_tiny_llama(folder: Path, llama: dict, template: str | None = TEMPLATE) -> Path:
    """`save_tokenizer`'s folder with a Llama of its vocabulary (`llama`: LlamaConfig's sizes),
    drawn from seed 0: an `hf:` model folder a test makes."""
    save_tokenizer(folder, template)
    own = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **llama, vocab_size=len(own), eos_token_id=own.eos_token_id)).save_pretrained(folder)
    return folder


def conversation(k: int) -> list[dict]:
    """Conversation k: a system message for some, one to three exchanges, a tool's answer in
    some, and no reply at all in every seventh (it only gives context)."""
    messages = [{"role": "system", "content": "Réponds brièvement."}] if k % 3 == 0 else []
    for turn in range(1 + k % 3):
        messages.append({"role": "user", "content": f"{k} times {turn}?"})
        if k % 5 == 1:
            messages.append({"role": "tool", "content": f"= {k * turn}"})
        if k % 7 != 6:
            messages.append({"role": "assistant", "content": f"It is {k * turn}."})
    return messages


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> dict:
    """One tokenized folder for the module: 90 training conversations and, for validation, two
    with replies around one without any that fills a window of its own (a window that counts
    no token)."""
    root = tmp_path_factory.mktemp("chat")
    folder = save_tokenizer(root / "model")
    own = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    train = [{"messages": conversation(k)} for k in range(90)]
    long_question = "Tell me about the sampler. "
    while len(own.apply_chat_template([{"role": "user", "content": long_question}])
              ["input_ids"]) < SEQ * 3 // 4:
        long_question += "And the windows. "
    val = [{"messages": conversation(100)},
           {"messages": [{"role": "user", "content": long_question}]},
           {"messages": conversation(101)}]
    out = root / "tokens"
    meta = tokenize.tokenize(Settings([str(write_jsonl(root / "train.jsonl", train))], str(out),
                                      tokenizer_path=str(folder), chat=True, seq_len=SEQ,
                                      val_inputs=[str(write_jsonl(root / "val.jsonl", val))]),
                             io.StringIO())
    return {"root": root, "model": folder, "own": own, "out": out, "meta": meta,
            "rows": {"train": train, "val": val}}


def read_split(out: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    ids = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
    return ids, np.fromfile(out / f"{split}.mask", dtype=np.uint8)


def documents(ids: np.ndarray, mask: np.ndarray) -> list[tuple[int, int]]:
    """The (start, stop) of each document a split's mask marks (STARTS), the last pad included."""
    starts = [*np.flatnonzero(mask & 2).tolist(), len(ids)]
    assert starts[0] == 0
    return list(zip(starts[:-1], starts[1:], strict=True))


def test_the_ids_are_the_templates_and_the_masks_count_the_replies_alone(chat) -> None:
    """Each conversation is one document of the files, its ids apply_chat_template's, whole in
    a block of SEQ tokens; the rest of a block is padding (the pad id, counted nowhere, its
    first token marked as a start); the masks count the replies and their end of turn."""
    own, out, meta = chat["own"], chat["out"], chat["meta"]
    pad = own.eos_token_id
    for split, rows in chat["rows"].items():
        ids, mask = read_split(out, split)
        assert len(ids) == len(mask) == meta["tokens"][split] and len(ids) % SEQ == 1
        expected = {tuple(own.apply_chat_template(r["messages"])["input_ids"]): r for r in rows}
        found, padding = [], 0
        for start, stop in documents(ids, mask):
            piece = tuple(ids[start:stop].tolist())
            if piece in expected:
                assert start // SEQ == (stop - 1) // SEQ  # whole in one block
                found.append(piece)
                runs, current = [], []
                for token, flag in zip(piece, mask[start:stop], strict=True):
                    if flag & 1:
                        current.append(token)
                    elif current:
                        runs, current = [*runs, current], []
                runs += [current] if current else []
                row = expected[piece]
                assert [own.decode(r) for r in runs] == [
                    m["content"] + "<|end|>" for m in row["messages"] if m["role"] == "assistant"]
            else:  # padding: to the end of its block (and the split's last token)
                assert set(piece) == {pad} and not (mask[start:stop] & 1).any()
                assert stop % SEQ in (0, 1) and (stop == len(ids) or stop % SEQ == 0)
                padding += stop - start
        assert sorted(found) == sorted(expected)
        assert padding - 1 == meta["packed"]["padding"][split]  # (the split's closing pad)
        assert meta["counted"][split] == int((mask & 1).sum())
        assert meta["documents"][split] == len(rows)
        assert meta["bytes"][split] == sum(len(m["content"].encode()) + 1 for r in rows
                                           for m in r["messages"] if m["role"] == "assistant")
    assert meta["packed"]["seq_len"] == SEQ
    assert meta["chat"] == {"template_from": "chat_template.jinja", "template": TEMPLATE}
    assert meta["mask"] == "the assistant's replies, each with the end-of-turn token after it"
    written = json.loads((out / "meta.json").read_text())
    assert set(written["digests"]) == {"tokenizer.json", "train.bin", "train.mask", "val.bin",
                                    "val.mask"}


def test_a_saved_dataset_and_a_held_out_part_and_a_plain_overwrite(chat, capsys) -> None:
    """The rows as a `save_to_disk` folder give the JSON lines' files byte for byte; without
    --val the last tenth of the windows is held out, whole; a plain `tokenize --overwrite` of
    the folder leaves no mask behind."""
    root, rows = chat["root"], chat["rows"]["train"]
    datasets.Dataset.from_list(rows).save_to_disk(str(root / "saved"))
    out = root / "from_saved"
    code = cli.main(["tokenize", str(root / "saved"), "--chat", "--tokenizer", str(chat["model"]),
                     "--seq-len", str(SEQ), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    summary = capsys.readouterr().out
    held = json.loads((out / "meta.json").read_text())
    assert f"{len(rows)} conversations packed in windows of {SEQ} (" in summary
    assert held["val_from"] == "the last 0.1 of the windows"
    train_ids, train_mask = read_split(out, "train")
    val_ids, val_mask = read_split(out, "val")
    whole_ids, whole_mask = read_split(chat["out"], "train")
    blocks = (len(whole_ids) - 1) // SEQ
    assert (len(val_ids) - 1) // SEQ == blocks // 10 and (len(train_ids) - 1) % SEQ == 0
    assert np.concatenate([train_ids[:-1], val_ids]).tolist() == whole_ids.tolist()
    assert np.concatenate([train_mask[:-1], val_mask]).tolist() == whole_mask.tolist()
    assert held["counted"]["train"] + held["counted"]["val"] == chat["meta"]["counted"]["train"]
    assert held["documents"]["train"] + held["documents"]["val"] == len(rows)

    (root / "plain.txt").write_text("plain text, no conversation\n" * 20)
    code = cli.main(["tokenize", str(root / "plain.txt"), "--tokenizer", str(chat["model"]),
                     "--out", str(out), "--overwrite"])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin",
                                                     "val.bin"]


def bad_inputs(root: Path, chat: dict) -> dict[str, tuple[list[str], str]]:
    """Each case: its arguments, and the one line it must end with."""
    good = [{"messages": conversation(k)} for k in range(40)]  # written before the bad row
    model = str(chat["model"])

    def rows(name: str, bad: object) -> str:
        return str(write_jsonl(root / f"{name}.jsonl", [*good, bad]))

    role = rows("role", {"messages": [{"role": "bot", "content": "hi"}]})
    content = rows("content", {"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant"}]})
    messages = rows("messages", {"text": "no conversation here"})
    too_long = [{"role": "user", "content": "many words " * 80}]
    long = rows("long", {"messages": too_long})
    tokens = len(chat["own"].apply_chat_template(too_long)["input_ids"])
    save_tokenizer(root / "no_template", template=None)
    save_tokenizer(root / "unstable", template="{{ messages | length }}" + TEMPLATE)
    return {
        "role": ([role, "--tokenizer", model],
                 f"input error: {role}:41: message 1 has the role 'bot'; a role is one of "
                 f"system, user, assistant, tool"),
        "content": ([content, "--tokenizer", model],
                    f"input error: {content}:41: message 2 (assistant) has no 'content'"),
        "messages": ([messages, "--tokenizer", model],
                     f"input error: {messages}:41: no 'messages' field; name the messages field "
                     f"with --column"),
        "long": ([long, "--tokenizer", model],
                 f"input error: {long}:41: the conversation is {tokens} tokens, longer than a "
                 f"window of --seq-len {SEQ}; raise --seq-len (and train with "
                 f"data.tokens.seq_len a multiple of it), or leave the conversation out"),
        "no template": ([role, "--tokenizer", str(root / "no_template")],
                        f"input error: --chat: the tokenizer in {root / 'no_template'} has no chat "
                        f"template (neither tokenizer_config.json's chat_template nor a "
                        f"chat_template.jinja); add one, or tokenize plain text without --chat"),
        "unstable template": ([rows("unstable", good[0]), "--tokenizer", str(root / "unstable")],
                              f"input error: {root / 'unstable.jsonl'}:1: the chat template "
                              f"does not render the conversation up to message 3 (assistant) "
                              f"as the start of the whole conversation, so its reply's tokens "
                              f"cannot be found; --chat cannot read conversations with this "
                              f"template"),
        "no tokenizer": ([role, "--vocab-size", "300"],
                         "usage error: --chat reads conversations from INPUT files with "
                         "--tokenizer MODEL_DIR (the folder of the tokenizer and its chat "
                         "template)"),
    }


def test_bad_rows_and_tokenizers_are_one_line_exit_2_and_nothing_written(chat, capsys) -> None:
    root = chat["root"] / "bad"
    root.mkdir()
    for case, (args, line) in bad_inputs(root, chat).items():
        out = root / f"out_{case.replace(' ', '_')}"
        code = cli.main(["tokenize", *args, "--chat", "--seq-len", str(SEQ), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2, (case, err)
        assert err.strip().splitlines()[-1] == f"dtrain: {line}", case
        assert not out.exists(), case


def test_windows_carry_their_mask_and_must_keep_conversations_whole(chat) -> None:
    out = chat["out"]
    cfg = config.load(None, ["data.name=tokens", f"data.root={out}",
                             f"data.tokens.seq_len={2 * SEQ}"])
    sets = build(cfg.data, 0)
    tokens, mask = sets.val[0]
    ids, flags = read_split(out, "val")
    assert tokens.tolist() == ids[:2 * SEQ + 1].tolist()
    assert mask.dtype == torch.uint8 and mask.tolist() == flags[:2 * SEQ + 1].tolist()
    with pytest.raises(UserError) as cut:
        build(config.load(None, ["data.name=tokens", f"data.root={out}",
                                 f"data.tokens.seq_len={SEQ}", "data.tokens.stride=16"]).data, 0)
    assert str(cut.value) == (
        f"config error: data.tokens.stride is 16, but {out} lays its documents out in "
        f"windows of {SEQ} tokens (dtrain tokenize --seq-len {SEQ}), which other windows "
        f"would cut; set data.tokens.stride to {SEQ} or a multiple of it")


def test_a_chat_folder_in_an_object_store_gives_the_same_windows(chat, s3, monkeypatch) -> None:
    """Masks travel with their token files: by ranged reads and from a node's copy (checked
    against meta.json's digests), the windows and their masks are the local folder's."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    url = f"s3://{s3.bucket()}/chat"
    for path in chat["out"].iterdir():
        s3.fs().put(str(path), f"{url}/{path.name}")
    local = build(config.load(None, ["data.name=tokens", f"data.root={chat['out']}",
                                     f"data.tokens.seq_len={SEQ}"]).data, 0)
    for cache in (0, 1):
        try:
            remote = build(config.load(None, ["data.name=tokens", f"data.root={url}",
                                              f"data.tokens.seq_len={SEQ}",
                                              f"data.tokens.cache_gib={cache}"]).data, 0)
            for split in ("train", "val"):
                mine, theirs = getattr(local, split), getattr(remote, split)
                keys = list(range(len(mine)))
                assert len(theirs) == len(mine)
                for part, expected in zip(theirs.__getitems__(keys).batch,
                                          mine.__getitems__(keys).batch, strict=True):
                    assert torch.equal(part, expected), (cache, split)
            copied = sorted(p.name for p in Path(node_copy.folder_for(url)).glob("*.mask"))
            assert copied == (["train.mask", "val.mask"] if cache else [])
        finally:
            shutil.rmtree(node_copy.folder_for(url), ignore_errors=True)


def loss_by_document(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray) -> float:
    """The cross-entropy by hand over the targets the mask counts, one mean over all of them,
    each document through the model alone (a plain loop knows nothing of packing)."""
    total, counted = 0.0, 0
    with torch.no_grad():
        for start, stop in documents(ids, mask):
            if stop - start < 2:
                continue
            x = torch.from_numpy(ids[start:stop].astype(np.int64))[None]
            weights = torch.from_numpy((mask[start + 1:stop] & 1).astype(bool))
            logits = logits_of(model(x[:, :-1])).float()[0]
            per_token = F.cross_entropy(logits, x[0, 1:], reduction="none")
            total, counted = total + per_token[weights].sum().item(), counted + int(weights.sum())
    return total / counted


def masked_loss(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """loss_by_document's, and for comparison the windows' unmasked loss with attention across
    the documents."""
    windows = (len(ids) - 1) // SEQ
    x = torch.stack([torch.from_numpy(ids[w * SEQ:w * SEQ + SEQ + 1].astype(np.int64))
                     for w in range(windows)])
    with torch.no_grad():
        unmasked = F.cross_entropy(model(x[:, :-1]).transpose(1, 2), x[:, 1:]).item()
    return loss_by_document(model, ids, mask), unmasked


def test_the_loss_counts_the_replies_alone_in_training_and_validation(chat, tmp_path) -> None:
    """One step on a batch of every training window, at a learning rate (1e-12) that leaves the
    saved weights those the step's loss was taken with: the recorded loss is the masked
    cross-entropy computed here, as is the validation loss, whose windows include one that
    counts nothing; the banner says what share of the tokens counts."""
    out, meta = chat["out"], chat["meta"]
    train_ids, train_mask = read_split(out, "train")
    val_ids, val_mask = read_split(out, "val")
    windows, val_windows = (len(train_ids) - 1) // SEQ, (len(val_ids) - 1) // SEQ
    assert any(not (val_mask[w * SEQ + 1:w * SEQ + SEQ + 1] & 1).any() for w in range(val_windows))
    result = launch(tmp_path / "runs" / "chat", [
        "task.name=language_model", "model.name=gpt", GPT_ARGS, "data.name=tokens",
        f"data.root={out}", f"data.batch_size={windows}", "train.max_steps=1",
        "optim.name=adamw", "optim.lr=1e-12", "optim.weight_decay=0.0", "ckpt.monitor=val_loss",
        "ckpt.monitor_mode=min"])
    assert result.returncode == 0, result.stderr[-3000:]
    share = {s: meta["counted"][s] / meta["tokens"][s] for s in ("train", "val")}
    assert (f"loss on {share['train']:.1%} of the training tokens and {share['val']:.1%} of the "
            f"validation tokens: the assistant's replies, each with the end-of-turn token after "
            f"it (the folder's loss masks); packed windows: the masks mark where each document "
            f"starts") in unwrapped(result.stderr)
    model = GPT(vocab_size=meta["vocab_size"], seq_len=SEQ, dim=32, depth=1, heads=2)
    saved = torch.load(latest(result.run_dir) / "checkpoint.pt", weights_only=True)["model"]
    model.load_state_dict(saved)
    model.eval()
    train_loss, _ = masked_loss(model, train_ids, train_mask)
    assert result.losses()[1] == pytest.approx(train_loss, abs=1e-6)
    final = [r for r in result.records() if "val_loss" in r][-1]
    val_loss, unmasked = masked_loss(model, val_ids, val_mask)
    assert final["val_loss"] == pytest.approx(val_loss, abs=1e-6)
    assert abs(val_loss - unmasked) > 0.01  # the mask changes what is measured
    assert final["val_counted"] == pytest.approx(
        int((val_mask[1:] & 1).sum()) / (val_windows * SEQ))
    per_token = meta["bytes"]["val"] / meta["counted"]["val"]
    assert final["val_bits_per_byte"] == pytest.approx(val_loss / math.log(2) / per_token,
                                                       rel=1e-6)


def test_a_step_over_ranks_and_micro_batches_is_the_mean_over_every_counted_token(chat, tmp_path):
    """The same step as one batch in one process, as 2 ranks x 2 micro-batches and as one tp
    group of 2 with loss parallelism x 2 micro-batches: micro-batches
    count different numbers of reply tokens, and the step's gradient is still the mean over all
    of them (SGD, so that the second loss shows the first step's gradient), not a mean of
    micro-batch means."""
    ids, _ = read_split(chat["out"], "train")
    windows = (len(ids) - 1) // SEQ
    batch = windows - windows % 4
    job = ["task.name=language_model", "model.name=gpt", GPT_ARGS, "data.name=tokens",
           f"data.root={chat['out']}", "train.max_steps=2", "train.epochs=2", "optim.name=sgd",
           "optim.lr=0.5",
           "optim.weight_decay=0.0", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
           "sched.name=none"]
    whole = launch(tmp_path / "whole", [*job, f"data.batch_size={batch}"])
    split = launch(tmp_path / "split", [*job, f"data.batch_size={batch // 4}", "train.grad_accum=2"],
                   nproc=2)
    # One tp group of 2 with the cross-entropy on logits split by vocabulary: the masked
    # per-token losses computed on the parts.
    vocab_split = launch(tmp_path / "tp", [*job, f"data.batch_size={batch // 2}",
                                          "train.grad_accum=2", "parallel.tp.size=2",
                                          "parallel.tp.loss_parallel=true"], nproc=2)
    for run in (whole, split, vocab_split):
        assert run.returncode == 0, run.stderr[-3000:]
    assert whole.losses()[2] != whole.losses()[1]
    assert split.losses() == pytest.approx(whole.losses(), rel=2e-6)  # (4.7e-5 when it was not)
    assert vocab_split.losses() == pytest.approx(whole.losses(), rel=2e-6)
