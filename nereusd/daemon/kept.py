"""Keeping the workers of a lost nereusd: ``nereusd --resume`` continues on the EMUs they hold in
memory instead of restarting them from the latest checkpoint (DESIGN.md, "A crashed nereusd").

Within the site's ``liveness.resume_grace_s`` the agents of a crashed nereusd keep their workers
and re-register with the resumed one (:meth:`emu.agent.Agent._rejoin`). The resumed nereusd keeps
them only when their state is exactly where the journal is:

- every device of the world has a kept worker, and the workers agree on one plan over the world,
  each holding the engines that plan puts on it;
- every training model-stage's state holds exactly the steps ``metrics.jsonl`` committed
  (``LogicalState.version``, set by a step's last update: a crash between a step's updates or
  after them but before its metrics row is refused);
- ``metrics.jsonl`` holds steps ``0 … N−1`` once each;
- the job file is the one the lost nereusd ran (``job_sha256`` of its ``nereusd_started``).

Then the workers join a world generation through the new nereusd's rendezvous store, rebuild
their engines around the held state (a transition without ops) and the generation and inference
model-stages get the training weights again; the job continues at step ``N``, with the sampler at
step ``N − 1``'s position plus one step of prompts. Anything else restarts the workers from the
checkpoint, as before, and the reason is journalled.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from nereusd import protocol as P
from nereusd.errors import NereusError, WorkerError
from nereusd.journal import EVENTS_FILE, METRICS_FILE, Event, read_jsonl
from nereusd.plan import Plan, Stage
from nereusd.transition.ops import TransitionDag
from nereusd.transition.runner import TransitionRunner

log = logging.getLogger(__name__)

DESCRIBE_TIMEOUT_S = 30.0
"""A kept worker still busy with its lost nereusd's task (a collective its peers left) does not
answer ``describe`` in this time: the workers restart from the checkpoint."""


class NotKept(NereusError):
    """The kept workers' state is not where the journal is: restart them from the checkpoint."""


@dataclass(frozen=True)
class KeptState:
    """Where a job continues on kept workers: ``plan`` their EMUs form, ``step`` (steps
    committed, the next one to run) and ``position`` (the sampler's, for step ``step``)."""

    plan: Plan
    step: int
    position: int
    elapsed_s: float


def started_job_sha256(run_dir: Path, back: int = 0) -> str | None:
    """The ``job_sha256`` (:func:`nereusd.control.jobs.job_fingerprint`) that the
    ``back``-th latest nereusd of ``run_dir`` journalled when it started (0: the latest); ``None``
    when there is no such nereusd or it did not record one."""
    started = [r for r in read_jsonl(run_dir / EVENTS_FILE) if r.get("event") == Event.NEREUSD_STARTED.value]
    return started[-1 - back].get("job_sha256") if len(started) > back else None


def committed_steps(run_dir: Path, prompts_per_step: int) -> tuple[int, int]:
    """``(N, position)``: the steps ``metrics.jsonl`` committed (rows for steps ``0 … N−1``) and
    the sampler position of step ``N`` (step ``N − 1``'s first prompt plus ``prompts_per_step``;
    0 with no rows).

    Raises:
        NotKept: the rows are not steps ``0 … N−1`` once each, or lack a sample position.
    """
    rows = read_jsonl(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).exists() else []
    steps = [row.get("step") for row in rows]
    if steps != list(range(len(rows))):
        raise NotKept(f"{METRICS_FILE} does not hold steps 0…{len(rows) - 1} once each")
    if not rows:
        return 0, 0
    position = rows[-1].get("sample_position")
    if not isinstance(position, int):
        raise NotKept(f"{METRICS_FILE}: step {len(rows) - 1} has no sample position")
    return len(rows), position + prompts_per_step


def check_described(described: dict[int, dict], world: list[int], steps: int) -> Plan:
    """The plan the kept workers' EMUs form, checked against the journal (module docstring).

    Args:
        described: each world device's ``describe`` result (``plan``, ``model_stages``,
            ``trained_steps``).
        world: the devices the job continues on.
        steps: the steps ``metrics.jsonl`` committed.

    Raises:
        NotKept: naming the first disagreement.
    """
    plans = {json.dumps(r.get("plan"), sort_keys=True) for r in described.values()}
    if len(plans) != 1 or described[world[0]].get("plan") is None:
        raise NotKept(f"the kept workers hold {len(plans)} different plans" if len(plans) != 1
                      else "the kept workers hold no engines")
    plan = Plan.from_dict(described[world[0]]["plan"])
    outside = sorted(set(plan.devices()) - set(world))
    if outside:
        raise NotKept(f"their plan uses devices {outside} that are not in the world {world}")
    for device in world:
        result = described[device]
        expected = sorted(str(ms) for ms, cand in plan.items() if device in cand.devices)
        if sorted(result.get("model_stages", [])) != expected:
            raise NotKept(f"device {device} holds {sorted(result.get('model_stages', []))}, its plan puts {expected} "
                          "there (a transition was under way)")
        for ms, cand in plan.items():
            if ms.stage == Stage.TRAINING and device in cand.devices:
                held = result.get("trained_steps", {}).get(str(ms))
                if held != steps:
                    raise NotKept(f"{ms} on device {device} holds {'part of a step' if held == -1 else f'{held} steps'}; "
                                  f"{METRICS_FILE} committed {steps}")
    return plan


def keep_workers(control, store, driver, world: list[int], run_dir: Path, job_sha256: str) -> KeptState:
    """Continue on the kept workers of ``world`` (module docstring): check their state, re-form
    the world through ``store``, rebuild the engines around the held state, synchronise weights
    and rewind ``driver`` to the committed step. ``job_sha256``: this nereusd's job; the lost
    nereusd's (its ``nereusd_started`` event) must be the same, since the workers' engines were
    built from it.

    Raises:
        NotKept: the job file changed, the state is not where the journal is, or a worker failed
            on the way (then the caller stops them and restarts from the checkpoint).
    """
    start = time.perf_counter()
    lost = started_job_sha256(run_dir, back=1)
    if lost is not None and lost != job_sha256:
        raise NotKept("the job file changed since the kept workers' nereusd started: their engines were built "
                      "from the old one")
    missing = sorted(set(world) - control.kept_workers)
    if missing:
        raise NotKept(f"devices {missing} have no kept worker")
    steps, position = committed_steps(run_dir, driver.cfg.rollout.prompts_per_step)
    try:
        results = control.run({d: P.DescribeArgs() for d in world}, DESCRIBE_TIMEOUT_S)
        plan = check_described({d: r.result for d, r in results.items()}, world, steps)
        reform = P.ReformWorldArgs(generation=store.generation, devices=world, timeout_s=120,
                                   store_host=store.host, store_port=store.port)
        control.run({d: reform for d in world}, 180)
        driver.plan = plan
        TransitionRunner(control, world).run(TransitionDag(plan, plan, (), ()), syncs=driver.sync_args(plan))
        driver.adopt(steps, position)
    except WorkerError as err:
        raise NotKept(f"a kept worker failed: {err}") from None
    return KeptState(plan, steps, position, time.perf_counter() - start)
