"""One-process tests of the engine: validation, memory accounting, generation (emu/*)."""

from __future__ import annotations

import pytest
import torch

from emu.state.devmem import DeviceMemory
from nereusd.cost.memory import micro_batch_activation_bytes, prefill_activation_bytes, stage_memory
from emu.engine.stage import StageEngine
from emu.engine.generate import SamplingParams, generate, kv_cache_shape
from emu.engine.model import KVCache, LlamaModel, init_full_state
from emu.engine.parallel import build_stage_groups
from nereusd.shards import check_layout
from nereusd.errors import DeviceOutOfMemory, PlanError
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Role, Stage
from tests.support.specs import ENGINE as SPEC

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ACTOR_TRAIN = ModelStage(Role.ACTOR, Stage.TRAINING)
ACTOR_GEN = ModelStage(Role.ACTOR, Stage.GENERATION)


def engine(memory, *, trainable=True, model_stage=ACTOR_TRAIN, micro_batch=2, value_head=False, recompute=False,
           eps=1e-8):
    cand = Candidate(1, 1, 1, (0,))
    return StageEngine(model_stage=model_stage, spec=SPEC, candidate=cand, rank=0,
                       groups=build_stage_groups(cand, 0), device=torch.device("cpu"), memory=memory,
                       value_head=value_head, trainable=trainable, lr=1e-3, eps=eps, grad_clip=1.0,
                       micro_batch=micro_batch, recompute=recompute)


def cand(tp, pp, dp=1):
    return Candidate(tp, pp, dp, tuple(range(tp * pp * dp)))


@pytest.mark.parametrize("candidate, generation, message", [
    (cand(8, 1), False, r"tp=8 does not divide model num_heads=4"),
    (cand(1, 8), False, r"pp=8 does not divide model num_layers=4"),
    (cand(1, 3), False, r"pp=3 does not divide model num_layers=4"),
    (cand(1, 2), True, r"PP is folded into DP for generation"),
])
def test_plan_errors_name_the_degree_and_the_dimension(candidate, generation, message):
    with pytest.raises(PlanError, match=message):
        check_layout(SPEC, candidate.layout, generation=generation)


def test_plan_errors_for_vocab_and_kv_heads():
    odd_vocab = ModelSpec(vocab_size=15, hidden_size=64, intermediate_size=128, num_layers=4,
                          num_heads=4, num_kv_heads=2)
    with pytest.raises(PlanError, match="tp=2 does not divide model vocab_size=15"):
        check_layout(odd_vocab, cand(2, 1).layout)
    three_kv = ModelSpec(vocab_size=16, hidden_size=96, intermediate_size=128, num_layers=4,
                         num_heads=6, num_kv_heads=3)
    with pytest.raises(PlanError, match="tp=2 and num_kv_heads=3"):
        check_layout(three_kv, cand(2, 1).layout)
    check_layout(SPEC, cand(4, 1).layout)  # tp > kv heads: replicated kv, allowed
    with pytest.raises(PlanError, match="generation needs pp=1"):
        StageEngine(model_stage=ACTOR_GEN, spec=SPEC, candidate=cand(1, 2), rank=0, groups=None,
                    device=torch.device("cpu"), memory=DeviceMemory(0, 1 << 30), value_head=False,
                    trainable=False, lr=0.0, grad_clip=None, micro_batch=1)


def test_device_memory_books_frees_and_tracks_peak():
    mem = DeviceMemory(3, 1000)
    mem.allocate("actor/training", "parameters", 600)
    mem.allocate("critic/training", "activations", 300)
    assert mem.in_use_bytes == 900 and mem.by_model_stage() == {"actor/training": 600, "critic/training": 300}
    with pytest.raises(DeviceOutOfMemory, match=r"out of memory on device 3 in critic/training for kv_cache: "
                                                r"wanted 200 bytes with 900 bytes in use, capacity 1000 bytes"):
        mem.allocate("critic/training", "kv_cache", 200)
    assert mem.in_use_bytes == 900
    assert mem.free("critic/training", "activations") == 300
    assert mem.peak_bytes == 900 and mem.in_use_bytes == 600
    mem.reset_peak()
    assert mem.peak_bytes == 600 and mem.cuda_peak_bytes() is None


