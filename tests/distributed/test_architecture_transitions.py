"""EMU transitions move the tensors that Qwen2 and Qwen3 add — q/k/v biases (sharded with their
rows, replicated with k/v past ``tp > num_kv_heads``) and q/k norms (replicated) — bit-exactly, with
their Adam state, and a model built on the transitioned holdings computes what the untouched model
computes.

Two gloo ranks walk each architecture of :data:`tests.support.specs.ARCHITECTURES` (the tied one
stays at pp 1) through a cycle of layouts of ``actor/training``: tp 2 → dp 2 → pp 2 → tp 2. After
every transition each holding must equal the canonical slices (``torch.equal``); at the end the
shards of tp 2 are loaded into the engine's model and its logits compared with one process (to
fp32 rounding of the TP reductions, relative to the logits' scale: the canonical tensors are
N(0, 1), so logits are large).
"""

from __future__ import annotations

import pytest
import torch

from emu.engine.model import LlamaModel, TPGroup
from emu.state.devmem import DeviceMemory
from emu.state.executor import TransitionExecutor
from emu.state.primitives import HoldingStore
from emu.state.unit import slots_for
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.shards import value_head_for
from nereusd.transition import plan_transition
from tests.support.distributed import run_distributed
from tests.support.holdings import canonical, check_holdings, fill, logical_for, specs_for
from tests.support.specs import ARCHITECTURES

MS = ModelStage(Role.ACTOR, Stage.TRAINING)
SEED = 13


def cycle(spec) -> list[Plan]:
    tp2, dp2, pp2 = Candidate(2, 1, 1, (0, 1)), Candidate(1, 1, 2, (0, 1)), Candidate(1, 2, 1, (1, 0))
    layouts = [tp2, dp2, tp2] if spec.tie_word_embeddings else [tp2, dp2, pp2, tp2]
    return [Plan({MS: c}) for c in layouts]


def body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out = {}
    for name, spec in ARCHITECTURES.items():
        models = {r: spec for r in Role}
        memory = DeviceMemory(rank, 1 << 30)
        store = HoldingStore(memory)
        plans = cycle(spec)
        cand = plans[0][MS]
        _, p, t = cand.coords_of(rank)
        h = store.allocate((MS, spec, value_head_for(MS.role), slots_for(MS)), cand.layout, (p, t),
                           logical_for(SEED, MS))
        fill(h, SEED)
        store.put(h)
        for current, target in zip(plans, plans[1:]):
            dag = plan_transition(current, target, models, devices_per_node=2)
            ex = TransitionExecutor(dag, rank, store, specs_for(target, spec))
            ex.prepare()
            ex.run()
            ex.close()
            check_holdings(store, target, rank, SEED, f"{name}: {current.describe()} -> {target.describe()}")
        # the tp-2 shards, as a model: same logits as one process on the canonical tensors
        final = plans[-1][MS]
        _, p, t = final.coords_of(rank)
        holding = store.get(MS, final.layout, (p, t))
        tp = TPGroup(2, t, dist.new_group([0, 1]))
        shard = LlamaModel(spec, tp=tp)
        with torch.no_grad():
            for pname, param in shard.named_parameters():
                param.copy_(holding.view(pname, "param"))
        full = LlamaModel(spec)
        with torch.no_grad():
            for pname, param in full.named_parameters():
                param.copy_(canonical(SEED, MS, pname, "param", tuple(param.shape)))
        tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            local = shard(tokens)
            gathered = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(gathered, local.contiguous(), group=tp.group)
            want = full(tokens)
            out[name] = float((torch.cat(gathered, dim=-1) - want).abs().max() / want.abs().max())
    return out


@pytest.mark.slow
def test_biases_and_norms_transition_bit_exactly_and_compute_the_same_function():
    for rank, diffs in enumerate(run_distributed(body, 2, timeout_s=120)):
        assert set(diffs) == set(ARCHITECTURES)
        for name, diff in diffs.items():
            assert diff < 1e-6, f"rank {rank} {name}: logits after the transitions differ by {diff:.3g} (relative)"
