"""A transition right after a checkpoint/restart, on a plan whose model-stages sit on different
devices (found by ``scripts/chaos.py``: the job hung in ``transition_finish`` for 600 s).

A restart re-forms the world (``reform_world``, which marks every model-stage for re-attachment)
and then builds the restart plan. The build attaches everything, but the mark stayed; the next
transition's ``transition_finish`` then re-attached the model-stages *this rank held no engine
of* — a different set on each rank when the plan is not uniform — and group creation, a
collective over the world, paired different calls and hung.

Three gloo ranks, each a real :class:`~emu.worker.runtime.WorkerRuntime` driven in the runner's
order (prepare, the ready sets, finish): actor training on devices [0, 1] and the reference
model on [2] after a re-formation, then training extended to [0, 1, 2]. The re-formation itself
(a second rendezvous) is represented by the mark it leaves.
"""

from __future__ import annotations

import torch

from tests.support import REPO
from tests.support.distributed import run_distributed

JOB = f"""
name: restart-transition
algorithm: grpo
devices: 3
models: {{actor: "{REPO / 'examples' / 'models' / 'counting-warmstart'}"}}
rollout: {{prompts_per_step: 3, group_size: 2, max_new_tokens: 8}}
train: {{global_batch: 6, micro_batch: 1}}
"""


def _body(rank, world, job_text, tmp):
    from pathlib import Path

    from emu.state.devmem import DeviceMemory
    from emu.worker.runtime import WorkerRuntime
    from nereusd import protocol as P
    from nereusd.config.resolve import load_and_resolve
    from nereusd.plan import Candidate, ModelStage, Plan
    from nereusd.transition import plan_transition
    from nereusd.transition.runner import prepare_args, ready_ops

    job_path = Path(tmp) / f"job{rank}.yaml"
    job_path.write_text(job_text)
    job = load_and_resolve(job_path)
    ms = ModelStage.parse
    start = Plan({ms("actor/generation"): Candidate(1, 1, 3, (0, 1, 2)),
                  ms("actor/inference"): Candidate(1, 1, 2, (0, 1)),
                  ms("reference/inference"): Candidate(1, 1, 1, (2,)),
                  ms("actor/training"): Candidate(1, 1, 2, (0, 1))})
    target = Plan({**start.candidates, ms("actor/training"): Candidate(1, 1, 3, (0, 1, 2))})
    runtime = WorkerRuntime(rank=rank, device_index=rank, torch_device=torch.device("cpu"),
                            memory=DeviceMemory(rank, 1 << 30), run_dir=tmp, settle_heap_at_build=True)
    runtime._rebuild_all = True   # what reform_world leaves: the restart re-formed the world
    roles = {r.value: P.RoleArgs(spec=rm.spec.to_dict(), path=rm.path, value_head=rm.value_head)
             for r, rm in job.roles.items()}
    train = job.config.train
    runtime.build(P.BuildArgs(plan=start.to_dict(), roles=roles, lr={"actor/training": 1e-4}, seed=0,
                              train=P.EngineSettings(micro_batch=train.micro_batch, weight_decay=train.weight_decay,
                                                     grad_clip=train.grad_clip)))
    import gc

    # the build settled the set-up heap before any engine existed: the engines' objects stay
    # within the collector's reach (frozen ones are not in gc.get_objects()), so a released
    # engine's reference cycles are still collected
    frozen = gc.get_freeze_count()
    collectable = all(any(o is e.module for o in gc.get_objects()) for e in runtime.engines.values())
    dag = plan_transition(start, target, {r: rm.spec for r, rm in job.roles.items()}, devices_per_node=3)
    assert dag.ops, "extending training to a third device moves state"
    runtime.transition_prepare(prepare_args(dag, [0, 1, 2])[rank])
    completed: set[str] = set()
    while len(completed) < len(dag.ops):   # the runner's order: each ready set, the same on every rank
        ready = ready_ops(dag, completed, completed)
        mine = [op for op in ready if rank in dag.op(op).participants]
        if mine:
            runtime.transition_run(P.TransitionRunArgs(ops=mine))
        completed.update(ready)
    finished = runtime.transition_finish(P.TransitionFinishArgs())
    engine = runtime.engines[ms("actor/training")]
    return {"plan": runtime.plan == target, "stages": sorted(str(m) for m in runtime.engines),
            "frozen": frozen, "collectable": collectable,
            "phases": {k: finished[k] for k in ("rebuild_s", "sync_setup_s", "collect_s")},
            "checksum": sum(float(p.double().sum()) for p in engine.params.values())}


def test_a_transition_right_after_a_restart_on_a_non_uniform_plan(tmp_path):
    results = run_distributed(_body, 3, JOB, str(tmp_path), timeout_s=180)
    assert all(r["plan"] for r in results)
    assert all(r["frozen"] > 0 and r["collectable"] for r in results)
    assert all(r["phases"]["rebuild_s"] > 0 and r["phases"]["collect_s"] > 0 for r in results)
    assert results[2]["stages"] == ["actor/generation", "actor/training", "reference/inference"]
    assert len({r["checksum"] for r in results}) == 1, "the new replica got the training parameters"
