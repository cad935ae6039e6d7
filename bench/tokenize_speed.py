"""Tokenize: MB/s of text through `dtrain tokenize` against calling `tokenizers` directly on the
same files with the same tokenizer, all cores on both sides.

- Corpus: a folder of .txt files written by the benchmark (CORPUS_MB in all, each a Python
  documentation topic with its lines shuffled by a seed of its own, so that the files are not
  copies of one another). Tokenizer: a byte-level BPE of VOCAB tokens trained by
  `dtrain tokenize --vocab-size` on the built-in corpus, then given to both sides.
- dtrain: the command as a user runs it (`python -m dtrain tokenize FOLDER --tokenizer ...`),
  end to end: start-up, reading, encoding, writing train.bin/val.bin and meta.json.
- Reference: a script that imports tokenizers and numpy, reads the files, calls
  `Tokenizer.encode_batch` (and, second reference, `encode_batch_fast`, which skips offsets) on
  batches of them, appends the end-of-text id to each and writes the ids to one numpy file:
  what a user writes without dtrain. Also timed as a whole process.
- Rounds alternate the sides; medians, with each side's range.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

CORPUS_MB, VOCAB, FILES_PER_BATCH = 24, 8192, 64

REFERENCE = f"""\
import sys, glob, os
import numpy as np
from tokenizers import Tokenizer
folder, tokenizer_path, out, call = sys.argv[1:5]
tokenizer = Tokenizer.from_file(tokenizer_path)
encode = getattr(tokenizer, call)
eot = tokenizer.token_to_id("<|endoftext|>")
files = sorted(glob.glob(os.path.join(folder, "*.txt")))
with open(out, "wb") as f:
    for i in range(0, len(files), {FILES_PER_BATCH}):
        texts = [open(p, encoding="utf-8").read() for p in files[i : i + {FILES_PER_BATCH}]]
        for encoding in encode(texts, add_special_tokens=False):
            np.array(encoding.ids + [eot], dtype=np.uint16).tofile(f)
"""


def write_corpus(folder: Path, megabytes: int) -> int:
    """Files of shuffled documentation topics until `megabytes` MB; their total size."""
    from pydoc_data.topics import topics

    folder.mkdir(parents=True, exist_ok=True)
    names, total, i = sorted(topics), 0, 0
    while total < megabytes * 1_000_000:
        lines = topics[names[i % len(names)]].splitlines(keepends=True)
        random.Random(i).shuffle(lines)
        data = "".join(lines).encode("utf-8")
        (folder / f"{i:05d}.txt").write_bytes(data)
        total, i = total + len(data), i + 1
    return total


def _timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    common.run(cmd, timeout=1800)
    return time.perf_counter() - started


def dtrain_side(work: Path, corpus: Path, tokenizer: Path) -> float:
    out = work / "out-dtrain"
    return _timed([sys.executable, "-m", "dtrain", "tokenize", str(corpus), "--out", str(out),
                   "--tokenizer", str(tokenizer), "--overwrite"])


def reference_side(work: Path, corpus: Path, tokenizer: Path, call: str) -> float:
    script = work / "reference.py"
    script.write_text(REFERENCE)
    return _timed([sys.executable, str(script), str(corpus), str(tokenizer),
                   str(work / f"reference-{call}.bin"), call])


def run(work: Path, rounds: int = 3) -> list[Figure]:
    corpus = work / "corpus"
    size = write_corpus(corpus, CORPUS_MB)
    trained = work / "trained"
    common.run([sys.executable, "-m", "dtrain", "tokenize", "--corpus", "python_docs", "--out",
                str(trained), "--vocab-size", str(VOCAB)])
    tokenizer = trained / "tokenizer.json"
    ours, batch, fast = common.alternate(
        rounds,
        lambda _: dtrain_side(work, corpus, tokenizer),
        lambda _: reference_side(work, corpus, tokenizer, "encode_batch"),
        lambda _: reference_side(work, corpus, tokenizer, "encode_batch_fast"),
    )
    meta = json.loads((work / "out-dtrain" / "meta.json").read_text())
    tokens = meta["tokens"]["train"] + meta["tokens"]["val"]
    reference_tokens = (work / "reference-encode_batch.bin").stat().st_size // 2
    if tokens != reference_tokens:
        raise RuntimeError(f"dtrain wrote {tokens} tokens, the reference {reference_tokens}")
    mb = size / 1e6

    def rate(times: list[float]) -> str:
        return (f"{mb / common.median(times):.2f} MB/s (range {mb / max(times):.2f}-"
                f"{mb / min(times):.2f})")

    cores = _cores()
    where = f"{mb:.0f} MB in {len(list(corpus.iterdir()))} files, {cores} cores, {rounds} rounds"
    return [
        Figure("tokenize: dtrain / tokenizers encode_batch_fast", common.median(fast)
               / common.median(ours), "x", ">= 0.8", f"dtrain {rate(ours)}, direct {rate(fast)}; "
               f"{where}"),
        Figure("tokenize: dtrain / tokenizers encode_batch", common.median(batch)
               / common.median(ours), "x", ">= 0.8", f"direct {rate(batch)}"),
        Figure("tokenize: dtrain throughput", mb / common.median(ours), "MB/s", "",
               f"{tokens / common.median(ours) / 1e6:.2f} M tokens/s, whole command "
               f"(start-up included), vocabulary {VOCAB}"),
    ]


def _cores() -> int:
    import os
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    common.run_standalone(run)
