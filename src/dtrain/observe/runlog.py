"""The one object the training loop reports to: records go to the sinks (rank 0), logged steps
and evaluations to the console and log files."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from dtrain.config import LogConfig
from dtrain.core.logs import log
from dtrain.files import names
from dtrain.observe.progress import Progress, format_record
from dtrain.observe.sinks import JsonlSink, Record, RunFacts, Sink, TensorBoardSink
from dtrain.observe.trackers import build_trackers


class RunLog:
    """The run's records. Every method is a no-op except on rank 0 (logging aside).

    `sinks` replaces the ones the config asks for (`build_sinks`); either way only rank 0 has
    any, and they are opened here: metrics.jsonl loses the records after `resumed_step` at once.
    """

    def __init__(
        self,
        settings: LogConfig,
        facts: RunFacts,
        run_dir: str,
        is_main: bool,
        resumed_step: int,
        superseded: str | None = None,
        *,
        sinks: Sequence[Sink] | None = None,
    ) -> None:
        self.facts, self.is_main = facts, is_main
        # With every rank on the console, their lines would run into rank 0's bar: lines then.
        style = "lines" if settings.all_ranks else settings.progress
        self.progress = Progress(sys.stderr, style, settings.every_s, shown=is_main)
        self.sinks: list[Sink] = []
        self._session_started = False
        if is_main:
            self.sinks = (
                list(sinks)
                if sinks is not None
                else build_sinks(settings, facts, run_dir, resumed_step, superseded)
            )

    def _write(self, record: Record) -> None:
        if not self._session_started:
            self._session_started = True
            self._start_session()
        for sink in self.sinks:
            sink.write(record)

    def train(
        self,
        record: dict[str, Any],
        extra_scalars: dict[str, float],
        done_in_epoch: int,
        at_log_step: bool,
    ) -> None:
        """A training step's figures: to the sinks at logged steps (`extra_scalars` to the
        dashboards only), to the console in any case."""
        if not self.is_main:
            return
        if at_log_step:
            self._write(Record("train", record, extra_scalars))
        self.progress.update(done_in_epoch, record, at_log_step)

    def evaluation(self, record: dict[str, Any]) -> None:
        log.info(format_record(record))  # every rank's log: they must all show the same numbers
        if self.is_main:
            self._write(Record("val", record))

    def _hparam_config(self) -> dict[str, Any]:
        return {
            key: (value if isinstance(value, (int, float, str, bool)) else str(value))
            for key, value in self.facts.config.items()
        }

    def _start_session(self) -> None:
        """TensorBoard's HParams tab lists a run from its start on (the other sinks take the
        config when they open); here rather than at construction, where it would import
        TensorBoard on the way to the first step."""
        for sink in self.sinks:
            if isinstance(sink, TensorBoardSink):
                sink.session_start(self._hparam_config())

    def hparams(self, step: int, final_metrics: dict[str, float | None]) -> None:
        """The flattened resolved config and the final/best metrics (those known), for the
        sinks that compare runs by them (TensorBoard's HParams tab)."""
        if not self.sinks:
            return
        config = self._hparam_config()
        final = {key: value for key, value in final_metrics.items() if value is not None}
        for sink in self.sinks:
            sink.hparams(step, config, final)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def build_sinks(
    settings: LogConfig, facts: RunFacts, run_dir: str, resumed_step: int, superseded: str | None
) -> list[Sink]:
    """The sinks the log section asks for, on rank 0. `superseded` is where a rewind moved the
    abandoned history (records dropped on resume go there too)."""
    sinks: list[Sink] = [JsonlSink(os.path.join(run_dir, names.METRICS), resumed_step, superseded)]
    if settings.tensorboard:
        sinks.append(TensorBoardSink(os.path.join(run_dir, names.TENSORBOARD), resumed_step))
    # After metrics.jsonl is cut back to the resumed step: the trackers hold what it keeps.
    sinks.extend(build_trackers(settings, facts, run_dir, resumed_step, superseded))
    return sinks
