"""What a run shows: per-rank log files and the console (`logs`, `progress`), figures about the
run itself (`figures`), and its records, which `RunLog` sends to metrics.jsonl, TensorBoard and
any other sink (`sinks`) on rank 0.

The names below are loaded when first used: commands that need no torch (`dtrain tokenize`,
`dtrain verify`) import this package for its log and clock without paying for torch's import
(about 2 s), which `figures` and `sinks` need."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtrain.core.logs import ConsoleHandler, attach_log_files, log, setup_logging
    from dtrain.observe.figures import (
        PEAK_FLOPS,
        StartupClock,
        Throughput,
        memory_stats,
        peak_flops,
        process_start_time,
    )
    from dtrain.observe.progress import Progress, clock, format_record
    from dtrain.observe.runlog import RunLog, build_sinks
    from dtrain.observe.sinks import JsonlSink, Record, RunFacts, Sink, TensorBoardSink

_MODULE_OF = {
    **dict.fromkeys(
        [
            "PEAK_FLOPS",
            "StartupClock",
            "Throughput",
            "memory_stats",
            "peak_flops",
            "process_start_time",
        ],
        "dtrain.observe.figures",
    ),
    **dict.fromkeys(
        ["ConsoleHandler", "attach_log_files", "log", "setup_logging"], "dtrain.core.logs"
    ),
    **dict.fromkeys(["Progress", "clock", "format_record"], "dtrain.observe.progress"),
    **dict.fromkeys(["RunLog", "build_sinks"], "dtrain.observe.runlog"),
    **dict.fromkeys(
        ["JsonlSink", "Record", "RunFacts", "Sink", "TensorBoardSink"], "dtrain.observe.sinks"
    ),
}

__all__ = [
    "PEAK_FLOPS",
    "ConsoleHandler",
    "JsonlSink",
    "Progress",
    "Record",
    "RunFacts",
    "RunLog",
    "Sink",
    "StartupClock",
    "TensorBoardSink",
    "Throughput",
    "attach_log_files",
    "build_sinks",
    "clock",
    "format_record",
    "log",
    "memory_stats",
    "peak_flops",
    "process_start_time",
    "setup_logging",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
