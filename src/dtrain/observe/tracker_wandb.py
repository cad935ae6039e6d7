"""Weights & Biases as a tracker (`log.wandb`): offline by default, into `<run dir>/wandb/`
(`wandb sync <run dir>/wandb/offline-run-*` uploads it), or online for a logged-in user.

The W&B run id is dtrain's: every attempt of the run (kill/resume, requeue) opens the same id
with `resume="allow"`; offline, each attempt is one `offline-run-<time>-<id>` folder, and
syncing them all fills one W&B run. Params go to the run's config, the tags that are short
(host, world size, SLURM ids, versions) to its tags as `key=value`, the run directory and the
best checkpoint to its summary.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from dtrain.observe.trackers import Rows, RunInfo

_SHORT_TAGS = ("host", "world_size", "slurm_job_id", "slurm_array_job_id", "slurm_array_task_id")
_TAG_CHARS = 64  # W&B's limit


class WandbTracker:
    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.run: Any = None

    @staticmethod
    def requires(settings: Any) -> tuple[str, ...]:
        return ("wandb",)

    def start(self, info: RunInfo, saved: Mapping[str, Any] | None) -> tuple[dict[str, Any], bool]:
        import wandb

        project = self.settings.project or info.experiment
        continued = bool(saved and saved.get("project") == project and saved.get("run_id"))
        run_id = str(saved["run_id"]) if saved and continued else secrets.token_hex(6)
        tags = [f"{k}={info.tags[k]}"[:_TAG_CHARS] for k in _SHORT_TAGS if k in info.tags]
        tags += [f"{k}={v}"[:_TAG_CHARS] for k, v in info.tags.items() if k.endswith("_version")]
        self.run = wandb.init(
            project=project,
            id=run_id,
            resume="allow",
            name=info.name,
            group=info.group,
            dir=info.run_dir,
            mode=self.settings.mode,
            tags=tags,
            # Not W&B's console capture: it would wrap the training's stdout and stderr.
            settings=wandb.Settings(console="off", silent=True, save_code=False),
        )
        # A resume may change keys that do not change what is trained (train.epochs, log.*).
        self.run.config.update(info.params, allow_val_change=True)
        summary = {"run_dir": info.run_dir}
        if info.previous:
            summary["previous_run_id"] = info.previous
        self.run.summary.update(summary)
        return {"project": project, "mode": self.settings.mode, "run_id": run_id}, continued

    def sent_steps(self) -> None:
        return None  # offline, W&B holds its records in files of its own: trackers.json tells

    def log(self, rows: Rows) -> None:
        for step, values in rows:
            self.run.log(values, step=step)

    def end(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update(dict(summary))

    def finish(self, status: str) -> None:
        if status == "preempted":
            self.run.mark_preempting()  # W&B shows it as preempted, to be resumed
        self.run.finish(exit_code=1 if status == "failed" else 0)
