"""What `dtrain tokenize` reads: its inputs as a stream of documents, in pieces of bounded size.

A document is a `.txt` file, a line of a `.jsonl` file, or a row of a parquet file or of a
`datasets` `save_to_disk` folder (its text column, `--column`). A folder that is not a saved
dataset stands for its `.txt`, `.jsonl` and `.parquet` files, in name order. Long documents
come in pieces of about `PIECE_BYTES` (cut after a newline where there is one), so that memory
does not grow with a document's size and the tokenizer's threads share the work evenly.

Everything that can be checked before reading the text is checked in `sources` (a missing
path, an unknown kind of file, a missing or non-text column, an empty `.txt` file), so that a
mistake costs no tokenizing. The same sources hold conversations for `--chat` (a column of
lists of messages; read row by row in `conversations`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dtrain.core.errors import UserError
from dtrain.core.imports import require

PIECE_BYTES = 64 << 10  # the tokenizer is fastest on pieces of tens of KB
ROWS_PER_READ = 1024
CORPORA = ("python_docs",)
KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
# The split of a saved DatasetDict that an INPUT (train) or a --val input (val) reads.
DICT_SPLITS = {"train": ("train",), "val": ("validation", "valid", "val", "test")}


@dataclass(frozen=True)
class Piece:
    """Part of a document: its text, that text's UTF-8 size, whether the document ends with it,
    and how many bytes of the input file reading it took (for the progress bar)."""

    text: str
    nbytes: int
    last: bool
    advance: int


@dataclass
class Source:
    """One thing to read: a file, a saved dataset, or a built-in corpus. `input` is the
    command-line argument it came from; `files` what it reads, with their sizes."""

    input: str
    kind: str  # txt | jsonl | parquet | dataset | corpus
    path: str
    files: dict[str, int] = field(default_factory=dict)
    split: str = ""  # of a saved DatasetDict, the split read

    @property
    def size(self) -> int:
        return sum(self.files.values())


def corpus_sources(name: str) -> list[Source]:
    if name not in CORPORA:
        raise UserError(f"input error: --corpus: unknown corpus '{name}'; choose {CORPORA}")
    size = sum(len(text.encode("utf-8")) for text in _python_docs_topics())
    return [Source(f"--corpus {name}", "corpus", name, {name: size})]


def sources(
    inputs: list[str], column: str, part: str = "train", chat: bool = False
) -> list[Source]:
    """The sources of the INPUT arguments (or of --val's, `part` "val"), checked as far as can
    be without reading text; with `chat`, sources of conversations (`column` their messages)."""
    found: list[Source] = []
    for given in inputs:
        path = os.path.abspath(given)
        if not os.path.exists(path):
            raise UserError(f"input error: '{given}' not found")
        if os.path.isdir(path) and _is_saved_dataset(path):
            found.append(_dataset_source(given, path, column, DICT_SPLITS[part], chat))
            continue
        files = _folder_files(given, path) if os.path.isdir(path) else [path]
        of_input = [_file_source(given, name, column, chat) for name in files]
        if all(s.kind == "txt" for s in of_input) and not any(s.size for s in of_input):
            raise UserError(f"input error: '{given}' has no text (its .txt files are empty)")
        found += of_input
    return found


def _folder_files(given: str, path: str) -> list[str]:
    names = sorted(
        n
        for n in os.listdir(path)
        if not n.startswith(".")
        and os.path.splitext(n)[1] in KINDS
        and os.path.isfile(os.path.join(path, n))
    )
    if not names:
        raise UserError(
            f"input error: '{given}' has no .txt, .jsonl or .parquet files (nor is it a "
            f"folder written by datasets' save_to_disk)"
        )
    return [os.path.join(path, n) for n in names]


def _file_source(given: str, path: str, column: str, chat: bool) -> Source:
    kind = KINDS.get(os.path.splitext(path)[1])
    if kind is None:
        raise UserError(
            f"input error: '{given}': not a .txt, .jsonl or .parquet file, a folder of them, "
            f"or a datasets save_to_disk folder"
        )
    if chat and kind == "txt":
        raise UserError(
            f"input error: {path}: --chat reads conversations, and a .txt file holds none; "
            f'give .jsonl rows of {{"{column}": [{{"role": ..., "content": ...}}, ...]}}'
        )
    source = Source(given, kind, path, {path: os.path.getsize(path)})
    if kind == "parquet":
        parquet = require("pyarrow.parquet", "hf", "reading parquet files")
        try:
            schema = parquet.ParquetFile(path).schema_arrow
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
            raise UserError(f"input error: {path}: not a parquet file ({e})") from None
        _check_column(path, column, schema.names, lambda: schema.field(column).type, chat)
    return source


def _is_saved_dataset(path: str) -> bool:
    return os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(
        os.path.join(path, "state.json")
    )


def _load_dataset(path: str, splits: tuple[str, ...]) -> tuple[Any, str]:
    """The Dataset saved at `path`, or of a DatasetDict the first of `splits` it has; and the
    split's name ("" for a Dataset)."""
    datasets = require("datasets", "hf", "reading a datasets save_to_disk folder")
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds for a bad folder
        raise UserError(f"input error: {path}: cannot load the saved dataset ({e})") from None
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded, ""
    split = next((name for name in splits if name in loaded), None)
    if split is None:
        raise UserError(
            f"input error: {path}: a DatasetDict without a {' or '.join(splits)} split (it "
            f"has {', '.join(loaded)}); give one split's folder, e.g. {path}/{next(iter(loaded))}"
        )
    return loaded[split], split


def _dataset_source(
    given: str, path: str, column: str, splits: tuple[str, ...], chat: bool
) -> Source:
    dataset, split = _load_dataset(path, splits)
    _check_column(
        path, column, dataset.column_names, lambda: dataset.data.schema.field(column).type, chat
    )
    files = {f["filename"]: os.path.getsize(f["filename"]) for f in dataset.cache_files}
    return Source(given, "dataset", path, files, split)


def _check_column(path: str, column: str, names: list[str], type_of: Any, chat: bool) -> None:
    """The text column (with `chat`, the messages column) is there and of that type."""
    pyarrow = require("pyarrow", "hf", "reading parquet files and saved datasets")
    what = "messages" if chat else "text"
    if column not in names:
        raise UserError(
            f"input error: {path}: no column '{column}' (it has {', '.join(names)}); "
            f"name the {what} column with --column"
        )
    kind = type_of()
    if chat:
        if not (pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind)):
            raise UserError(
                f"input error: {path}: column '{column}' holds {kind}, not lists of messages; "
                f"name the messages column with --column"
            )
    elif not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
        raise UserError(
            f"input error: {path}: column '{column}' holds {kind}, not text; "
            f"name the text column with --column"
        )


