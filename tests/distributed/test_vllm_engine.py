"""vLLM engines as Nereus runs them (emu.engine.vllm_engine): one process per TP rank, dummy
weights at start, the EMU's weights through shared memory.

- TP 1: greedy responses equal the native decoder's on the same weights; after a weight load the
  engine answers as an engine freshly started from those weights, greedy and with per-request
  seeds at temperature 1.
- Per-request seeds: what vLLM guarantees is that a request's samples depend only on its seed,
  prompt and weights, not on the other requests of the batch — tested by reordering and splitting
  the batch. (Across TP sizes the logits differ by reduction order, so sampled tokens may differ
  where a draw falls between two tokens; greedy responses are compared across TP instead.)
- TP 2: two engine processes in a world of their own, started from two gloo ranks that share
  the rendezvous address, answer as TP 1 (greedy) and identically on both ranks; two such
  replicas started at once on the machine both do.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from emu.engine.generate import SamplingParams, generate
from emu.engine.hf_io import load_pretrained
from emu.engine.model import LlamaModel
from emu.engine.vllm_engine import EngineConfig, VllmEngine, free_port
from nereusd.cost.memory import kv_cache_bytes, vllm_kv_cache_tokens
from tests.support.distributed import run_distributed
from tests.support.e2e import WARMSTART, processes_mentioning
from tests.support.vllm import requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm]

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [1], [3, 3], [9, 8, 7]]
STOP = (2,)


def _config(spec, tp=1, tp_rank=0, addr="127.0.0.1", port=0) -> EngineConfig:
    return EngineConfig(spec=spec, tp=tp, tp_rank=tp_rank, master_addr=addr, master_port=port, max_model_len=64,
                        kv_cache_bytes=kv_cache_bytes(spec, vllm_kv_cache_tokens(8, 64, 32), tp, 1, 4),
                        block_tokens=32, max_num_seqs=8, dtype="float32",
                        device="cpu")


def _native(spec, state, prompts, max_new_tokens=24):
    model = LlamaModel(spec)
    model.load_state_dict(state, strict=False)
    return generate(model, prompts, SamplingParams(max_new_tokens=max_new_tokens, greedy=True, stop_ids=STOP))


def _perturbed(state):
    gen = torch.Generator().manual_seed(5)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def test_tp1_matches_native_and_a_reload_matches_a_fresh_engine(tmp_path):
    spec, state = load_pretrained(WARMSTART)
    other = _perturbed(state)
    seeds = list(range(100, 100 + len(PROMPTS)))
    rendezvous = set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))
    engine = VllmEngine(_config(spec), workdir=tmp_path)
    own = Path(engine._dir)
    try:
        # vLLM's TP-1 rendezvous file is in the engine's own temporary directory, not in /tmp
        assert list(own.glob("vllm_dist_*")) and not (own / "model").exists()
        # the memory model's KV cache is what vLLM allocated: 8 sequences of 64 tokens in blocks of
        # 32, plus the null block
        assert (engine.kv_blocks, engine.block_tokens) == (8 * 2 + 1, 32)
        # one thread as configured, whatever this process runs (torch loads before the engine
        # can set OMP_NUM_THREADS: an engine left at one thread per core oversubscribed the cores)
        assert engine.threads == 1
        engine.load_weights(state.items(), version=1)
        greedy = engine.generate(PROMPTS, max_new_tokens=24, temperature=1.0, greedy=True, stop_ids=STOP,
                                 seeds=seeds)
        assert greedy == _native(spec, state, PROMPTS)
        got = engine.load_weights(other.items(), version=2, bucket_bytes=200_000)   # several buckets
        assert got["bytes"] == sum(t.numel() * 4 for t in other.values()) and engine.weights_version == 2
        reloaded = engine.generate(PROMPTS, max_new_tokens=24, temperature=1.0, greedy=True, stop_ids=STOP,
                                   seeds=seeds)
        sampled = engine.generate(PROMPTS, max_new_tokens=24, temperature=1.0, greedy=False, stop_ids=STOP,
                                  seeds=seeds)
        # the same requests, reordered and split: each request's draws depend on its own seed only
        order = list(reversed(range(len(PROMPTS))))
        split = engine.generate([PROMPTS[i] for i in order[:2]], max_new_tokens=24, temperature=1.0,
                                greedy=False, stop_ids=STOP, seeds=[seeds[i] for i in order[:2]])
        split += engine.generate([PROMPTS[i] for i in order[2:]], max_new_tokens=24, temperature=1.0,
                                 greedy=False, stop_ids=STOP, seeds=[seeds[i] for i in order[2:]])
        assert [split[order.index(i)] for i in range(len(PROMPTS))] == sampled
        assert processes_mentioning(str(tmp_path)), "the engine process is named after its directory"
    finally:
        engine.close()
    assert processes_mentioning(str(tmp_path)) == []
    # nothing the engine wrote is left behind (every start left its rendezvous file in /tmp)
    assert not own.exists() and set(Path(tempfile.gettempdir()).glob("vllm_dist_*")) <= rendezvous
    assert reloaded == _native(spec, other, PROMPTS) and reloaded != greedy
    fresh = VllmEngine(_config(spec), workdir=tmp_path)
    try:
        fresh.load_weights(other.items(), version=1)
        assert fresh.generate(PROMPTS, max_new_tokens=24, temperature=1.0, greedy=True, stop_ids=STOP,
                              seeds=seeds) == reloaded
        assert fresh.generate(PROMPTS, max_new_tokens=24, temperature=1.0, greedy=False, stop_ids=STOP,
                              seeds=seeds) == sampled
    finally:
        fresh.close()


def _tp2(rank, world, workdir):
    """Rank ``r`` is TP rank ``r % 2`` of replica ``r // 2``: the replicas start at once."""
    spec, state = load_pretrained(WARMSTART)
    boxes = [None] * world
    dist.all_gather_object(boxes, ("127.0.0.1", free_port("127.0.0.1")) if rank % 2 == 0 else None)
    addr, port = boxes[rank - rank % 2]
    engine = VllmEngine(_config(spec, tp=2, tp_rank=rank % 2, addr=addr, port=port), workdir=workdir)
    try:
        engine.load_weights(state.items(), version=1)
        return engine.generate(PROMPTS, max_new_tokens=24, temperature=1.0, greedy=True, stop_ids=STOP,
                               seeds=[0] * len(PROMPTS))
    finally:
        engine.close()


