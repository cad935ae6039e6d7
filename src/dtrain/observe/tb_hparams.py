"""What a run writes for TensorBoard's HParams tab, so that `tensorboard --logdir <folder>` shows
the runs of a folder (a sweep's trials) as one table and parallel-coordinates view.

Two kinds of summaries, built here and written by TensorBoardSink:

- the session start: every flattened config key with its value (plus a trial's swept keys from
  the sweep's sweep.yaml, also those inside `model.args`). Written with the run's first record,
  so that a run still going on, killed or failed is a row too;
- the experiment: the columns, at the run's end. Swept keys come first and are marked `differs`
  with the range the sweep covers (TensorBoard shows the first five columns, those that differ
  before the others), then the main keys of `MAIN_KEYS`; the metrics are the `hparam/<name>`
  scalars of the final and best figures.

TensorBoard keeps the first metadata it reads for a tag in a run, and for the whole folder it
takes the first experiment it finds: every run writes the same columns, so any one will do.
No session end is written: the first attempt's status would stay after a resume; `dtrain runs`
gives the status instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]

    from dtrain.files.sweeps import TrialSweep

# The columns besides the swept keys: what tells most runs apart.
MAIN_KEYS = (
    "model.name",
    "data.name",
    "data.batch_size",
    "optim.name",
    "optim.lr",
    "optim.weight_decay",
    "sched.name",
    "train.epochs",
    "train.max_steps",
    "train.grad_accum",
    "train.precision",
    "parallel.mode",
    "run.seed",
)


def scalar(value: Any) -> bool | float | str | None:
    """A value as an hparam holds it: a bool, a number, text; a list or mapping as its JSON text.
    None has no hparam value."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return json.dumps(value, sort_keys=True, default=str)


def session_values(config: Mapping[str, Any], trial: TrialSweep | None) -> dict[str, Any]:
    """The config's values with the trial's swept ones (a key inside model.args is not one of
    the flattened config's keys)."""
    values = {key: scalar(value) for key, value in config.items()}
    if trial is not None:
        values.update({key: scalar(value) for key, value in trial.values.items()})
    return {key: value for key, value in values.items() if value is not None}


def session_start(config: Mapping[str, Any], trial: TrialSweep | None) -> Summary:
    from tensorboard.plugins.hparams import metadata  # type: ignore[import-untyped]
    from tensorboard.plugins.hparams.plugin_data_pb2 import SessionStartInfo  # type: ignore[import-untyped]

    start = SessionStartInfo()
    for key, value in session_values(config, trial).items():
        if isinstance(value, bool):
            start.hparams[key].bool_value = value
        elif isinstance(value, float):
            start.hparams[key].number_value = value
        else:
            start.hparams[key].string_value = value
    return _summary(metadata.SESSION_START_INFO_TAG, session_start_info=start)


def experiment(config: Mapping[str, Any], trial: TrialSweep | None, metrics: list[str]) -> Summary:
    """The columns: the swept keys (with their range), the main keys, the `metrics` tags."""
    from tensorboard.plugins.hparams import api_pb2, metadata

    values = session_values(config, trial)
    swept = [k for k in trial.keys if k in values] if trial is not None else []
    infos = []
    for key in [*swept, *(k for k in MAIN_KEYS if k in values and k not in swept)]:
        info = api_pb2.HParamInfo(name=key, type=_type(values[key]), differs=key in swept)
        if trial is not None and key in swept:
            _set_domain(info, [scalar(v) for v in trial.domains.get(key, [])], values[key])
        infos.append(info)
    return _summary(
        metadata.EXPERIMENT_TAG,
        experiment=api_pb2.Experiment(
            hparam_infos=infos,
            metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=t)) for t in metrics],
        ),
    )


def _type(value: Any) -> int:
    from tensorboard.plugins.hparams import api_pb2

    if isinstance(value, bool):
        return int(api_pb2.DATA_TYPE_BOOL)
    if isinstance(value, float):
        return int(api_pb2.DATA_TYPE_FLOAT64)
    return int(api_pb2.DATA_TYPE_STRING)


def _set_domain(info: Any, domain: list[Any], value: Any) -> None:
    """Numbers: the interval the trials span; text and bools: the trials' distinct values. A
    domain of mixed types (a trial's value of another type) is left out."""
    domain = [v for v in domain if v is not None]
    if not domain or any(type(v) is not type(value) for v in domain):
        return
    if isinstance(value, float):
        info.domain_interval.min_value = min(domain)
        info.domain_interval.max_value = max(domain)
        return
    for v in dict.fromkeys(domain):
        if isinstance(v, bool):
            info.domain_discrete.values.add().bool_value = v
        else:
            info.domain_discrete.values.add().string_value = v


def _summary(tag: str, **content: Any) -> Summary:
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import metadata
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    data = HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **content)
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name=metadata.PLUGIN_NAME, content=data.SerializeToString()
        )
    )
    return Summary(value=[Summary.Value(tag=tag, metadata=meta)])
