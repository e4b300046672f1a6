"""A plan change that moves no state — only a model-stage's micro-batch (generation waves,
training micro-batches) or recomputation — reaches the live engines: the transition DAG has no
op for it, so ``transition_finish`` must retune the engines it does not rebuild.

One worker runtime in this process (gloo world of one rank), the shipped warm-start model.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from emu.state.devmem import DeviceMemory
from emu.worker.runtime import WorkerRuntime
from nereusd import protocol as P
from nereusd.config.resolve import load_and_resolve
from nereusd.plan import Candidate, ModelStage, Plan
from nereusd.transition import plan_transition

from tests.support import REPO
GEN = ModelStage.parse("actor/generation")
TRAIN = ModelStage.parse("actor/training")


@pytest.fixture
def runtime(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield WorkerRuntime(rank=0, device_index=0, torch_device=torch.device("cpu"),
                            memory=DeviceMemory(0, 1 << 30), run_dir=str(tmp_path))
    finally:
        dist.destroy_process_group()


def test_micro_batch_and_recompute_changes_reach_the_engines(runtime, tmp_path):
    job_path = tmp_path / "job.yaml"
    job_path.write_text(f"""
name: retune
algorithm: grpo
devices: 1
models: {{actor: "{REPO / 'examples' / 'models' / 'counting-warmstart'}"}}
rollout: {{prompts_per_step: 2, group_size: 4, max_new_tokens: 8}}
train: {{global_batch: 8, micro_batch: 4}}
""")
    job = load_and_resolve(job_path)
    roles = {r.value: P.RoleArgs(spec=rm.spec.to_dict(), path=rm.path, value_head=rm.value_head)
             for r, rm in job.roles.items()}
    train = job.config.train
    runtime.build(P.BuildArgs(plan=job.plan.to_dict(), roles=roles, lr={str(TRAIN): 1e-4}, seed=0,
                              train=P.EngineSettings(micro_batch=train.micro_batch, weight_decay=train.weight_decay,
                                                     grad_clip=train.grad_clip)))
    assert runtime.engines[GEN].micro_batch == 4 and runtime.engines[TRAIN].micro_batch == 4
    target = Plan({**job.plan.candidates,
                   GEN: Candidate(1, 1, 1, (0,), micro_batch=2),
                   TRAIN: Candidate(1, 1, 1, (0,), micro_batch=2, recompute=True)})
    dag = plan_transition(job.plan, target, {r: rm.spec for r, rm in job.roles.items()}, devices_per_node=1)
    assert not dag.ops, "a micro-batch change moves no state"
    runtime.transition_prepare(P.TransitionPrepareArgs(dag=dag.to_json()))
    runtime.transition_run(P.TransitionRunArgs(ops=[]))
    runtime.transition_finish(P.TransitionFinishArgs())
    gen, train = runtime.engines[GEN], runtime.engines[TRAIN]
    assert gen.micro_batch == 2 and gen.candidate.micro_batch == 2
    assert train.micro_batch == 2 and train.recompute and train.module.recompute
    assert runtime.plan == target
