"""Micro-batches by count and by token budget (emu/engine/batch.py) and packed rows in the model."""

from __future__ import annotations

import pytest
import torch

from emu.engine.batch import PackedBatch, pack_by_tokens
from emu.engine.model import LlamaModel
from emu.engine.parallel import build_stage_groups
from emu.engine.stage import StageEngine
from emu.state.devmem import DeviceMemory
from nereusd.plan import Candidate, ModelStage, Role, Stage
from tests.support.specs import ENGINE as SPEC

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_pack_by_tokens_respects_the_budget_and_keeps_every_sequence_once():
    lengths = [9, 3, 7, 2, 20, 5, 5, 1]
    bins = pack_by_tokens(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1   # 20 > budget: a bin of its own
    assert bins == [[0, 7], [1, 2], [3], [4], [5, 6]]   # first-fit decreasing: 9+1, 3+7, 2, 20 alone, 5+5
    assert pack_by_tokens(lengths, 10) == bins   # deterministic
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        pack_by_tokens(lengths, 0)


def test_a_packed_batch_lays_sequences_end_to_end_with_their_own_positions():
    seqs = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    index = [[1], [0], [2]]
    batch = PackedBatch.build(seqs, index, 2, torch.device("cpu"), {"w": [[1.0], [2.0], [4.0]]}, max_tokens=6)
    assert batch.n_micro == 2 and batch.mb == 1
    assert batch.segments == [[3, 3], [2, 4]]   # row 0 padded to the longest row (6 tokens)
    assert batch.tokens[1].tolist() == [8, 9, 1, 2, 3, 4]
    assert batch.positions.tolist() == [[0, 1, 2, -1, -1, -1], [0, 1, 0, 1, 2, 3]]
    assert batch.index[1].tolist() == [0, 4] and batch.targets[1].tolist() == [9, 4]
    assert batch.targets[0].tolist() == [7, 0] and batch.per_token["mask"][0].tolist() == [1.0, 0.0]
    assert batch.per_token["w"][1].tolist() == [2.0, 4.0]
    assert batch.real_tokens == 9
    assert batch.rows_of(torch.arange(4.0).reshape(2, 2), [1, 1, 1]) == [[0.0], [2.0], [3.0]]
    padded = PackedBatch.build(seqs, index, 2, torch.device("cpu"))
    assert padded.segments is None and padded.tokens.shape == (4, 4)


def test_a_packed_row_computes_what_each_sequence_computes_alone():
    model = LlamaModel(SPEC, seed=0)
    seqs = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    packed = torch.tensor([sum(seqs, [])])
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]])
    out = model(packed, position_ids=positions, segments=[5, 2, 3])
    alone = torch.cat([model(torch.tensor([s])) for s in seqs], dim=1)
    assert torch.allclose(out, alone, atol=1e-5)
    with pytest.raises(ValueError, match="need one row of 10 tokens"):
        model(packed, segments=[5, 2])


def test_token_budget_books_fewer_activation_bytes_on_a_long_tailed_batch():
    """One 60-token sequence among 2-token ones: padded micro-batches of 4 book 4 × 60 tokens;
    a 64-token budget books one row of at most 64 tokens (and Σ len² attention pairs)."""
    ms = ModelStage(Role.ACTOR, Stage.TRAINING)
    cand = Candidate(1, 1, 1, (0,))
    seqs = [[i % 16 for i in range(60)]] + [[1, 2]] * 7
    pls = [1] * 8
    w = [[1.0 / 66] * (len(s) - 1) for s in seqs]
    peaks, states = [], []
    for budget in (None, 64):
        memory = DeviceMemory(0, 1 << 30)
        eng = StageEngine(model_stage=ms, spec=SPEC, candidate=cand, rank=0, groups=build_stage_groups(cand, 0),
                          device=torch.device("cpu"), memory=memory, value_head=False, trainable=True, lr=1e-3,
                          grad_clip=1.0, micro_batch=4, max_tokens_per_micro_batch=budget)
        eng.initialize(seed=0)
        base = memory.in_use_bytes
        eng.train_step(seqs, pls, {"w": w}, lambda out, b: (-(b["w"] * out["logprobs"]).sum(), {}))
        peaks.append(memory.peak_bytes - base)
        states.append(eng.full_state())
    assert peaks[1] < peaks[0] / 2
    assert all(torch.allclose(states[0][n], states[1][n], atol=1e-6) for n in states[0])