def test_device_memory_books_the_workspace_from_the_start():
    """The workers book the memory model's workspace before anything else, so booked and
    predicted peaks count the same things; it is never freed and belongs to no model-stage."""
    mem = DeviceMemory(0, 1000, workspace_bytes=400)
    assert mem.in_use_bytes == mem.peak_bytes == 400 and mem.by_model_stage() == {}
    with pytest.raises(DeviceOutOfMemory, match="wanted 700 bytes with 400 bytes in use"):
        mem.allocate("actor/training", "parameters", 700)
    mem.allocate("actor/training", "parameters", 600)
    mem.free("actor/training", "parameters")
    mem.reset_peak()
    assert mem.in_use_bytes == mem.peak_bytes == 400
    small = DeviceMemory(0, 300, workspace_bytes=400)   # the first allocation says why
    with pytest.raises(DeviceOutOfMemory, match="wanted 1 bytes with 400 bytes in use, capacity 300 bytes"):
        small.allocate("actor/training", "parameters", 1)


def test_engine_books_parameters_gradients_and_adam_state():
    mem = DeviceMemory(0, 1 << 30)
    eng = engine(mem)
    p = SPEC.num_parameters() * 4
    assert eng.parameter_bytes() == p
    assert mem.entries() == {("actor/training", "parameters"): p, ("actor/training", "gradients"): p,
                             ("actor/training", "optimizer"): 2 * p}
    with pytest.raises(DeviceOutOfMemory, match=r"in actor/training for gradients: wanted"):
        engine(DeviceMemory(0, p + 10))
    assert engine(DeviceMemory(0, p + 10), trainable=False).parameter_bytes() == p


def test_an_idle_training_engine_holds_what_the_memory_model_calls_resident():
    """Between steps a training engine keeps its parameters, gradients and Adam state: the memory
    model's ``resident_bytes``, which the planner adds on every device the model-stage shares.
    (Gradients were once left out of it, and a plan measured 55.2 MB per device where 52.8 MB
    was predicted: bench_adaptive, 2026-12-03.)"""
    mem = DeviceMemory(0, 1 << 30)
    eng = engine(mem)
    eng.initialize(seed=0)
    eng.train_step([[1, 2, 3, 4]] * 2, [2, 2], {}, lambda out, b: ((out["logprobs"] * b["mask"]).sum(), {}))
    predicted = stage_memory(SPEC, ACTOR_TRAIN, sequences=2, prompt_length=2, response_length=2, tp=1, pp=1, dp=1,
                             micro_batch=2, dtype="fp32", device_kind="cpu")
    assert mem.by_model_stage() == {"actor/training": predicted.resident_bytes}


def test_too_large_micro_batch_fails_before_any_work():
    p = SPEC.num_parameters() * 4
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8]] * 8
    act = micro_batch_activation_bytes(SPEC, tp=1, layers=4, batch=8, seq=8, act_bytes=4, train=True,
                                       head_positions=6)
    mem = DeviceMemory(0, 4 * p + act - 1)
    eng = engine(mem, micro_batch=8)
    eng.initialize(seed=0)
    before = eng.full_state()
    calls = []

    def loss_fn(outputs, batch):
        calls.append(1)
        return (outputs["logprobs"] * batch["mask"]).sum(), {}

    with pytest.raises(DeviceOutOfMemory, match=rf"in actor/training for activations: wanted {act} bytes"):
        eng.train_step(seqs, [2] * 8, {}, loss_fn)
    assert not calls and mem.in_use_bytes == 4 * p
    assert all(torch.equal(before[n], t) for n, t in eng.full_state().items())
    eng.micro_batch = 1  # smaller micro-batches fit: the urgent path's knob
    eng.train_step(seqs, [2] * 8, {}, loss_fn)
    assert len(calls) == 8 and mem.in_use_bytes == 4 * p


def test_recompute_gives_the_same_step_with_fewer_activation_bytes():
    seqs, pls = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 1, 2, 3]], [2, 1, 3]
    w = [[0.25] * 3, [0.25] * 2, [0.25]]

    def loss_fn(outputs, batch):
        return -(batch["w"] * outputs["logprobs"]).sum(), {}

    states = []
    for recompute in (False, True):
        eng = engine(DeviceMemory(0, 1 << 30), recompute=recompute)
        eng.initialize(seed=1)
        eng.train_step(seqs, pls, {"w": w}, loss_fn)
        states.append(eng.full_state())
    assert all(torch.allclose(states[0][n], states[1][n], atol=1e-6) for n in states[0])
    kw = dict(tp=1, layers=4, batch=2, seq=512, act_bytes=4, train=True, head_positions=256)
    assert micro_batch_activation_bytes(SPEC, recompute=True, **kw) < micro_batch_activation_bytes(SPEC, **kw) / 2


