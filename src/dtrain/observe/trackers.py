"""Experiment trackers (MLflow, W&B) as sinks: what metrics.jsonl gets, sent off the training
thread, into one tracker run per dtrain run however often the run is killed and resumed.

Each tracker is one class with the `Tracker` methods, in a module of its own, named in
`TRACKERS` with the extra that installs its library; its settings are `log.<name>`.

- The tracker run's identity and, per metric, the highest step sent are kept in
  `<run dir>/trackers.json`. A resumed attempt continues that run and sends only what it does
  not hold yet: records that metrics.jsonl has but the tracker missed (the killed attempt had
  them queued, or the tracker was down) are sent from metrics.jsonl; steps that the resumed
  training replays and that were sent already are not sent again.
- When dtrain leaves a history behind (a rewind, `ckpt.resume=none`: the checkpoints and
  records go to `superseded/`), the tracker gets a new run holding what metrics.jsonl keeps.
- A tracker never stops or slows the training: records go on a queue that a daemon thread
  empties; the first failure is one warning line and the tracker is left alone for the rest
  of the attempt; at the end the run waits at most `CLOSE_WAIT_S` for pending sends.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import queue
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from dtrain.config import LogConfig
from dtrain.core.errors import UserError, first_line
from dtrain.core.logs import log
from dtrain.files import metrics as metrics_file
from dtrain.files import names
from dtrain.observe.sinks import EVALUATED, Record, RunFacts

# name -> (module, class, extra that installs its library).
TRACKERS: dict[str, tuple[str, str, str]] = {
    "mlflow": ("dtrain.observe.tracker_mlflow", "MlflowTracker", "mlflow"),
    "wandb": ("dtrain.observe.tracker_wandb", "WandbTracker", "wandb"),
}
STATE_FILE = names.TRACKERS
CLOSE_WAIT_S = 10.0
MAX_QUEUED = 100_000  # records; beyond this (a tracker far behind) new ones are dropped
BATCH = 500  # records taken off the queue per send
# Sends at most this often: what was queued meanwhile goes in one batch. A tracker's client
# takes the GIL of the training process (MLflow's SQL store: ~3.5 ms of CPU for one record
# sent alone, ~0.5 ms per record in batches), so fewer, larger sends slow training less.
SEND_INTERVAL_S = 1.0

Rows = list[tuple[int, dict[str, float]]]


@dataclass
class RunInfo:
    """What every tracker is told about the run, as plain strings."""

    name: str  # run.name
    experiment: str  # the sweep's name for a trial of a sweep, else run.name
    group: str | None  # the sweep's name, when the run is a trial of one
    run_dir: str  # absolute
    out_dir: str  # absolute run.out_dir
    params: dict[str, str]  # the resolved config, flattened
    tags: dict[str, str]  # host, world size, SLURM ids, versions, run directory
    monitor: tuple[str, str] = ("val_acc", "max")  # ckpt.monitor and monitor_mode
    previous: str | None = None  # the tracker run of a history that was left behind


class Tracker(Protocol):
    """One experiment tracker. Every method runs on the sender thread and may raise: the first
    error ends the tracker's part in this attempt with one warning line."""

    def __init__(self, settings: Any) -> None:
        """`settings`: the tracker's section of the config (`log.<name>`)."""

    @staticmethod
    def requires(settings: Any) -> tuple[str, ...]:
        """The modules it needs with these settings (checked before the run starts)."""

    def start(self, info: RunInfo, saved: Mapping[str, Any] | None) -> tuple[dict[str, Any], bool]:
        """Open the tracker run: continue the one `saved` names (what an earlier `start`
        returned) when it is still there and fits, else begin one. Returns what identifies
        it (kept in trackers.json) and whether it was continued."""

    def sent_steps(self) -> dict[str, int] | None:
        """Per metric, the highest step the tracker holds, when it can tell."""

    def log(self, rows: Rows) -> None:
        """Metrics by step, in step order; on the tracker when this returns."""

    def end(self, summary: Mapping[str, Any]) -> None:
        """At the end of an attempt: the final and best metrics, the best checkpoint's path."""

    def finish(self, status: str) -> None:
        """`finished`, `preempted` (a stop signal: the run will resume) or `failed`."""


def tracker_settings(settings: LogConfig, name: str) -> Any:
    return getattr(settings, name)


def _tracker_class(name: str) -> Any:
    module, cls, _ = TRACKERS[name]
    return getattr(importlib.import_module(module), cls)


def check_installed(settings: LogConfig) -> None:
    """Before any process group: every enabled tracker's library is importable, else one line
    naming the extra (exit 2). Looks the modules up without importing them (that takes a
    second or more; `build_trackers` does it, on rank 0 alone)."""
    for name, (_, _, extra) in TRACKERS.items():
        section = tracker_settings(settings, name)
        if not section.enabled:
            continue
        for module in _tracker_class(name).requires(section):
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise UserError(
                    f"missing dependency: log.{name}.enabled needs the '{extra}' extra "
                    f"(no module '{module}'): pip install 'dtrain[{extra}]'"
                )


