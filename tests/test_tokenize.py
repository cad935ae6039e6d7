"""`dtrain tokenize`: every input kind gives the documents back exactly (through the saved
tokenizer alone), meta.json describes the files as they are, the held-out part and --val, uint32
for large vocabularies, and every bad input is one line, exit 2 and nothing written."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import tokenizers
from conftest import dtrain, fill_disk

# In-process commands run under torch's error recorder, which cannot install its fault handler
# on pytest's captured stderr and says so.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler:UserWarning")

from dtrain import cli
from dtrain.commands.tokenize import command as tokenize, inputs as tokenize_inputs  # noqa: E402
from dtrain.commands.tokenize.settings import Settings  # noqa: E402

DOCS = [
    "Hello, world!\nA second line.\n",
    "  leading spaces, then\ttabs\tand a trailing space ",
    "unicode: naïve café, Ελληνικά, 日本語, 🙂, and <|endoftext|> spelled out\n\n",
    "\n\nstarts with newlines and ends without",
    "def f(x):\n    return x * 2  # code\n",
]
FILES = {"train.bin", "val.bin", "meta.json", "tokenizer.json"}


def run(capsys, *args: str) -> tuple[int, str]:
    """`dtrain tokenize ARGS` in this process: its exit code and its stderr."""
    code = cli.main(["tokenize", *args])
    return code, capsys.readouterr().err


def read(out: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    meta = json.loads((out / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    train = np.fromfile(out / "train.bin", dtype=dtype)
    val = np.fromfile(out / "val.bin", dtype=dtype)
    return meta, train, val


def check(out: Path, docs: list[str], texts: list[str] | None = None) -> dict:
    """The shards in `out` hold exactly `docs` (as they decode), each followed by the
    end-of-text token, and meta.json says what the files are and counts the bytes of `texts`
    (the documents as they were given: `docs` unless the tokenizer cannot give them back)."""
    meta, train, val = read(out)
    assert set(os.listdir(out)) == FILES  # no .partial file left behind
    tokenizer = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    itemsize = np.dtype(meta["dtype"]).itemsize
    assert meta["dtype"] == ("uint16" if meta["vocab_size"] <= 65536 else "uint32")
    assert meta["vocab_size"] == tokenizer.get_vocab_size()
    assert meta["eot_id"] == tokenizer.token_to_id(meta["eot"])
    assert meta["tokenizer"] == "tokenizer.json"
    assert meta["tokens"] == {"train": len(train), "val": len(val)}
    # Every file's content digest, for a node's copy of the folder in an object store.
    from dtrain.files.digests import file_digest
    assert meta["digest"] == "xxh3_128" and {"train.bin", "val.bin"} <= set(meta["digests"])
    assert meta["digests"] == {name: file_digest(str(out / name)) for name in meta["digests"]}
    assert (out / "train.bin").stat().st_size == len(train) * itemsize
    assert (out / "val.bin").stat().st_size == len(val) * itemsize
    assert len(train) > 0 and len(val) > 0
    stream = np.concatenate([train, val])
    assert int(stream.max()) < meta["vocab_size"]
    ends = np.flatnonzero(stream == meta["eot_id"])
    assert len(ends) == len(docs) and ends[-1] == len(stream) - 1
    starts = [0, *(ends[:-1] + 1)]
    written = [tokenizer.decode(stream[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
    assert written == docs
    text_bytes = sum(len(d.encode()) for d in texts or docs) + len(docs)
    assert meta["bytes"]["train"] + meta["bytes"]["val"] == text_bytes
    assert meta["bytes"]["train"] > 0 and meta["bytes"]["val"] > 0
    return meta


def write_docs(folder: Path, docs: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"doc{i:02d}.txt" for i in range(len(docs))]
    for path, doc in zip(paths, docs, strict=True):
        path.write_bytes(doc.encode())
    return paths


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A small byte-level BPE's tokenizer.json, for --tokenizer."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenize.train_tokenizer(iter(DOCS * 4), 400, tokenize.EOT).save(str(path))
    return path


def test_help_exits_0() -> None:
    result = dtrain("tokenize", "--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: dtrain tokenize ")
    for option in ("--out", "--vocab-size", "--tokenizer", "--val-fraction", "--val", "--workers",
                   "--column", "--overwrite", "--corpus"):
        assert option in result.stdout


def test_txt_files_round_trip_through_the_saved_tokenizer(tmp_path, capsys) -> None:
    paths = write_docs(tmp_path / "in", DOCS)
    out = tmp_path / "out"
    code, err = run(capsys, *map(str, paths), "--out", str(out), "--vocab-size", "300")
    assert code == 0, err
    meta = check(out, DOCS)
    assert meta["inputs"]["train"] == [{"path": str(p), "bytes": p.stat().st_size} for p in paths]
    assert meta["inputs"]["val"] == [] and meta["val_fraction"] == 0.1
    assert meta["documents"]["train"] + meta["documents"]["val"] >= len(DOCS)
    # The library alone, as a user would call it: no prefix space, bytes back exactly. (Its
    # encode reads a literal "<|endoftext|>" as the special token, which decode then skips;
    # in the shards that text is text: check() found one end-of-text id per document.)
    tokenizer = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for doc in [*DOCS, " x", "\t\ty\n", "é"]:
        ids = tokenizer.encode(doc).ids
        assert tokenizer.decode(ids) == doc.replace("<|endoftext|>", "")
    assert "tokenizing: 100%" in err  # plain lines where stderr is not a terminal


def test_a_folder_and_jsonl_and_the_column_option(tmp_path, capsys) -> None:
    write_docs(tmp_path / "folder", DOCS[:2])
    (tmp_path / "folder" / "notes.md").write_text("not read")
    write_jsonl(tmp_path / "folder" / "more.jsonl", DOCS[2:], field="body")
    out = tmp_path / "out"
    code, err = run(capsys, str(tmp_path / "folder"), "--column", "body", "--out", str(out),
                    "--vocab-size", "300")
    assert code == 0, err
    # name order: doc00.txt, doc01.txt, more.jsonl (each line a document)
    meta = check(out, DOCS)
    assert [Path(i["path"]).name for i in meta["inputs"]["train"]] == [
        "doc00.txt", "doc01.txt", "more.jsonl"]


def test_parquet_and_save_to_disk(tmp_path, capsys, trained) -> None:
    datasets.Dataset.from_dict({"text": DOCS[:3], "n": [1, 2, 3]}).to_parquet(
        str(tmp_path / "a.parquet"))
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": DOCS[3:], "n": [4, 5]}),
        "validation": datasets.Dataset.from_dict({"text": ["held out", "  also\theld"]}),
    }).save_to_disk(str(tmp_path / "saved"))
    out = tmp_path / "out"
    code, err = run(capsys, str(tmp_path / "a.parquet"), str(tmp_path / "saved"), "--out",
                    str(out), "--tokenizer", str(trained))
    assert code == 0, err
    meta = check(out, DOCS)
    assert meta["tokenizer_from"] == str(trained)
    assert (out / "tokenizer.json").read_bytes() == trained.read_bytes()
    # As --val, a DatasetDict gives its validation split (as does that split's own folder).
    for val in ("saved", "saved/validation"):
        out2 = tmp_path / ("out-" + val.replace("/", "-"))
        code, err = run(capsys, str(tmp_path / "saved"), "--val", str(tmp_path / val), "--out",
                        str(out2), "--tokenizer", str(trained))
        assert code == 0, err
        meta = check(out2, [*DOCS[3:], "held out", "  also\theld"])
        assert meta["tokens"]["val"] == len(read(out2)[2])
        assert meta["bytes"]["val"] == len("held out") + len("  also\theld") + 2


def test_val_inputs_are_the_validation_split(tmp_path, capsys) -> None:
    train = write_docs(tmp_path / "train", DOCS[:3])
    val = write_docs(tmp_path / "val", DOCS[3:])
    out = tmp_path / "out"
    code, err = run(capsys, *map(str, train), "--val", *map(str, val), "--out", str(out),
                    "--vocab-size", "300")
    assert code == 0, err
    meta = check(out, DOCS)
    _, train_ids, val_ids = read(out)
    assert (train_ids == meta["eot_id"]).sum() == 3 and (val_ids == meta["eot_id"]).sum() == 2
    assert meta["bytes"]["val"] == sum(len(d.encode()) + 1 for d in DOCS[3:])
    assert meta["val_fraction"] is None and meta["val_from"] == "the --val inputs"
    assert [i["path"] for i in meta["inputs"]["val"]] == [str(p) for p in val]


def test_val_fraction_cuts_the_stream_and_its_bytes_exactly(tmp_path, capsys) -> None:
    doc = "".join(f"line {i}: some words to tokenize\n" for i in range(200))  # ASCII, one document
    path = tmp_path / "one.txt"
    path.write_text(doc)
    out = tmp_path / "out"
    code, err = run(capsys, str(path), "--out", str(out), "--vocab-size", "300",
                    "--val-fraction", "0.3")
    assert code == 0, err
    meta = check(out, [doc])
    _, train, val = read(out)
    assert len(val) == int((len(train) + len(val)) * 0.3)
    tokenizer = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    before = tokenizer.decode(train.tolist())
    assert doc.startswith(before) and 0 < len(before) < len(doc)
    assert meta["bytes"] == {"train": len(before), "val": len(doc) - len(before) + 1}
    assert meta["documents"] == {"train": 1, "val": 1}


def test_long_documents_are_read_in_pieces_without_changing_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tokenize_inputs, "PIECE_BYTES", 64)
    long_line = "ü漢🙂a" * 100  # no newline, multi-byte characters across every block's end
    doc = f"{long_line}\nshort\n{'x' * 300}\n{long_line}"
    (tmp_path / "long.txt").write_text(doc)
    write_jsonl(tmp_path / "long.jsonl", [doc, "tiny"])
    out = tmp_path / "out"
    meta = tokenize.tokenize(Settings([str(tmp_path / "long.txt"), str(tmp_path / "long.jsonl")],
                                      str(out), vocab_size=300, val_fraction=0.5))
    check(out, [doc, doc, "tiny"])
    assert meta["documents"]["train"] + meta["documents"]["val"] == 4  # one divided by the cut


def test_a_vocabulary_over_65536_is_written_as_uint32(tmp_path, capsys) -> None:
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tokenizer.save(str(tmp_path / "big.json"))
    docs = ["w1 w69999 w65536", "w0 w65535 w70000", "w42"]
    write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out"
    code, err = run(capsys, str(tmp_path / "docs.jsonl"), "--out", str(out), "--tokenizer",
                    str(tmp_path / "big.json"), "--val-fraction", "0.5")
    assert code == 0, err
    meta = check(out, ["w1 w69999 w65536", "w0 w65535 [UNK]", "w42"], docs)
    assert meta["dtype"] == "uint32" and meta["eot"] == "</s>" and meta["eot_id"] == 70_001
    _, train, val = read(out)
    assert np.concatenate([train, val]).tolist() == [1, 69999, 65536, 70001, 0, 65535, 70000,
                                                    70001, 42, 70001]


def test_thread_count_does_not_change_the_output(tmp_path) -> None:
    paths = write_docs(tmp_path / "in", DOCS * 3)
    outputs = []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        result = dtrain("tokenize", *map(str, paths), "--out", str(out), "--vocab-size", "300",
                        "--workers", workers)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"wrote {out}: train.bin ")
        outputs.append([(out / n).read_bytes() for n in ("train.bin", "val.bin", "meta.json")])
    assert outputs[0] == outputs[1]


def test_tokenize_imports_no_torch(tmp_path, trained) -> None:
    """torch's import (about 2 s) would be most of the command's time on a corpus of tens of
    megabytes: the command needs none of it."""
    import subprocess

    from conftest import REPO, child_env
    paths = write_docs(tmp_path / "in", DOCS)
    code = ("import sys; from dtrain import cli; code = cli.main(['tokenize', *sys.argv[1:]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, paths), "--out",
                           str(tmp_path / "out"), "--tokenizer", str(trained)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "train.bin").stat().st_size > 0


def test_the_built_in_corpus(tmp_path) -> None:
    from pydoc_data.topics import topics

    from dtrain.data.text import python_docs
    out = tmp_path / "out"
    result = dtrain("tokenize", "--corpus", "python_docs", "--out", str(out), "--vocab-size", "512")
    assert result.returncode == 0, result.stderr
    meta = check(out, [topics[name] for name in sorted(topics)])  # a topic is a document
    # python_docs() joins the topics with two newlines; here one end-of-text byte each.
    total = len(python_docs()) - 2 * (len(topics) - 1) + len(topics)
    assert meta["bytes"]["train"] + meta["bytes"]["val"] == total
    assert meta["vocab_size"] == 512 and meta["dtype"] == "uint16"
    assert 2.0 < total / (meta["tokens"]["train"] + meta["tokens"]["val"]) < 3.0  # merges made


def test_overwrite_replaces_shards_and_removes_stale_ones(tmp_path, capsys, trained) -> None:
    paths = write_docs(tmp_path / "in", DOCS)
    out = tmp_path / "out"
    assert run(capsys, *map(str, paths), "--out", str(out), "--tokenizer", str(trained))[0] == 0
    (out / "train_001.bin").write_bytes(b"\0\0")
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    code, err = run(capsys, str(paths[0]), "--out", str(out), "--tokenizer", str(trained))
    assert code == 2 and f"'{out}' already holds token shards" in err and "--overwrite" in err
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    code, err = run(capsys, str(paths[0]), "--out", str(out), "--tokenizer",
                    str(out / "tokenizer.json"), "--overwrite")
    assert code == 0, err
    check(out, DOCS[:1])


def test_a_failure_part_way_leaves_nothing(tmp_path, capsys, trained) -> None:
    paths = write_docs(tmp_path / "in", DOCS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    out = tmp_path / "out"
    code, err = run(capsys, *map(str, paths), str(bad), "--out", str(out), "--tokenizer",
                    str(trained))
    assert code == 2 and f"{bad}:2: not JSON" in err
    assert not out.exists()
    # Over an earlier output: that output stays as it was, and no partial file is left.
    assert run(capsys, *map(str, paths), "--out", str(out), "--tokenizer", str(trained))[0] == 0
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    code, err = run(capsys, str(bad), "--out", str(out), "--tokenizer", str(trained),
                    "--overwrite")
    assert code == 2
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def _empty_txt(tmp: Path) -> list[str]:
    (tmp / "empty.txt").write_text("")
    return [str(tmp / "empty.txt")]


def _empty_folder(tmp: Path) -> list[str]:
    (tmp / "folder").mkdir()
    (tmp / "folder" / "readme.md").write_text("not text input")
    return [str(tmp / "folder")]


def _blank_jsonl(tmp: Path) -> list[str]:
    return [str(write_jsonl(tmp / "blank.jsonl", ["", ""]))]


def _jsonl_without_field(tmp: Path) -> list[str]:
    return [str(write_jsonl(tmp / "docs.jsonl", DOCS, field="body"))]


def _not_utf8(tmp: Path) -> list[str]:
    (tmp / "latin1.txt").write_bytes("café".encode("latin-1"))
    return [str(tmp / "latin1.txt")]


def _parquet_without_column(tmp: Path) -> list[str]:
    datasets.Dataset.from_dict({"body": DOCS}).to_parquet(str(tmp / "a.parquet"))
    return [str(tmp / "a.parquet")]


def _parquet_column_not_text(tmp: Path) -> list[str]:
    datasets.Dataset.from_dict({"text": [1, 2]}).to_parquet(str(tmp / "n.parquet"))
    return [str(tmp / "n.parquet")]


def _saved_without_column(tmp: Path) -> list[str]:
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp / "saved"))
    return [str(tmp / "saved")]


def _dict_without_train(tmp: Path) -> list[str]:
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(
        str(tmp / "dict"))
    return [str(tmp / "dict")]


def _bad_tokenizer(tmp: Path) -> list[str]:
    (tmp / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    return [*write_docs_str(tmp), "--tokenizer", str(tmp / "tokenizer.json")]


def _tokenizer_without_eot(tmp: Path) -> list[str]:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "?": 1}, unk_token="?"))
    tokenizer.save(str(tmp / "tokenizer.json"))
    return [*write_docs_str(tmp), "--tokenizer", str(tmp / "tokenizer.json")]


def _blank_jsonl_given_tokenizer(tmp: Path) -> list[str]:
    tokenize.train_tokenizer(iter(DOCS), 300, tokenize.EOT).save(str(tmp / "tokenizer.json"))
    return [*write_docs_str(tmp), *_blank_jsonl(tmp), "--tokenizer", str(tmp / "tokenizer.json")]


def write_docs_str(tmp: Path) -> list[str]:
    return [str(p) for p in write_docs(tmp / "in", DOCS)]


BAD = {
    "empty txt": (_empty_txt, "empty.txt' has no text"),
    "folder without text files": (_empty_folder, "folder' has no .txt, .jsonl or .parquet"),
    "jsonl without text": (_blank_jsonl, "blank.jsonl' has no text"),
    "jsonl without the field": (_jsonl_without_field, "docs.jsonl:1: no 'text' field"),
    "not UTF-8": (_not_utf8, "latin1.txt: not UTF-8 text (byte 3)"),
    "missing input": (lambda tmp: [str(tmp / "nowhere.txt")], "nowhere.txt' not found"),
    "parquet without the column": (_parquet_without_column, "a.parquet: no column 'text'"),
    "parquet column not text": (_parquet_column_not_text, "n.parquet: column 'text' holds int64"),
    "save_to_disk without the column": (_saved_without_column, "saved: no column 'text'"),
    "DatasetDict without train": (_dict_without_train, "dict: a DatasetDict without a train split"),
    "tokenizer.json that does not parse": (_bad_tokenizer, "tokenizer.json: not a tokenizer.json"),
    "tokenizer without end-of-text": (_tokenizer_without_eot, "no end-of-text token"),
    "input and corpus": (lambda tmp: [*write_docs_str(tmp), "--corpus", "python_docs"],
                         "give INPUT files or folders, or --corpus, not both"),
    "no input": (lambda tmp: [], "give INPUT files or folders (or --corpus python_docs)"),
    "val fraction": (lambda tmp: [*write_docs_str(tmp), "--val-fraction", "1"],
                     "--val-fraction must be between 0 and 1"),
    "vocab size": (lambda tmp: [*write_docs_str(tmp), "--vocab-size", "100"],
                   "--vocab-size must be from 257"),
    # what the tokenizer library would abort on (a native panic, exit 134): refused first
    "vocab size too large": (lambda tmp: [*write_docs_str(tmp), "--vocab-size", "1000000000"],
                             "to 16777216 (2**24), not 1000000000"),
    "tokenizer not found": (lambda tmp: [*write_docs_str(tmp), "--tokenizer", str(tmp / "t.json")],
                            "--tokenizer: '"),
    "no text, with --tokenizer": (_blank_jsonl_given_tokenizer, "blank.jsonl' has no text"),
    "val input without text": (lambda tmp: [*write_docs_str(tmp), "--val", *_empty_txt(tmp)],
                               "empty.txt' has no text"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, tmp_path, capsys) -> None:
    make, message = BAD[case]
    args = make(tmp_path)
    capsys.readouterr()  # what making the input printed (datasets' progress bars)
    if "--tokenizer" not in args and "--vocab-size" not in args:
        args.extend(["--vocab-size", "300"])
    out = tmp_path / "out"
    code, err = run(capsys, *args, "--out", str(out))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("dtrain: ") and message in err, err
    assert not out.exists()


class _NotInstalled:
    """A finder that answers for `package` and its modules as if it were not installed."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, name: str, path=None, target=None):
        if name == self.package or name.startswith(self.package + "."):
            raise ModuleNotFoundError(f"No module named '{self.package}'", name=self.package)
        return None