def test_engine_step_equals_plain_pytorch():
    """The one-process engine is ordinary autograd + torch.optim.Adam on the plain model."""
    seqs, pls = [[1, 2, 3, 4, 5], [6, 7, 8]], [2, 1]
    model = LlamaModel(SPEC, seed=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)  # see ADAM_EPS in test_engine_parallel
    loss = 0.0
    for seq, pl in zip(seqs, pls):
        logp = torch.log_softmax(model(torch.tensor([seq]))[0], -1)
        loss = loss - sum(logp[t - 1, seq[t]] for t in range(pl, len(seq))) / 5
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    eng = engine(DeviceMemory(0, 1 << 30), micro_batch=1, eps=1e-4)
    eng.initialize(seed=4)
    metrics = eng.train_step(seqs, pls, {"w": [[0.2] * 3, [0.2] * 2]},
                             lambda o, b: (-(b["w"] * o["logprobs"]).sum(), {}))
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    state = eng.full_state()
    assert all(torch.allclose(state[n], t, atol=1e-6) for n, t in model.state_dict().items())


def _greedy_by_recomputation(model, prompt, max_new, eos):
    seq = list(prompt)
    while len(seq) - len(prompt) < max_new:
        nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
        seq.append(nxt)
        if nxt == eos:
            break
    return seq[len(prompt):]


def test_kv_cache_generation_equals_full_recomputation():
    model = LlamaModel(SPEC, seed=9)
    prompts = [[3, 1, 4, 1, 5], [9], [2, 6], [5, 3, 5, 8]]
    with torch.no_grad():
        got = generate(model, prompts, SamplingParams(max_new_tokens=8, greedy=True, stop_ids=(7,)))
        want = [_greedy_by_recomputation(model, p, 8, 7) for p in prompts]
    assert got == want
    assert any(r and r[-1] == 7 for r in got) or all(len(r) == 8 for r in got)


