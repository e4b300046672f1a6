"""Optional experiment trackers: Weights & Biases and MLflow, beside ``metrics.jsonl``.

A job turns them on in its ``loggers:`` section (:class:`~nereusd.config.job.LoggersConfig`)::

    loggers:
      wandb: {project: rlhf, mode: offline}            # pip install wandb
      mlflow: {tracking_uri: http://mlflow:5000}       # pip install mlflow-skinny (or mlflow)

nereusd's :class:`~nereusd.daemon.observe.Observer` opens one run per tracker when it starts and
logs every number of each ``metrics.jsonl`` line at its step, with the same tags as TensorBoard
(:func:`~nereusd.daemon.observe.scalars`: ``reward_mean``, ``stage_latency_s/generation``,
``train/actor/loss`` …). The job's resolved configuration is the run's config (W&B) or its
parameters (MLflow). The run ends as finished when the job succeeded, else as failed (MLflow
``FAILED``; W&B exit code 1).

- **Resume.** The runs' ids are kept in ``RUN_DIR/loggers.json``: a nereusd resumed on that run
  directory (``nereus-launch resume``) continues the same runs; steps it runs again are logged
  again at their step (W&B keeps the last value, MLflow both).
- **Failures.** A tracker that cannot start (the package missing, a server unreachable, no
  credentials) fails the job before any process starts, naming ``loggers.<name>``. One that
  fails later (its server down mid-run) is logged once and dropped: a tracker never stops a
  training job.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

from nereusd.errors import ConfigError

log = logging.getLogger(__name__)

LOGGERS_FILE = "loggers.json"
"""Run ids of the job's trackers in its run directory (for a resumed nereusd)."""

PACKAGES = {"wandb": ("wandb", "pip install wandb"),
            "mlflow": ("mlflow", "pip install mlflow-skinny, or mlflow")}
"""Tracker name → (module it needs, how to install it)."""

MLFLOW_PARAM_CHARS = 500
"""Longest MLflow parameter value kept (the limit of MLflow 1.x servers; 2.x allows 6,000)."""
MLFLOW_BATCH = (100, 1000)
"""Most parameters and metrics per ``log_batch`` call (MLflow's REST limits)."""


def check_loggers(config, source: str) -> None:
    """Refuse a job whose trackers' packages are not installed here (before anything starts).

    Raises:
        ConfigError: naming ``source`` and ``loggers.<name>``.
    """
    for name, (module, how) in PACKAGES.items():
        if getattr(config, name) is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{source}: loggers.{name}: the {module} package is not installed here ({how})")


def flatten(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted.key, leaf)`` of a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class Tracker(Protocol):
    name: str
    run_id: str

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, ok: bool) -> None: ...


class WandbTracker:
    """One W&B run (``wandb.init``); its files go to ``RUN_DIR/wandb/``."""

    name = "wandb"

    def __init__(self, config, run_dir: Path, job_name: str, job_config: dict[str, Any],
                 run_id: str | None = None) -> None:
        import wandb

        self.run = wandb.init(project=config.project, entity=config.entity, name=config.name or job_name,
                              mode=config.mode, tags=config.tags or None, dir=str(run_dir), config=job_config,
                              id=run_id, resume="allow" if run_id else None,
                              settings=wandb.Settings(silent=True, console="off"))
        self.run_id = self.run.id

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker:
    """One MLflow run through ``MlflowClient`` (no process-global active run)."""

    name = "mlflow"
    KEY = re.compile(r"[^\w\-. :/]")
    """Characters an MLflow metric or parameter key may not hold (replaced by ``_``)."""

    def __init__(self, config, run_dir: Path, job_name: str, job_config: dict[str, Any],
                 run_id: str | None = None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=config.tracking_uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        experiment = config.experiment or job_name
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        run = self.client.create_run(experiment_id, run_name=config.run_name or job_name,
                                     tags={"nereus.run_dir": str(Path(run_dir).resolve())})
        self.run_id = run.info.run_id
        params = [Param(self.KEY.sub("_", k), str(v)[:MLFLOW_PARAM_CHARS]) for k, v in flatten(job_config)]
        for i in range(0, len(params), MLFLOW_BATCH[0]):
            self.client.log_batch(self.run_id, params=params[i:i + MLFLOW_BATCH[0]])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(self.KEY.sub("_", k), v, now_ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), MLFLOW_BATCH[1]):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MLFLOW_BATCH[1]])

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(config, run_dir: str | Path, job_name: str, job_config: dict[str, Any]) -> list[Tracker]:
    """Start (or, with ``RUN_DIR/loggers.json``, resume) a run per configured tracker.

    Args:
        config: the job's :class:`~nereusd.config.job.LoggersConfig`.
        job_config: the job's configuration, logged as the run's config or parameters.

    Raises:
        ConfigError: naming ``loggers.<name>`` when a tracker cannot start (the trackers
            already started are closed as failed).
    """
    run_dir = Path(run_dir)
    ids_path = run_dir / LOGGERS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.exists() else {}
    started: list[Tracker] = []
    for name, cls in TRACKERS.items():
        if getattr(config, name) is None:
            continue
        try:
            started.append(cls(getattr(config, name), run_dir, job_name, job_config, ids.get(name)))
        except Exception as err:  # noqa: BLE001 - whatever the tracker raises, the job must say which one and why
            for tracker in started:
                tracker.close(ok=False)
            raise ConfigError(f"loggers.{name}: cannot start a run: {type(err).__name__}: {str(err)[:300]}") from None
        ids[name] = started[-1].run_id
    if started:
        tmp = ids_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ids))
        os.replace(tmp, ids_path)
    return started
