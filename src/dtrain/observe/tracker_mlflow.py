"""MLflow as a tracker (`log.mlflow`): by default a local SQLite file beside the runs, no server.

Params are the resolved config; tags (prefixed `dtrain.`) say where and how the run trained;
metrics are metrics.jsonl's. MLflow's params cannot change once logged: a resume that changes a
key (a longer `train.epochs`) keeps the first value as the param and records the new one as the
tag `dtrain.param.<key>`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from dtrain.observe.trackers import Rows, RunInfo

# MLflow's HTTP client retries for minutes by default (rate limits of hosted servers); a run's
# end waits for its tracker only briefly, so a server that does not answer is given up sooner.
# A user's own settings win.
_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
_STATUS = {"finished": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}
_PARAM_CHARS = 500  # the smallest limit of MLflow servers in use
_BATCH = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's log_batch limits


def default_uri(out_dir: str) -> str:
    return "sqlite:///" + os.path.join(os.path.abspath(out_dir), "mlflow.db")


class MlflowTracker:
    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.client: Any = None
        self.run_id = ""
        for name, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)

    @staticmethod
    def requires(settings: Any) -> tuple[str, ...]:
        uri = settings.tracking_uri or "sqlite:"
        # MLflow's SQL store (sqlite:, postgresql:, ...) needs SQLAlchemy and Alembic, which
        # the `mlflow-skinny` package leaves out.
        remote = uri.startswith(("http:", "https:", "file:", "databricks"))
        return ("mlflow",) if remote else ("mlflow", "sqlalchemy", "alembic")

    def start(self, info: RunInfo, saved: Mapping[str, Any] | None) -> tuple[dict[str, Any], bool]:
        import logging

        from mlflow.tracking import MlflowClient

        # MLflow and Alembic log each database set-up step; dtrain's console is for the run.
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        uri = self.settings.tracking_uri or default_uri(info.out_dir)
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.settings.experiment or info.experiment
        run = None
        if saved and saved.get("tracking_uri") == uri and saved.get("run_id"):
            run = self._existing(str(saved["run_id"]))
        continued = run is not None
        if run is None:
            tags = {"dtrain.previous_run_id": info.previous} if info.previous else {}
            if info.group:
                tags["dtrain.sweep"] = info.group
            run = self.client.create_run(
                self._experiment_id(experiment, info), run_name=info.name, tags=tags
            )
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        self._log_params(info.params, run.data.params)
        self._tags({f"dtrain.{k}": v for k, v in info.tags.items()})
        entry = {"tracking_uri": uri, "experiment": experiment, "run_id": self.run_id}
        return entry, continued

    def _existing(self, run_id: str) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None  # deleted in MLflow: a new run holds the records from now on
            raise
        return None if run.info.lifecycle_stage == "deleted" else run

    def _experiment_id(self, name: str, info: RunInfo) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        # A local store keeps its (unused) artifact folder beside it, not in the working
        # directory; a server decides for itself.
        local = self.client.tracking_uri.startswith("sqlite:")
        artifacts = "file://" + os.path.join(info.out_dir, "mlartifacts") if local else None
        try:
            return str(self.client.create_experiment(name, artifact_location=artifacts))
        except MlflowException:
            found = self.client.get_experiment_by_name(name)  # a sweep's trials race for it
            if found is None:
                raise
            return str(found.experiment_id)

    def _log_params(self, params: Mapping[str, str], logged: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        new = []
        changed = {}
        for key, value in params.items():
            value = value[:_PARAM_CHARS]
            if key not in logged:
                new.append(Param(key, value))
            elif logged[key] != value:
                changed[f"dtrain.param.{key}"] = value
        for i in range(0, len(new), _BATCH["params"]):
            self.client.log_batch(self.run_id, params=new[i : i + _BATCH["params"]])
        self._tags(changed)

    def _tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(items), _BATCH["tags"]):
            self.client.log_batch(self.run_id, tags=items[i : i + _BATCH["tags"]])

    def sent_steps(self) -> dict[str, int]:
        data = self.client.get_run(self.run_id).data
        # A run's latest value of a metric is the one of its highest step (MLflow orders them by
        # step, then time): that step comes with the run, without reading any history. Only
        # RunData's private list has it; the history is the slow, public way.
        latest = getattr(data, "_metric_objs", None)
        if latest is not None:
            return {m.key: int(m.step) for m in latest}
        held = {}
        for key in data.metrics:
            history = self.client.get_metric_history(self.run_id, key)
            if history:
                held[key] = max(m.step for m in history)
        return held

    def log(self, rows: Rows) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for step, values in rows for k, v in values.items()]
        for i in range(0, len(metrics), _BATCH["metrics"]):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _BATCH["metrics"]])

    def end(self, summary: Mapping[str, Any]) -> None:
        self._tags({f"dtrain.{k}": v for k, v in summary.items()})

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, _STATUS[status])