def pieces(source: Source, column: str) -> Iterator[Piece]:
    """The source's documents, in pieces; empty documents are skipped."""
    if source.kind == "txt":
        yield from _txt_pieces(source.path)
    elif source.kind == "jsonl":
        yield from _jsonl_pieces(source.path, column)
    elif source.kind in ("parquet", "dataset"):
        yield from _row_pieces(*column_chunks(source, column), source.size)
    else:
        for text in _python_docs_topics():
            yield from _in_pieces(text, advance_total=len(text.encode("utf-8")))


def column_chunks(source: Source, column: str) -> tuple[Iterator[Any], int]:
    """A parquet file's or saved dataset's `column` as Arrow arrays of ROWS_PER_READ rows (read
    as they are needed), and its number of rows."""
    if source.kind == "parquet":
        parquet = require("pyarrow.parquet", "hf", "reading parquet files")
        file = parquet.ParquetFile(source.path)
        batches = file.iter_batches(ROWS_PER_READ, columns=[column])
        return (b.column(0) for b in batches), file.metadata.num_rows
    table = _load_dataset(source.path, (source.split,))[0].with_format("arrow")
    return (batch.column(column) for batch in table.iter(ROWS_PER_READ)), table.num_rows


def _row_pieces(chunks: Iterator[Any], rows: int, size: int) -> Iterator[Piece]:
    for chunk in chunks:
        advance = size * len(chunk) // max(1, rows)
        for text in chunk.to_pylist():
            if text:  # a null or empty row is no document
                yield from _in_pieces(text, advance)
                advance = 0