def uninstall(monkeypatch, package: str) -> None:
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NotInstalled(package), *sys.meta_path])


@pytest.mark.parametrize("module,extra,input_name", [
    ("tokenizers", "tokens", "a.txt"), ("pyarrow", "hf", "a.parquet")])
def test_a_missing_extra_is_one_line_naming_it(module, extra, input_name, tmp_path, capsys,
                                               monkeypatch) -> None:
    (tmp_path / input_name).write_text("some text")
    uninstall(monkeypatch, module)
    code, err = run(capsys, str(tmp_path / input_name), "--out", str(tmp_path / "out"),
                    "--vocab-size", "300")
    assert code == 2
    assert err.endswith(f"needs the '{extra}' extra: pip install 'dtrain[{extra}]'\n"), err
    assert err.startswith("dtrain: missing dependency: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_an_output_path_that_is_a_file(tmp_path, capsys) -> None:
    (tmp_path / "out").write_text("a file")
    code, err = run(capsys, *write_docs_str(tmp_path), "--out", str(tmp_path / "out"),
                    "--vocab-size", "300")
    assert code == 2 and "is a file, not a folder" in err
    assert (tmp_path / "out").read_text() == "a file"


@pytest.mark.parametrize("args,message", [
    ([], "one of the arguments --vocab-size --tokenizer is required"),
    (["--vocab-size", "300", "--tokenizer", "t.json"], "not allowed with argument"),
    (["--val", "v.txt", "--val-fraction", "0.2", "--vocab-size", "300"], "not allowed with"),
], ids=["neither", "both", "val and val-fraction"])
def test_tokenizer_options_are_a_usage_error(args, message, tmp_path, capsys) -> None:
    code, err = run(capsys, "a.txt", "--out", str(tmp_path / "out"), *args)
    assert code == 2 and message in err and "usage: dtrain tokenize" in err
    assert not (tmp_path / "out").exists()


def test_a_full_disk_is_one_line_and_leaves_the_earlier_token_files(tmp_path, capsys,
                                                                      tmpfs) -> None:
    out = tmpfs("size=256k") / "tokens"
    inputs = write_docs_str(tmp_path)
    code, err = run(capsys, *inputs, "--out", str(out), "--vocab-size", "300")
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fill_disk(out.parent)
    code, err = run(capsys, *inputs, "--out", str(out), "--vocab-size", "320", "--overwrite")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"dtrain: tokenize error: cannot write into {out} (the disk is full); nothing there "
        f"was changed: free space or choose another --out")
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