def test_scores_refuse_an_empty_sequence_instead_of_reading_its_neighbour():
    ms = ModelStage(Role.REWARD, Stage.INFERENCE)
    cand = Candidate(1, 1, 1, (0,))
    eng = StageEngine(model_stage=ms, spec=SPEC, candidate=cand, rank=0, groups=build_stage_groups(cand, 0),
                      device=torch.device("cpu"), memory=DeviceMemory(0, 1 << 30), value_head=True, trainable=False,
                      lr=0.0, grad_clip=None, micro_batch=2, max_tokens_per_micro_batch=5)
    eng.initialize(seed=0)
    with pytest.raises(ValueError, match="scores of an empty sequence \\(sequence 2\\)"):
        eng.scores([[3, 4, 5], [1, 2], []])
    packed = eng.scores([[3, 4, 5], [1, 2]])
    eng.max_tokens_per_micro_batch = None
    assert packed == pytest.approx(eng.scores([[3, 4, 5], [1, 2]]), abs=1e-6)


def test_the_head_reads_only_the_positions_its_micro_batch_has():
    """Micro-batches of 2 where one sequence has 6 response tokens and the rest 1: the second
    micro-batch's head gathers 1 column, not the call's 6, and logprobs and a training step equal
    those at micro-batch 1 (no padding at all)."""
    ms = ModelStage(Role.ACTOR, Stage.TRAINING)
    cand = Candidate(1, 1, 1, (0,))
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8], [3, 4], [5, 6, 7], [9, 1]]
    pls = [2, 1, 2, 1]
    index = [list(range(p - 1, len(s) - 1)) for s, p in zip(seqs, pls)]
    batch = PackedBatch.build(seqs, index, 2, torch.device("cpu"))
    assert batch.index.shape[1] == 6 and [batch.head_width(i) for i in range(2)] == [6, 1]
    w = [[0.1] * len(ix) for ix in index]
    logprobs, states, widths = [], [], []
    for mb in (2, 1):
        eng = StageEngine(model_stage=ms, spec=SPEC, candidate=cand, rank=0, groups=build_stage_groups(cand, 0),
                          device=torch.device("cpu"), memory=DeviceMemory(0, 1 << 30), value_head=False,
                          trainable=True, lr=1e-3, grad_clip=1.0, micro_batch=mb)
        eng.initialize(seed=0)
        head = eng._head

        def spy(out, b, i, entropy, head=head, mb=mb):
            got = head(out, b, i, entropy)
            widths.append((mb, b.index.shape[1], got["logprobs"].shape[1]))
            return got
        eng._head = spy
        logprobs.append(eng.logprobs(seqs, pls))
        eng.train_step(seqs, pls, {"w": w}, lambda out, b: (-(b["w"] * out["logprobs"]).sum(), {}))
        states.append(eng.full_state())
    assert [len(r) for r in logprobs[0]] == [6, 1, 1, 1]
    assert all(a == pytest.approx(b, abs=1e-6) for a, b in zip(*logprobs))
    assert all(torch.allclose(states[0][n], states[1][n], atol=1e-5) for n in states[0])   # Adam's step: ~2e-6
    # (micro_batch, call width, head width) of every head call: logprobs, then the training step
    assert widths == [(2, 6, 6), (2, 6, 1)] * 2 + [(1, 6, 6), (1, 6, 1), (1, 6, 1), (1, 6, 1)] * 2