def test_a_prefill_runs_the_head_at_the_last_position_only():
    """The native decoder's prefill computes logits ``[B, 1, V]`` (what it samples from), equal
    to the full forward's last position; the engine books, and the memory model predicts, a
    head that does not grow with the prompt."""
    model = LlamaModel(SPEC, seed=4)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])
    with torch.no_grad():
        full, last = model(tokens), model(tokens, last_position_only=True)
    assert last.shape == (2, 1, SPEC.vocab_size)
    torch.testing.assert_close(last, full[:, -1:])
    heads = [prefill_activation_bytes(SPEC, tp=1, layers=SPEC.num_layers, batch=4, prompt=p, act_bytes=4)[1]
             for p in (8, 32)]
    assert heads[0] == heads[1]
    # at tp > 1 sampling gathers the whole vocabulary: parts, their concatenation, probabilities
    norm = 4 * (3 * SPEC.hidden_size + 1) * 4
    tp2 = prefill_activation_bytes(SPEC, tp=2, layers=SPEC.num_layers, batch=4, prompt=8, act_bytes=4)[1]
    assert tp2 - norm == 4 * (SPEC.vocab_size // 2 + 3 * SPEC.vocab_size) * 4
    assert heads[0] - norm == 4 * 3 * SPEC.vocab_size * 4
    bodies = [prefill_activation_bytes(SPEC, tp=1, layers=SPEC.num_layers, batch=4, prompt=p, act_bytes=4)[0]
              for p in (8, 32)]
    assert bodies[1] > 3 * bodies[0]
    mem = DeviceMemory(0, 1 << 30)
    eng = engine(mem, trainable=False, model_stage=ACTOR_GEN, micro_batch=4)
    eng.initialize(seed=2)
    prompts = [[1] * 20, [2] * 20, [3] * 20]
    eng.generate(prompts, max_new_tokens=4, greedy=True)
    kv = KVCache.nbytes_for(*kv_cache_shape(eng.module, 3, 24))
    assert mem.peak_bytes == eng.parameter_bytes() + kv + sum(
        prefill_activation_bytes(SPEC, tp=1, layers=SPEC.num_layers, batch=3, prompt=20, act_bytes=4))
    est = stage_memory(SPEC, ACTOR_GEN, sequences=3, prompt_length=20, response_length=4, tp=1, pp=1, dp=1,
                       micro_batch=4, dtype="fp32", device_kind="cpu")
    assert est.components["logits"] == heads[0] * 3 // 4 and est.components["kv_cache"] == kv


def test_sampling_is_seeded_and_engine_books_the_kv_cache():
    mem = DeviceMemory(0, 1 << 30)
    eng = engine(mem, trainable=False, model_stage=ACTOR_GEN)
    eng.initialize(seed=2)
    kw = dict(max_new_tokens=5, temperature=1.5, stop_ids=(), seed=123)
    a, b = eng.generate([[1, 2], [3]], **kw), eng.generate([[1, 2], [3]], **kw)
    assert a == b and all(len(r) == 5 for r in a)
    assert eng.generate([[1, 2], [3]], **{**kw, "seed": 124}) != a
    assert mem.in_use_bytes == eng.parameter_bytes() and mem.peak_bytes > eng.parameter_bytes()
    small = DeviceMemory(0, eng.parameter_bytes() + 100)
    tight = engine(small, trainable=False, model_stage=ACTOR_GEN)
    with pytest.raises(DeviceOutOfMemory, match="for kv_cache"):
        tight.generate([[1, 2]], max_new_tokens=4, greedy=True)
    with pytest.raises(ValueError, match="exceeds the model's max_position 64"):
        eng.generate([[1] * 60], max_new_tokens=5, greedy=True)


def test_full_state_round_trip_and_optimizer_state():
    eng = engine(DeviceMemory(0, 1 << 30))
    full = init_full_state(SPEC, seed=5)
    eng.load_full_state(full)
    assert all(torch.equal(eng.full_state()[n], t) for n, t in full.items())
    assert eng.optimizer_full_state() == {}
    eng.train_step([[1, 2, 3]], [1], {}, lambda o, b: ((o["logprobs"] * b["mask"]).sum(), {}))
    opt = eng.optimizer_full_state()
    assert set(opt) == set(full) and float(opt["lm_head.weight"]["step"]) == 1.0
    other = engine(DeviceMemory(0, 1 << 30))
    other.load_full_state(eng.full_state())
    other.load_optimizer_full_state(opt)
    again = other.optimizer_full_state()
    assert all(torch.equal(again[n][k], opt[n][k]) for n in opt for k in opt[n])


@pytest.mark.gpu
def test_cuda_engine_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seqs, pls = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 1, 2, 3]], [2, 1, 3]
    per_token = {"w": [[0.25] * 3, [0.25] * 2, [0.25]]}

    def loss_fn(outputs, batch):
        return -(batch["w"] * outputs["logprobs"]).sum() - 0.01 * (batch["w"] * outputs["entropy"]).sum(), {}

    results = []
    for device in ("cpu", "cuda"):
        cand = Candidate(1, 1, 1, (0,))
        mem = DeviceMemory(0, 1 << 30, torch_device=torch.device(device))
        eng = StageEngine(model_stage=ACTOR_TRAIN, spec=SPEC, candidate=cand, rank=0,
                          groups=build_stage_groups(cand, 0), device=torch.device(device), memory=mem,
                          value_head=False, trainable=True, lr=1e-3, eps=1e-4, grad_clip=1.0, micro_batch=2)
        eng.initialize(seed=3)
        logprobs = eng.logprobs(seqs, pls)
        metrics = eng.train_step(seqs, pls, per_token, loss_fn)
        tokens = eng.generate([[1, 2], [3]], max_new_tokens=6, greedy=True, stop_ids=(0,))
        results.append((logprobs, metrics, {n: t.cpu() for n, t in eng.full_state().items()}, tokens))
        if device == "cuda":
            assert metrics["cuda_peak_bytes"] > 0 and mem.cuda_peak_bytes() > 0
    (lp_c, m_c, s_c, t_c), (lp_g, m_g, s_g, t_g) = results
    assert t_c == t_g
    assert max(abs(a - b) for r1, r2 in zip(lp_c, lp_g) for a, b in zip(r1, r2)) < 1e-4
    assert m_c["loss"] == pytest.approx(m_g["loss"], rel=1e-4)
    assert all(torch.allclose(s_c[n], s_g[n], atol=1e-4) for n in s_c)