def build_trackers(
    settings: LogConfig, facts: RunFacts, run_dir: str, resumed_step: int, superseded: str | None
) -> list[TrackerSink]:
    """The enabled trackers' sinks (rank 0). Call after metrics.jsonl was cut back to
    `resumed_step`: what it keeps is what the trackers must hold."""
    enabled = [n for n in TRACKERS if tracker_settings(settings, n).enabled]
    if not enabled:
        return []
    state = StateFile(os.path.join(run_dir, STATE_FILE))
    new_history = superseded is not None
    if new_history and state.data:
        assert superseded is not None
        shutil.copy2(state.path, os.path.join(superseded, STATE_FILE))
    sinks = []
    for name in enabled:
        info = run_info(facts, run_dir)
        saved = state.data.get(name)
        if new_history and saved:
            info.previous = str(saved.get("run_id"))
            saved = None
        section = tracker_settings(settings, name)
        # Imported here, on the training thread, before the first step: imported by the sender
        # thread, the library held module locks that the training thread could meet at the
        # run's end, waiting as long as the import took on a loaded machine.
        for module in _tracker_class(name).requires(section):
            importlib.import_module(module)
        tracker = _tracker_class(name)(section)
        sink = TrackerSink(name, tracker, info, saved, state, resumed_step)
        sink.begin()
        sinks.append(sink)
    return sinks


def run_info(facts: RunFacts, run_dir: str) -> RunInfo:
    import torch

    import dtrain
    from dtrain.process import dist

    out_dir = os.path.abspath(facts.out_dir)
    name = facts.name
    sweep = sweep_name(out_dir)
    tags = {
        "host": socket.gethostname(),
        "world_size": str(dist.world_size()),
        "dtrain_version": dtrain.__version__,
        "torch_version": torch.__version__,
        "run_dir": os.path.abspath(run_dir),
    }
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT"):
        if os.environ.get(var):
            tags["slurm_" + var[6:].lower()] = os.environ[var]
    params = {
        key: value if isinstance(value, str) else json.dumps(value, default=str)
        for key, value in facts.config.items()
    }
    return RunInfo(
        name, sweep or name, sweep, os.path.abspath(run_dir), out_dir, params, tags, facts.monitor
    )


def sweep_name(out_dir: str) -> str | None:
    """The name in `<out_dir>/sweep.yaml`: the trials of `dtrain sweep` live in its folder."""
    path = os.path.join(out_dir, names.SWEEP)
    if not os.path.isfile(path):
        return None
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    name = data.get("name") if isinstance(data, dict) else None
    return str(name) if name else None