def test_tp2_engines_started_at_once_answer_as_tp1(tmp_path):
    """Two TP-2 replicas start at once on one machine, as a plan of generation ``tp2·dp2`` starts
    them: on CPU every TP > 1 engine names its shared-memory segments alike, and the second
    replica's start failed with ``create shm in SHMManager failed. errno: 17`` where the two
    raced (``emu.engine.vllm_engine._cpu_shm_lock``)."""
    spec, state = load_pretrained(WARMSTART)
    answers = run_distributed(_tp2, 4, str(tmp_path), timeout_s=400)
    assert all(a == _native(spec, state, PROMPTS) for a in answers)


def test_a_failed_start_says_why(tmp_path):
    spec, _ = load_pretrained(WARMSTART)
    cfg = _config(spec)
    bad = EngineConfig(**{**cfg.__dict__, "kv_cache_bytes": 1})   # cannot hold one sequence
    from nereusd.errors import NereusError

    with pytest.raises(NereusError, match="vLLM engine start failed"):
        VllmEngine(bad, workdir=tmp_path)


def test_qwen2_with_biases_matches_native(tmp_path):
    """The math example's Qwen2 (q/k/v biases): our canonical HF names load into vLLM's Qwen2."""
    from tests.support import REPO

    spec, state = load_pretrained(REPO / "examples" / "models" / "gsm8k-tiny")
    assert spec.architecture == "qwen2" and "model.layers.0.self_attn.q_proj.bias" in state
    engine = VllmEngine(_config(spec), workdir=tmp_path)
    try:
        engine.load_weights(state.items(), version=1)
        got = engine.generate(PROMPTS, max_new_tokens=24, temperature=1.0, greedy=True, stop_ids=(),
                              seeds=[0] * len(PROMPTS))
        # a dead engine process is reported as such, on every path (the worker rebuilds it)
        engine._proc.kill()
        engine._proc.join(10)
        assert not engine.alive
        from nereusd.errors import NereusError

        with pytest.raises(NereusError, match=r"exited during weight load \(exit code -9\)"):
            engine.load_weights(state.items(), version=2)
        with pytest.raises(NereusError, match=r"exited during generate \(exit code -9\)"):
            engine.generate(PROMPTS, max_new_tokens=4, temperature=1.0, greedy=True, stop_ids=(), seeds=[0] * 6)
    finally:
        engine.close()
    model = LlamaModel(spec)
    model.load_state_dict(state, strict=False)
    assert got == generate(model, PROMPTS, SamplingParams(max_new_tokens=24, greedy=True))
