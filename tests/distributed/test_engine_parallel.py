"""Every tp×pp×dp layout of 1, 2 and 4 gloo ranks equals one process (emu/engine/stage.py).

One spawn of 4 ranks loops over all layouts (and some permuted device orders); per layout each
member compares its logits-derived outputs, loss metrics, gathered gradients, parameters after
one Adam step and Adam state with a one-process engine it computes itself, and generation
(greedy and seeded sampling) with one-process generation. The parent asserts on the returned
differences, so a failure names the layout.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.distributed import run_distributed
from emu.state.devmem import DeviceMemory
from emu.engine.stage import StageEngine
from emu.engine.canonical import init_full_state
from emu.engine.parallel import build_stage_groups, gather_pp, gather_tp
from nereusd.plan import Candidate, ModelStage, Role, Stage
from tests.support.specs import ENGINE as SPEC

TRAIN = {False: ModelStage(Role.ACTOR, Stage.TRAINING), True: ModelStage(Role.CRITIC, Stage.TRAINING)}
GENERATION = ModelStage(Role.ACTOR, Stage.GENERATION)
TOL = 2e-5
ADAM_EPS = 1e-4
"""Adam's first step is ``lr·g/(|g| + eps)``: with the default eps a gradient of 1e-8 that differs
in the last bits between layouts moves the parameter by up to ``lr``. A larger eps bounds the
step's sensitivity to ``lr/eps`` times the (≈1e-8) gradient difference."""