class StateFile:
    """trackers.json: `{name: {...identity..., "sent": {metric: step}}}`, rewritten whole
    (atomically) after each send; shared by the trackers' threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.data: dict[str, dict[str, Any]] = {}
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
            if isinstance(loaded, dict):
                self.data = {k: v for k, v in loaded.items() if isinstance(v, dict)}
        except (OSError, ValueError):
            pass  # none yet, or torn: the trackers are asked what they hold, or start anew

    def put(self, name: str, entry: dict[str, Any]) -> None:
        with self.lock:
            self.data[name] = entry
            tmp = f"{self.path}.tmp-{threading.get_ident()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)


def metrics_of(kind: str, values: Mapping[str, Any]) -> dict[str, float]:
    """A record's metrics: its numbers but `step`. An evaluation's `epoch` counts finished
    epochs while the training record of the same step has the epoch the step was in: the
    trackers get the latter, so that `epoch` has one value per step."""
    skip = ("step", "epoch") if kind == "val" else ("step",)
    return {
        key: float(value)
        for key, value in values.items()
        if key not in skip and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def kind_of(values: Mapping[str, Any]) -> str:
    return "val" if any(key.startswith("val_") for key in values) else "train"


@dataclass
class _End:
    summary: dict[str, Any] = field(default_factory=dict)


_CLOSE = object()


class TrackerSink:
    """A `Sink` that hands records to a sender thread for one `Tracker`."""

    def __init__(
        self,
        name: str,
        tracker: Tracker,
        info: RunInfo,
        saved: Mapping[str, Any] | None,
        state: StateFile,
        resumed_step: int,
    ) -> None:
        self.name, self.tracker, self.info = name, tracker, info
        self.saved, self.state, self.resumed_step = saved, state, resumed_step
        self.queue: queue.Queue[Any] = queue.Queue()
        self.sent: dict[str, int] = {}
        self.entry: dict[str, Any] = {}
        self.failed = False
        self.opened = False
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"dtrain-{name}", daemon=True)

    def begin(self) -> None:
        self.thread.start()

    # -- the training thread: never waits ------------------------------------------------------
    def write(self, record: Record) -> None:
        if self.failed:
            return
        if self.queue.qsize() >= MAX_QUEUED:
            self._fail(f"more than {MAX_QUEUED} records waiting", None)
            return
        self.queue.put((record.kind, dict(record.values)))  # the loop may reuse its dict

    def hparams(self, step: int, config: Mapping[str, Any], final: Mapping[str, float]) -> None:
        """The end of an attempt that was not a crash: the best checkpoint and metrics."""
        summary = {f"final_{k}" if k.startswith(EVALUATED) else k: v for k, v in final.items()}
        self.queue.put(_End(summary))

    def close(self) -> None:
        """Wait at most CLOSE_WAIT_S for what is queued, then leave (the thread is a daemon)."""
        self.queue.put(_CLOSE)
        self.closing.set()
        self.thread.join(CLOSE_WAIT_S)
        if self.thread.is_alive() and not self.failed:
            self.failed = True
            log.warning(
                f"{self.name}: still sending {CLOSE_WAIT_S:.0f} s after the end of the run; "
                f"leaving it (metrics.jsonl has every record; a resume of this run sends what "
                f"the tracker misses)"
            )

    # -- the sender thread ---------------------------------------------------------------------
    def _fail(self, what: str, error: BaseException | None) -> None:
        if self.failed:
            return
        self.failed = True
        why = f" ({type(error).__name__}: {first_line(error)[:300]})" if error else ""
        log.warning(
            f"{self.name}: {what}{why}; not sending to {self.name} for the rest of this "
            f"attempt (metrics.jsonl and TensorBoard have every record)"
        )

    def _run(self) -> None:
        try:
            self._open()
        except Exception as e:  # noqa: BLE001 - any failure of a tracker is one warning
            self._fail("cannot start the tracker run", e)
        status = "failed"
        pending: Any = None  # taken off the queue while gathering a batch: the next item
        while True:
            item, pending = (self.queue.get() if pending is None else pending), None
            if item is _CLOSE:
                break
            if isinstance(item, _End):
                status = "finished"
                self._guarded("cannot record the end of the attempt", self._end, item)
                continue
            records = [item]
            while len(records) < BATCH:
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is _CLOSE or isinstance(more, _End):
                    pending = more
                    break
                records.append(more)
            rows = [(int(values["step"]), metrics_of(kind, values)) for kind, values in records]
            self._guarded("cannot send metrics", self._send, rows)
            self.closing.wait(SEND_INTERVAL_S)
        if self.opened and not self.failed:
            if status == "finished":
                from dtrain.core import signals

                status = "preempted" if signals.received() else "finished"
            self._guarded("cannot close the tracker run", self.tracker.finish, status)

    def _guarded(self, what: str, fn: Any, arg: Any) -> None:
        if self.failed:
            return
        try:
            fn(arg)
        except Exception as e:  # noqa: BLE001
            self._fail(what, e)

    def _open(self) -> None:
        self.entry, continued = self.tracker.start(self.info, self.saved)
        self.opened = True
        if continued:
            held = self.tracker.sent_steps()
            saved_sent = (self.saved or {}).get("sent", {})
            self.sent = dict(held) if held is not None else dict(saved_sent)
        self._send(self._missed())
        self._save()

    def _missed(self) -> Rows:
        """Records that metrics.jsonl keeps (up to the resumed step) and the tracker lacks."""
        rows: Rows = []
        records, _ = metrics_file.read(os.path.join(self.info.run_dir, names.METRICS))
        for _, values in records:  # (a line being written is left out)
            step = values["step"]
            if step > self.resumed_step:
                break  # this attempt's records: they are on the queue
            rows.append((step, metrics_of(kind_of(values), values)))
        return rows

    def _send(self, rows: Rows) -> None:
        todo: Rows = []
        for step, metrics in rows:
            new = {k: v for k, v in metrics.items() if step > self.sent.get(k, -1)}
            if new and todo and todo[-1][0] == step:
                todo[-1][1].update(new)  # the evaluation of a step joins its training record
            elif new:
                todo.append((step, new))
        if not todo:
            return
        self.tracker.log(todo)
        for step, metrics in todo:
            for key in metrics:
                self.sent[key] = step
        self._save()

    def _save(self) -> None:
        self.state.put(self.name, {**self.entry, "sent": self.sent, "updated": time.time()})

    def _end(self, end: _End) -> None:
        summary = dict(end.summary)
        # The path is recorded, the checkpoint is not uploaded.
        from dtrain.files.store import Store

        best = Store(self.info.run_dir).best(*self.info.monitor)
        if best is not None:
            summary["best_checkpoint"] = best.path
        self.tracker.end(summary)
