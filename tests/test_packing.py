"""Packed windows: `dtrain tokenize --pack` lays whole documents into blocks of --seq-len with
little padding, its masks marking where each document starts; training then restarts the
positions there, and the built-in `gpt` and Hugging Face models (their own packed sequences)
keep the documents apart: a document's logits do not change with its neighbour (<= 1e-6), and
the loss of a launched run equals each document's loss through the model alone. A model that
cannot keep them apart is one line at start, exit 2."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from conftest import latest, launch
from test_chat_data import documents, loss_by_document, save_tokenizer

from dtrain import cli
from dtrain.commands.tokenize import command as tokenize
from dtrain.commands.tokenize.settings import Settings
from dtrain.config import ModelConfig
from dtrain.data.text import python_docs
from dtrain.models import GPT, hf
from dtrain.tasks import LanguageModel, logits_of

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler:UserWarning")

SEQ = 128
VOCAB = 400
SMALL = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=SEQ, eos_token_id=0, bos_token_id=0, pad_token_id=0)
LM = ["task.name=language_model", "model.args={}", "data.name=tokens", "data.num_workers=0",
      "optim.name=adamw", "optim.lr=1e-12", "optim.weight_decay=0.0", "train.max_steps=1",
      "ckpt.monitor=val_loss", "ckpt.monitor_mode=min", "ckpt.format=full"]


def texts(count: int, seed: int) -> list[str]:
    """Documents of the built-in corpus's text, of 20 to 150 characters (a few tokens to most
    of a block), and three long enough to fill several blocks."""
    corpus, rng = python_docs().decode(), random.Random(seed)
    cuts = [(at := rng.randrange(len(corpus) - 4000), at + rng.randrange(20, 150))
            for _ in range(count)]
    cuts[::count // 3] = [(at, at + 2500) for at, _ in cuts[::count // 3]]
    return [corpus[a:b] for a, b in cuts]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("packed")
    model = save_tokenizer(root / "model", template=None)
    rows = texts(1200, seed=0)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    out = root / "tokens"
    stream = io.StringIO()
    meta = tokenize.tokenize(Settings([str(root / "docs.jsonl")], str(out),
                                      tokenizer_path=str(model), pack=True, seq_len=SEQ), stream)
    torch.manual_seed(0)
    folders = {}
    for name, made in (
        ("llama", transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **SMALL, hidden_size=32, intermediate_size=64, num_key_value_heads=2))),
        ("qwen2", transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **SMALL, hidden_size=32, intermediate_size=64, num_key_value_heads=2))),
        ("opt", transformers.OPTForCausalLM(transformers.OPTConfig(
            **SMALL, hidden_size=32, ffn_dim=64, word_embed_proj_dim=32))),
    ):
        made.save_pretrained(root / name)
        folders[name] = root / name
    return {"root": root, "model": model, "rows": rows, "out": out, "meta": meta,
            "folders": folders}


def read(out: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    return (np.fromfile(out / f"{split}.bin", dtype=np.uint16),
            np.fromfile(out / f"{split}.mask", dtype=np.uint8))


def test_pack_lays_whole_documents_in_blocks_with_under_2_percent_padding(packed) -> None:
    """Every document (its ids the tokenizer's, then the end of text) is whole in one block,
    those longer than a block cut into blocks of their own; each starts with a STARTS flag and
    counts every token but its first; the padding counts nothing and is under 2 %."""
    out, meta = packed["out"], packed["meta"]
    bpe = tokenizers.Tokenizer.from_file(str(packed["model"] / "tokenizer.json"))
    eot = meta["eot_id"]
    expected = []
    for text in packed["rows"]:
        ids = [*bpe.encode(text, add_special_tokens=False).ids, eot]
        expected += [tuple(ids[at:at + SEQ]) for at in range(0, len(ids), SEQ)]
    assert any(len(piece) == SEQ for piece in expected)  # (some documents were cut)
    found, padding, total = [], 0, 0
    for split in ("train", "val"):
        ids, mask = read(out, split)
        assert len(ids) == len(mask) == meta["tokens"][split] and len(ids) % SEQ == 1
        total += len(ids) - 1
        for start, stop in documents(ids, mask):
            piece = tuple(ids[start:stop].tolist())
            assert mask[start] == 2
            if set(piece) == {eot}:  # padding (the split's closing pad token included)
                assert not (mask[start:stop] & 1).any()
                padding += stop - start - (stop == len(ids))
                continue
            assert start // SEQ == (stop - 1) // SEQ  # whole in one block
            assert (mask[start + 1:stop] == 1).all()
            found.append(piece)
        assert meta["counted"][split] == int((mask & 1).sum())
    assert sorted(found) == sorted(p for p in expected if set(p) != {eot})
    lone = sum(set(p) == {eot} for p in expected)  # a long document's last piece, its end alone
    assert padding == sum(meta["packed"]["padding"].values()) + lone
    assert padding / total < 0.02, padding / total
    # The training part is packed tighter still; the held-out end (the last blocks, where the
    # leftovers of the best fit go) less so (blocks.py's docstring).
    assert meta["packed"]["padding"]["train"] / meta["tokens"]["train"] < 0.01
    assert meta["documents"]["train"] + meta["documents"]["val"] == len(packed["rows"])
    assert meta["mask"] == "every token but the first of each document and the padding"


def test_a_document_s_logits_do_not_change_with_its_neighbour(packed) -> None:
    """The same document after two neighbours of different lengths, and alone: its logits agree
    within 1e-6 in the built-in gpt and in Llama and Qwen2 folders."""
    rng = torch.Generator().manual_seed(1)
    doc, first, other = (torch.randint(1, VOCAB, (n,), generator=rng) for n in (40, 30, 55))
    task = LanguageModel(documents=True)

    def window(neighbour: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.cat([neighbour, doc, torch.zeros(SEQ + 1 - len(neighbour) - len(doc),
                                                        dtype=torch.long)])
        mask = torch.ones(SEQ + 1, dtype=torch.uint8)
        mask[[0, len(neighbour), len(neighbour) + len(doc)]] = 2
        return tokens[None], mask[None]

    torch.manual_seed(0)
    models = {"gpt": GPT(vocab_size=VOCAB, seq_len=SEQ, dim=32, depth=2, heads=4)}
    for name in ("llama", "qwen2"):
        info = {"vocab_size": VOCAB, "seq_len": SEQ}
        models[name] = hf.build(ModelConfig(name=f"hf:{packed['folders'][name]}"), info)
    for name, model in models.items():
        model.eval()
        with torch.no_grad():
            seen = []
            for neighbour in (first, other):
                inputs, _, _, positions = task._split(window(neighbour))
                logits = task._logits(model, inputs, positions)
                seen.append(logits[0, len(neighbour):len(neighbour) + len(doc)])
            alone = logits_of(model(doc[None])).float()[0]
        assert (seen[0] - seen[1]).abs().max() <= 1e-6, name
        assert (seen[0] - alone).abs().max() <= 1e-6, name
        assert seen[0].abs().max() > 0.01  # (not a model that says nothing)


def test_a_llama_folder_trains_on_packed_windows_as_on_each_document_alone(packed, tmp_path):
    """FSDP on 2 ranks, one step at a learning rate that leaves the weights as they were: the
    validation loss over every window equals each document's loss through the folder's model
    alone, in a plain loop (the model knows nothing of packing)."""
    out, meta = packed["out"], packed["meta"]
    windows = (meta["tokens"]["train"] - 1) // SEQ
    folder = packed["folders"]["llama"]
    result = launch(tmp_path / "runs" / "llama", [
        *LM, f"model.name=hf:{folder}", f"data.root={out}", f"data.tokens.seq_len={SEQ}",
        f"data.batch_size={windows // 2}", "parallel.mode=fsdp"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    assert result.losses()
    final = [r for r in result.records() if "val_loss" in r][-1]
    by_hand = loss_by_document(model, *read(out, "val"))
    assert final["val_loss"] == pytest.approx(by_hand, abs=2e-6)
    assert latest(result.run_dir).exists()


def test_a_model_that_cannot_keep_documents_apart_is_one_line(packed, tmp_path) -> None:
    """OPT (no packed sequences in transformers) and a model whose forward takes no
    position_ids: one line naming the problem, exit 2; task.args.documents: false lets the
    first train across the documents."""
    out = packed["out"]
    common = [*LM, f"data.root={out}", f"data.tokens.seq_len={SEQ}", "data.batch_size=4"]
    opt = [*common, f"model.name=hf:{packed['folders']['opt']}"]
    refused = launch(tmp_path / "runs" / "opt", opt)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "dtrain: model error: the model lets the documents of a packed window see each other")
    assert "set task.args.documents: false" in refused.stderr
    bigram = launch(tmp_path / "runs" / "bigram", [
        *common, "model.name=user_code:bigram", f"model.args={{vocab_size: {VOCAB}}}"])
    assert bigram.returncode == 2
    assert bigram.stderr.strip().splitlines()[-1].startswith(
        "dtrain: model error: the model does not take position_ids")
    allowed = launch(tmp_path / "runs" / "opt_across", [*opt, "task.args={documents: false}"])
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert allowed.losses()


def test_seq_len_goes_with_chat_or_pack(packed, capsys) -> None:
    code = cli.main(["tokenize", str(packed["root"] / "docs.jsonl"), "--tokenizer",
                     str(packed["model"]), "--seq-len", "64", "--out",
                     str(packed["root"] / "unused")])
    assert code == 2
    assert "--seq-len goes with --chat or --pack" in capsys.readouterr().err
    assert not (packed["root"] / "unused").exists()