def layouts(world: int) -> list[Candidate]:
    """All ``tp·pp·dp ∈ {1, 2, 4}`` on devices ``0..n-1``, plus reversed device orders."""
    out = []
    for n in (1, 2, 4):
        for tp, pp in itertools.product((1, 2, 4), repeat=2):
            if n % (tp * pp) == 0 and n <= world:
                out.append(Candidate(tp, pp, n // (tp * pp), tuple(range(n))))
    out += [Candidate(2, 2, 1, (3, 2, 1, 0)), Candidate(2, 1, 2, (2, 0, 3, 1)), Candidate(1, 2, 1, (1, 0))]
    return out


def sequences() -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(11)
    seqs, pls = [], []
    for i in range(6):
        pl, rl = 2 + i % 3, 1 + (i * 5) % 7
        seqs.append(torch.randint(0, 16, (pl + rl,), generator=gen).tolist())
        pls.append(pl)
    return seqs, pls


def per_token_inputs(seqs, pls) -> dict[str, list[list[float]]]:
    gen = torch.Generator().manual_seed(5)
    total = sum(len(s) - p for s, p in zip(seqs, pls))
    rows = [len(s) - p for s, p in zip(seqs, pls)]
    return {
        "weight": [[1.0 / total] * r for r in rows],
        "adv": [torch.randn(r, generator=gen).tolist() for r in rows],
        "returns": [torch.randn(r, generator=gen).tolist() for r in rows],
    }


def policy_loss(outputs, batch):
    w = batch["weight"]
    pg = -(w * batch["adv"] * outputs["logprobs"]).sum()
    entropy = (w * outputs["entropy"]).sum()
    return pg - 0.01 * entropy, {"pg": pg.detach(), "entropy": entropy.detach()}


def critic_loss(outputs, batch):
    err = (outputs["values"] - batch["returns"]) * batch["mask"]
    loss = 0.5 * (batch["weight"] * err * err).sum()
    return loss, {"vf": loss.detach()}


def make_engine(rank, cand, groups, value_head, model_stage=None, trainable=True, spec=SPEC, max_tokens=None):
    return StageEngine(
        model_stage=model_stage or TRAIN[value_head], spec=spec, candidate=cand, rank=rank, groups=groups,
        device=torch.device("cpu"), memory=DeviceMemory(rank, 1 << 30), value_head=value_head,
        trainable=trainable, lr=1e-2, eps=ADAM_EPS, grad_clip=0.5, micro_batch=2,
        max_tokens_per_micro_batch=max_tokens)


def share(items, dp, dp_rank):
    n = len(items)
    return items[dp_rank * n // dp:(dp_rank + 1) * n // dp]


def perturbed_state(spec, value_head: bool) -> dict:
    """The seed-7 initial state with every bias and norm weight moved off its initial 0 or 1, so
    that their sharding shows in the outputs."""
    state = init_full_state(spec, value_head=value_head, seed=7)
    gen = torch.Generator().manual_seed(3)
    for name, tensor in state.items():
        if name.endswith(".bias") or "norm" in name:
            state[name] = tensor + 0.1 * torch.randn(tensor.shape, generator=gen)
    return state


def train_once(rank, cand, groups, value_head, spec=SPEC, perturb=False, max_tokens=None):
    """Forward outputs, metrics, gradients, parameters and Adam state after one step."""
    seqs, pls = sequences()
    per_token = per_token_inputs(seqs, pls)
    d = groups.dp_rank
    eng = make_engine(rank, cand, groups, value_head, spec=spec, max_tokens=max_tokens)
    if perturb:
        eng.load_full_state(perturbed_state(spec, value_head))
    else:
        eng.initialize(seed=7)
    my_seqs, my_pls = share(seqs, cand.dp, d), share(pls, cand.dp, d)
    fwd = eng.values(my_seqs, my_pls) if value_head else eng.logprobs(my_seqs, my_pls)
    scores = eng.scores(my_seqs) if value_head else None
    metrics = eng.train_step(my_seqs, my_pls, {k: share(v, cand.dp, d) for k, v in per_token.items()},
                             critic_loss if value_head else policy_loss)
    grads = gather_pp({n: gather_tp(n, p.grad, spec, groups) for n, p in eng.params.items()},
                      spec, value_head, groups)
    return dict(fwd=fwd, scores=scores, metrics=metrics, grads=grads, state=eng.full_state(),
                opt=eng.optimizer_full_state(), lo=d * len(seqs) // cand.dp)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def compare(case, ref) -> dict[str, float]:
    n = len(case["fwd"]) if case["fwd"] is not None else 0
    diffs = {"metrics": max(abs(case["metrics"][k] - ref["metrics"][k]) for k in ref["metrics"]),
             "grads": max_diff(case["grads"], ref["grads"]), "state": max_diff(case["state"], ref["state"])}
    opt_a = {f"{n}.{k}": v[k] for n, v in case["opt"].items() for k in v}
    opt_b = {f"{n}.{k}": v[k] for n, v in ref["opt"].items() for k in v}
    diffs["adam"] = max_diff(opt_a, opt_b)
    if case["fwd"] is not None:
        mine = [x for row in case["fwd"] for x in row]
        theirs = [x for row in ref["fwd"][case["lo"]:case["lo"] + n] for x in row]
        diffs["forward"] = max(abs(x - y) for x, y in zip(mine, theirs)) if mine else 0.0
        assert len(mine) == len(theirs)
    if case["scores"] is not None:
        diffs["scores"] = max(abs(x - y) for x, y in zip(case["scores"], ref["scores"][case["lo"]:]))
    return diffs


def generate_once(rank, cand, groups, greedy):
    eng = make_engine(rank, cand, groups, False, model_stage=GENERATION, trainable=False)
    eng.initialize(seed=3)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [2, 2], [7, 1, 3], [9]]
    mine = share(prompts, cand.dp, groups.dp_rank)
    return eng.generate(mine, max_new_tokens=6, temperature=0.7, greedy=greedy, stop_ids=(0,), seed=groups.dp_rank)


def all_layouts_rank(rank: int, world: int) -> list[tuple]:
    own = Candidate(1, 1, 1, (rank,))
    own_groups = build_stage_groups(own, rank)
    refs = {vh: train_once(rank, own, own_groups, vh) for vh in (False, True)}
    results = []
    for cand in layouts(world):
        groups = build_stage_groups(cand, rank)
        if groups is None:
            continue
        for vh in (False, True):
            results.append((cand.describe(), vh, compare(train_once(rank, cand, groups, vh), refs[vh])))
        if cand.pp == 1:
            for greedy in (True, False):
                tokens = generate_once(rank, cand, groups, greedy)
                ref = generate_once_reference(rank, cand, own_groups, greedy, groups.dp_rank)
                results.append((cand.describe(), f"generate greedy={greedy}", {"tokens": tokens, "ref": ref,
                                "dp_rank": groups.dp_rank}))
    return results


def generate_once_reference(rank, cand, own_groups, greedy, dp_rank):
    """One-process generation of the prompts replica ``dp_rank`` of ``cand`` handles."""
    own = Candidate(1, 1, 1, (rank,))
    eng = make_engine(rank, own, own_groups, False, model_stage=GENERATION, trainable=False)
    eng.initialize(seed=3)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [2, 2], [7, 1, 3], [9]]
    return eng.generate(share(prompts, cand.dp, dp_rank), max_new_tokens=6, temperature=0.7, greedy=greedy,
                        stop_ids=(0,), seed=dp_rank)


def assert_within_tol(diffs: dict[str, float], label: str) -> None:
    for key, value in diffs.items():
        assert value < TOL, f"{label}: {key} differs by {value:.3g}"


@pytest.mark.slow
def test_every_layout_matches_one_process():
    per_rank = run_distributed(all_layouts_rank, 4)
    seen = set()
    for rank, results in enumerate(per_rank):
        for layout, what, diffs in results:
            seen.add(layout)
            if isinstance(what, str):
                assert diffs["tokens"] == diffs["ref"], f"rank {rank} {layout} {what}: {diffs}"
                assert all(len(r) <= 6 for r in diffs["tokens"])
                continue
            for key, value in diffs.items():
                assert value < TOL, f"rank {rank} {layout} value_head={what}: {key} differs by {value:.3g}"
    assert len(seen) == len(layouts(4)), sorted(seen)


def architectures_rank(rank: int, world: int) -> list[tuple]:
    """Each architecture of :data:`tests.support.specs.ARCHITECTURES` at tp×pp 2×1 and 1×2 (tied
    embeddings: 2×1 only, they are refused at pp > 1) against one process, policy and value head."""
    from tests.support.specs import ARCHITECTURES

    own = Candidate(1, 1, 1, (rank,))
    own_groups = build_stage_groups(own, rank)
    results = []
    for name, spec in ARCHITECTURES.items():
        refs = {vh: train_once(rank, own, own_groups, vh, spec, perturb=True) for vh in (False, True)}
        for cand in (Candidate(2, 1, 1, (0, 1)), Candidate(1, 2, 1, (0, 1))):
            groups = build_stage_groups(cand, rank)
            for vh in (False, True):
                if cand.pp > 1 and spec.tie_word_embeddings and not vh:
                    continue
                case = train_once(rank, cand, groups, vh, spec, perturb=True)
                results.append((name, cand.describe(), vh, compare(case, refs[vh])))
    return results


@pytest.mark.slow
def test_every_architecture_matches_one_process_at_tp2_and_pp2():
    seen = set()
    for rank, results in enumerate(run_distributed(architectures_rank, 2)):
        for name, layout, vh, diffs in results:
            seen.add((name, layout))
            assert_within_tol(diffs, f"rank {rank} {name} {layout} value_head={vh}")
    assert {n for n, _ in seen} == {"llama3", "qwen2-tied", "qwen3"} and len(seen) == 6


def token_budget_rank(rank: int, world: int) -> list[tuple]:
    """Micro-batches packed by a token budget (16 tokens: two or three of the 3-11-token
    sequences per row; 11: one or two) at tp×pp 1×1, 2×1 and 1×2 against one padded process."""
    own = Candidate(1, 1, 1, (rank,))
    own_groups = build_stage_groups(own, rank)
    refs = {vh: train_once(rank, own, own_groups, vh, perturb=True) for vh in (False, True)}
    results = []
    for cand in (own, Candidate(2, 1, 1, (0, 1)), Candidate(1, 2, 1, (0, 1))):
        groups = own_groups if cand is own else build_stage_groups(cand, rank)
        for vh, budget in itertools.product((False, True), (16, 11)):
            case = train_once(rank, cand, groups, vh, perturb=True, max_tokens=budget)
            results.append((f"tp{cand.tp}·pp{cand.pp}", vh, budget, compare(case, refs[vh])))
    return results


@pytest.mark.slow
def test_token_budget_micro_batches_match_padded_ones_at_tp2_and_pp2():
    seen = set()
    for rank, results in enumerate(run_distributed(token_budget_rank, 2)):
        for layout, vh, budget, diffs in results:
            seen.add(layout)
            assert_within_tol(diffs, f"rank {rank} {layout} value_head={vh} budget {budget}")
    assert len(seen) == 3
