"""The activation formula (:func:`nereusd.cost.memory.micro_batch_activation_bytes`), which the
engine books and the memory model predicts, against what autograd really keeps: every tensor
saved for backward during one training micro-batch of the engine (``saved_tensors_hooks``),
counted once per storage, parameters left out. The formula leaves out a few bytes per read
position (the picked log-probabilities, the gather index): within 1 %."""

from __future__ import annotations

import pytest
import torch

from emu.engine.parallel import build_stage_groups
from emu.engine.stage import StageEngine
from emu.state.devmem import DeviceMemory
from nereusd.cost.memory import micro_batch_activation_bytes
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Role, Stage
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GQA = ModelSpec(vocab_size=300, hidden_size=96, intermediate_size=200, num_layers=2, num_heads=4, num_kv_heads=2,
                explicit_head_dim=32)
"""q (128) ≠ h (96) ≠ f (200), two query heads per kv head: every term of the formula is told apart."""
QWEN3 = ModelSpec(vocab_size=300, hidden_size=96, intermediate_size=200, num_layers=2, num_heads=4, num_kv_heads=2,
                  explicit_head_dim=32, architecture="qwen3")
"""Per-head q/k norms (Qwen3) keep their own inputs, outputs and statistics."""
MHA = ModelSpec(vocab_size=512, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=8)