def _in_pieces(text: str, advance_total: int) -> Iterator[Piece]:
    """A document held in memory (a JSON line, a row), in pieces of about PIECE_BYTES."""
    if len(text) <= PIECE_BYTES // 4:  # short enough in any encoding: the common case
        yield Piece(text, len(text.encode("utf-8")), True, advance_total)
        return
    start = 0
    while start < len(text):
        end = min(len(text), start + PIECE_BYTES)
        if end < len(text):
            newline = text.rfind("\n", start, end)
            end = newline + 1 if newline > start else end
        part = text[start:end]
        yield Piece(part, len(part.encode("utf-8")), end == len(text), advance_total)
        advance_total, start = 0, end


def _txt_pieces(path: str) -> Iterator[Piece]:
    """A text file as one document, read PIECE_BYTES at a time, each piece ending after a
    newline (or on a character boundary in a long line)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        offset, carry = 0, b""
        while offset < size:
            block = f.read(PIECE_BYTES)
            data = carry + block
            at_end = not block or offset + len(data) >= size  # (a file cut short ends here)
            cut = len(data) if at_end else _cut(data)
            part, carry = data[:cut], data[cut:]
            try:
                text = part.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"input error: {path}: not UTF-8 text (byte {offset + e.start})"
                ) from None
            offset += cut
            yield Piece(text, cut, at_end, cut)
            if at_end:
                return


def _cut(data: bytes) -> int:
    """Where to end a piece of `data`: after its last newline, or else before its last
    character, which the block may have cut."""
    newline = data.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    start = len(data)
    while start > max(0, len(data) - 4) and data[start - 1] & 0xC0 == 0x80:
        start -= 1  # continuation bytes: back to the byte that begins their character
    return start - 1 if start > 1 and data[start - 1] >= 0xC0 else len(data)


def jsonl_fields(path: str, column: str, what: str) -> Iterator[tuple[str, Any, int]]:
    """Each JSON line's `column` field (`what` it holds, for the message when it is missing):
    where the line is (`path:number`), the value, and the input bytes it took (blank lines
    before it included)."""
    with open(path, "rb") as f:
        skipped = 0
        for number, line in enumerate(f, 1):
            if not line.strip():
                skipped += len(line)
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise UserError(f"input error: {where}: not JSON ({e})") from None
            except RecursionError:  # Python's parser recurses once per level of nesting
                raise UserError(
                    f"input error: {where}: JSON nested too deeply to read (arrays or objects "
                    f"inside one another hundreds of levels deep); a row is an object of text "
                    f"or of messages"
                ) from None
            if not isinstance(record, dict) or column not in record:
                raise UserError(
                    f"input error: {where}: no '{column}' field; name the {what} field "
                    f"with --column"
                )
            yield where, record[column], skipped + len(line)
            skipped = 0


def _jsonl_pieces(path: str, column: str) -> Iterator[Piece]:
    carried = 0  # the bytes of lines without text, counted with the next piece
    for where, text, advance in jsonl_fields(path, column, "text"):
        if text is not None and not isinstance(text, str):
            raise UserError(f"input error: {where}: '{column}' is {type(text).__name__}, not text")
        if not text:
            carried += advance
            continue
        try:
            yield from _in_pieces(text, carried + advance)
        except UnicodeEncodeError:
            raise UserError(f"input error: {where}: '{column}' is not valid Unicode") from None
        carried = 0


def _python_docs_topics() -> list[str]:
    """The built-in corpus's documents: the Python documentation topics, in the order in which
    `dtrain.data.text.python_docs` joins them."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]
