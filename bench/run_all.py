"""Run every benchmark and print its figures against the goals (`make bench`).

    python bench/run_all.py                      # all of them, about an hour on 2 cores
                                                 # (the memory frontier alone ~40 minutes)
    python bench/run_all.py --only overhead,startup --rounds 5

Figures are measured, never pass/fail: the exit status is 0 unless a benchmark could not run.
Wall-clock figures move with whatever else the machine does; the load average is printed next to
them, and on a shared machine `nice -n -10 make bench` (as root) keeps them steadier.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint_io  # noqa: E402
import exit_codes  # noqa: E402
import frontier  # noqa: E402
import headline  # noqa: E402
import image_folder  # noqa: E402
import input_pipeline  # noqa: E402
import memory  # noqa: E402
import objstore_io  # noqa: E402
import overhead  # noqa: E402
import peers  # noqa: E402
import pipeline_parallel  # noqa: E402
import replicas  # noqa: E402
import startup  # noqa: E402
import tensor_parallel  # noqa: E402
import tokenize_speed  # noqa: E402
import tokens_data  # noqa: E402
from common import Figure  # noqa: E402

BENCHMARKS = {"overhead": overhead, "checkpoint": checkpoint_io, "memory": memory,
              "frontier": frontier,
              "startup": startup, "pipeline": input_pipeline, "images": image_folder,
              "peers": peers, "exit_codes": exit_codes, "headline": headline,
              "tokenize": tokenize_speed, "tokens": tokens_data, "objstore": objstore_io,
              "replicas": replicas, "tensor_parallel": tensor_parallel,
              "pipeline_parallel": pipeline_parallel}
# Run on request only: exit_codes (40 launches, several minutes) and replicas (torchft, the
# `replicas` extra; about 10 minutes a round on 2 cores), tensor_parallel (4 ranks a side,
# about 2 minutes a round) and pipeline_parallel (2 ranks, three sides). The timed ones first;
# the memory ones (peak RSS, the frontier's depths) last, as the machine's load moves them least.
MEMORY = ["memory", "frontier"]
ON_REQUEST = ("exit_codes", "replicas", "tensor_parallel", "pipeline_parallel")
DEFAULT = [n for n in BENCHMARKS if n not in (*ON_REQUEST, *MEMORY)] + MEMORY


def _machine() -> str:
    import torch
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cpu = platform.processor() or platform.machine()
    return (f"{platform.node()}: {os.cpu_count()} cores, {cpu}, "
            f"python {platform.python_version()}, torch {torch.__version__}, load average {load}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(DEFAULT),
                        help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternated repetitions per comparison "
                        "(default: each benchmark's own)")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; "
                     f"choose from {', '.join(BENCHMARKS)}")
    print(f"dtrain benchmarks on {_machine()}", flush=True)
    figures: list[Figure] = []
    failed = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        for name in names:
            module = BENCHMARKS[name]
            print(f"\n[{name}] {module.__doc__.strip().splitlines()[0]}", flush=True)
            began = time.perf_counter()
            work = Path(tmp) / name
            work.mkdir()
            try:
                results = module.run(work) if args.rounds is None else module.run(work, args.rounds)
            except Exception:  # noqa: BLE001 - report it and go on with the other benchmarks
                traceback.print_exc()
                failed.append(name)
                continue
            for figure in results:
                print(figure.line(), flush=True)
            figures += results
            print(f"  ({time.perf_counter() - began:.0f} s, load average "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
    print(f"\nsummary ({time.perf_counter() - started:.0f} s)")
    for figure in figures:
        print(figure.line())
    missed = [f.name for f in figures if f.met is False]
    print(f"{len(figures) - len(missed)} of {len(figures)} figures meet their goals or have none"
          + (f"; missed: {'; '.join(missed)}" if missed else ""))
    if failed:
        print(f"could not run: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
