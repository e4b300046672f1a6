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
  directory (``nereus-launch resume``) continues the same runs. Steps it runs again are logged
  again at their step, both attempts kept: W&B's x axis is the job's ``step`` (``define_metric``),
  not its own counter, which may only grow.
- **Failures.** A missing package fails the job when its file is loaded, before any process
  starts. A tracker that cannot start (a server unreachable, no credentials) fails the job when
  nereusd starts, before any step, naming ``loggers.<name>``; its client's retries are bounded
  (:data:`MLFLOW_ENV`, W&B's ``init_timeout``) so that this takes at most about a minute. One
  that fails later (its server down mid-run) is logged once and dropped.
- **Never on the control plane's thread.** Steps reach the trackers through a bounded queue and a
  thread of their own (:class:`TrackerFeed`): a slow or hanging server delays nothing nereusd
  does (agents stop their workers after a minute without nereusd); when the queue is full,
  steps are dropped for the trackers (counted and logged), never for ``metrics.jsonl``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import re
import threading
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

MLFLOW_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
"""Bounds on MLflow's HTTP client unless the user set them (its defaults, 7 retries with backoff
and 120 s per attempt, can block for many minutes)."""
WANDB_INIT_TIMEOUT_S = 60.0
TRACKER_QUEUE_STEPS = 1000
"""Steps waiting for the trackers before more are dropped for them."""

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
                              settings=wandb.Settings(silent=True, console="off", init_timeout=WANDB_INIT_TIMEOUT_S))
        self.run_id = self.run.id
        # the job's step is the x axis, not W&B's own (which must only grow): steps run again
        # after a resume are logged again instead of being dropped by W&B as going back
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "step": step})

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker:
    """One MLflow run through ``MlflowClient`` (no process-global active run)."""

    name = "mlflow"
    KEY = re.compile(r"[^\w\-. :/]")
    """Characters an MLflow metric or parameter key may not hold (replaced by ``_``)."""

    def __init__(self, config, run_dir: Path, job_name: str, job_config: dict[str, Any],
                 run_id: str | None = None) -> None:
        for key, value in MLFLOW_ENV.items():
            os.environ.setdefault(key, value)
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
    try:
        ids = json.loads(ids_path.read_text()) if ids_path.exists() else {}
        if not isinstance(ids, dict) or not all(isinstance(v, str) for v in ids.values()):
            raise ValueError("expected an object of tracker names to run ids")
    except (OSError, ValueError) as err:
        raise ConfigError(f"{ids_path}: cannot read the trackers' run ids ({err}); delete it to start new runs") \
            from None
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


class TrackerFeed:
    """The trackers' own thread: :meth:`log` queues a step (never blocks; a full queue drops it
    for the trackers, counted), the thread logs it to every tracker, and a tracker that raises is
    logged once and dropped. :meth:`close` ends the runs after the queued steps.

    Args:
        trackers: started runs (:func:`open_trackers`).
        max_steps: queue bound (:data:`TRACKER_QUEUE_STEPS`).
    """

    def __init__(self, trackers: list[Tracker], max_steps: int = TRACKER_QUEUE_STEPS) -> None:
        self.trackers = list(trackers)
        self.dropped_steps = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_steps)
        self._thread = threading.Thread(target=self._run, name="trackers", daemon=True)
        self._thread.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        try:
            self._queue.put_nowait((step, values))
        except queue.Full:
            self.dropped_steps += 1
            if self.dropped_steps == 1:
                log.warning("loggers: the trackers fall behind; step %s and later ones are dropped for them while "
                            "%d steps wait (metrics.jsonl has every step)", step, self._queue.maxsize)

    def close(self, ok: bool, timeout_s: float = 30.0) -> None:
        """End every run (finished when ``ok``, else failed) once the queued steps are logged;
        waits at most ``timeout_s`` (a hung server must not hold up the job's end)."""
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(("close", ok), timeout=timeout_s)
        except queue.Full:
            log.warning("loggers: the trackers' queue stayed full for %.0f s; their runs are left open", timeout_s)
            return
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("loggers: the trackers did not finish within %.0f s; their runs may stay open", timeout_s)

    def _run(self) -> None:
        while True:
            step, payload = self._queue.get()
            if step == "close":
                for tracker in self.trackers:
                    try:
                        tracker.close(payload)
                    except Exception as err:  # noqa: BLE001 - the job is over; nothing else to stop
                        log.warning("loggers.%s: cannot end its run: %s: %s", tracker.name, type(err).__name__, err)
                return
            for tracker in list(self.trackers):
                try:
                    tracker.log(step, payload)
                except Exception as err:  # noqa: BLE001 - a tracker's outage must not stop the job
                    log.warning("loggers.%s failed at step %s (%s: %s); it logs nothing more for this job",
                                tracker.name, step, type(err).__name__, str(err)[:200])
                    self.trackers.remove(tracker)
