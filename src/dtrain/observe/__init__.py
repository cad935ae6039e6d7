"""What a run shows: per-rank log files and the console (`logs`, `progress`), figures about the
run itself (`figures`), and its records, which `RunLog` sends to metrics.jsonl, TensorBoard and
any other sink (`sinks`) on rank 0."""

from dtrain.observe.figures import (
    PEAK_FLOPS,
    StartupClock,
    Throughput,
    memory_stats,
    peak_flops,
    process_start_time,
)
from dtrain.observe.logs import ConsoleHandler, attach_log_files, log, setup_logging
from dtrain.observe.progress import Progress, clock, format_record
from dtrain.observe.runlog import RunLog
from dtrain.observe.sinks import JsonlSink, Record, Sink, TensorBoardSink, build_sinks

__all__ = [
    "PEAK_FLOPS",
    "ConsoleHandler",
    "JsonlSink",
    "Progress",
    "Record",
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