def saved_bytes(spec: ModelSpec, candidate: Candidate, rank: int, *, batch: int, seq: int, response: int,
                critic: bool = False, max_tokens: int | None = None) -> tuple[int, StageEngine]:
    """Bytes autograd keeps during one ``train_step`` of one micro-batch of ``batch`` sequences
    of ``seq`` tokens on ``rank`` (each storage once; parameters are not activations)."""
    ms = ModelStage(Role.CRITIC if critic else Role.ACTOR, Stage.TRAINING)
    eng = StageEngine(model_stage=ms, spec=spec, candidate=candidate, rank=rank,
                      groups=build_stage_groups(candidate, rank), device=torch.device("cpu"),
                      memory=DeviceMemory(rank, 1 << 34), value_head=critic, trainable=True, lr=1e-3, eps=1e-8,
                      grad_clip=1.0, micro_batch=batch, max_tokens_per_micro_batch=max_tokens)
    eng.initialize(seed=0)
    params = {p.untyped_storage().data_ptr() for p in eng.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    seqs = [[(7 * i + j) % spec.vocab_size for j in range(seq)] for i in range(batch)]
    key = "values" if critic else "logprobs"
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        eng.train_step(seqs, [seq - response] * batch, {}, lambda out, b: ((out[key] * b["mask"]).sum(), {}))
    return sum(seen.values()), eng


def formula(spec: ModelSpec, eng: StageEngine, *, batch: int, seq: int, response: int, packed: bool = False) -> int:
    return micro_batch_activation_bytes(
        spec, tp=eng.groups.tp.size, layers=len(eng.layers), batch=batch, seq=seq, act_bytes=4, train=True,
        first_stage=eng.groups.pp_rank == 0, last_stage=eng.groups.is_last_stage, head_positions=response,
        vocab_head=not eng.value_head, packed=packed)


@pytest.mark.parametrize("spec, batch, seq, response, critic", [
    (GQA, 3, 50, 20, False),
    (GQA, 1, 200, 150, False),
    (MHA, 2, 128, 100, False),
    (GQA, 3, 50, 20, True),
    (QWEN3, 3, 50, 20, False),
])
def test_one_device(spec, batch, seq, response, critic):
    got, eng = saved_bytes(spec, Candidate(1, 1, 1, (0,)), 0, batch=batch, seq=seq, response=response, critic=critic)
    assert formula(spec, eng, batch=batch, seq=seq, response=response) == pytest.approx(got, rel=0.01)


def test_a_packed_row():
    """A packed row (per-segment causal attention) keeps one attention output more per layer
    than a padded batch; the formula at the row's width, packed (what the engine books), holds."""
    seq, batch = 40, 3
    got, eng = saved_bytes(GQA, Candidate(1, 1, 1, (0,)), 0, batch=batch, seq=seq, response=10,
                           max_tokens=batch * seq)
    assert formula(GQA, eng, batch=1, seq=batch * seq, response=batch * 10, packed=True) == pytest.approx(got, rel=0.01)


def _sharded(rank: int, world: int, tp: int, pp: int) -> tuple[int, int]:
    candidate = Candidate(tp, pp, 1, tuple(range(world)))
    got, eng = saved_bytes(GQA, candidate, rank, batch=2, seq=48, response=16)
    return got, formula(GQA, eng, batch=2, seq=48, response=16)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_sharded(tp, pp):
    """TP divides the sharded terms and the logits; each pipeline stage keeps its layers, the first
    the token ids, the last the head."""
    for got, want in run_distributed(_sharded, tp * pp, tp, pp):
        assert want == pytest.approx(got, rel=0.01)


def _pipeline_engine(rank: int, world: int, stage: Stage) -> tuple[StageEngine, list[int]]:
    """A pp-``world`` engine of GQA on this rank, micro-batches of 2, and the list its every
    activation booking is appended to."""
    candidate = Candidate(1, world, 1, tuple(range(world)))
    eng = StageEngine(model_stage=ModelStage(Role.ACTOR, stage), spec=GQA, candidate=candidate, rank=rank,
                      groups=build_stage_groups(candidate, rank), device=torch.device("cpu"),
                      memory=DeviceMemory(rank, 1 << 34), value_head=False, trainable=stage is Stage.TRAINING,
                      lr=1e-3, eps=1e-8, grad_clip=1.0, micro_batch=2)
    eng.initialize(seed=0)
    booked: list[int] = []
    allocate = eng.memory.allocate

    def record(owner, kind, nbytes):
        if kind == "activations":
            booked.append(nbytes)
        return allocate(owner, kind, nbytes)

    eng.memory.allocate = record
    return eng, booked


def _inference_booking(rank: int, world: int) -> tuple[int, int]:
    eng, booked = _pipeline_engine(rank, world, Stage.INFERENCE)
    seqs = [[(7 * i + j) % GQA.vocab_size for j in range(48)] for i in range(8)]   # 4 micro-batches
    eng.logprobs(seqs, [32] * 8)
    want = micro_batch_activation_bytes(GQA, tp=1, layers=len(eng.layers), batch=2, seq=48, act_bytes=4, train=False,
                                        first_stage=rank == 0, last_stage=rank == world - 1, head_positions=16)
    return max(booked), want


def test_a_pipelined_inference_books_one_micro_batch_at_a_time():
    """Inference runs under ``no_grad``: a pipeline stage holds one micro-batch's layer at a time,
    whatever the schedule keeps in flight, as ``stage_memory`` prices it. (The engine booked the
    training in-flight count, twice the priced amount on the first of two stages, and the demo's
    pp-2 inference failed out of memory on a plan priced to fit.)"""
    for got, want in run_distributed(_inference_booking, 2):
        assert got == want


def _training_booking(rank: int, world: int, sequences: int) -> int:
    eng, booked = _pipeline_engine(rank, world, Stage.TRAINING)
    seqs = [[(7 * i + j) % GQA.vocab_size for j in range(48)] for i in range(sequences)]
    eng.train_step(seqs, [32] * sequences, {}, lambda out, b: ((out["logprobs"] * b["mask"]).sum(), {}))
    return max(booked)


@pytest.mark.parametrize("sequences", [8, 2])
def test_the_pipelined_training_peak_is_the_larger_stage(sequences):
    """With pp 2 the memory model's training activations (with the head) are the larger of what
    the first stage books (the most micro-batches in flight: 2 under 1F1B with 4 micro-batches)
    and what the last books (the head); with one micro-batch (GPipe) the last stage, whose head
    is the larger. (It added the head to the first stage's activations: 20 % over at 4
    micro-batches here, more for a large vocabulary.)"""
    from nereusd.cost.memory import stage_memory

    booked = run_distributed(_training_booking, 2, sequences)
    predicted = stage_memory(GQA, ModelStage(Role.ACTOR, Stage.TRAINING), sequences=sequences, prompt_length=32,
                             response_length=16, tp=1, pp=2, dp=1, micro_batch=2, dtype="fp32",
                             device_kind="cpu").components
    assert predicted["activations"] + predicted["logits"] == max(booked)


@pytest.mark.parametrize("stage", [Stage.TRAINING, Stage.INFERENCE])
def test_the_memory_model_prices_packed_rows_as_the_engine_books_them(stage):
    """With a token budget the engine packs sequences into rows and books a packed row (one
    attention output more per layer); ``stage_memory(packed=True)`` at the workload's priced
    micro-batch predicts exactly that. (It priced a padded batch: 1 attention output short.)"""
    from nereusd.cost.memory import stage_memory
    from nereusd.workflow import Workload

    prompt, response, sequences, budget = 30, 10, 6, 120   # 3 sequences of 40 tokens per row
    ms = ModelStage(Role.ACTOR, stage)
    eng = StageEngine(model_stage=ms, spec=GQA, candidate=Candidate(1, 1, 1, (0,)), rank=0,
                      groups=build_stage_groups(Candidate(1, 1, 1, (0,)), 0), device=torch.device("cpu"),
                      memory=DeviceMemory(0, 1 << 34), value_head=False, trainable=stage is Stage.TRAINING,
                      lr=1e-3, eps=1e-8, grad_clip=1.0, micro_batch=1, max_tokens_per_micro_batch=budget)
    eng.initialize(seed=0)
    booked: list[int] = []
    allocate = eng.memory.allocate
    eng.memory.allocate = lambda owner, kind, n: (booked.append(n) if kind == "activations" else None,
                                                  allocate(owner, kind, n))[1]
    seqs = [[(5 * i + j) % GQA.vocab_size for j in range(prompt + response)] for i in range(sequences)]
    if stage is Stage.TRAINING:
        eng.train_step(seqs, [prompt] * sequences, {}, lambda out, b: ((out["logprobs"] * b["mask"]).sum(), {}))
    else:
        eng.logprobs(seqs, [prompt] * sequences)
    wl = Workload(prompt_length=prompt, response_length=response, global_batch=sequences,
                  max_tokens_per_micro_batch=budget)
    priced = wl.priced_micro_batch(stage, 1, sequences)
    assert priced == 3
    kw = dict(sequences=sequences, prompt_length=prompt, response_length=response, tp=1, pp=1, dp=1,
              micro_batch=priced, dtype="fp32", device_kind="cpu")
    packed = stage_memory(GQA, ms, packed=True, **kw).components
    padded = stage_memory(GQA, ms, **kw).components
    assert packed["activations"] + packed["logits"] == max(booked)
    assert padded["activations"] < packed["activations"]
