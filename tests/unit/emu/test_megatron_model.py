"""megatron-core's ``GPTModel`` built by :mod:`emu.engine.megatron_model`, run on CPU against the
native engine: the same logits and the same gradients, mapped back through
:mod:`emu.engine.megatron_layout`.

- tp = pp = 1 for Llama, Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (q/k norms), and a
  Llama-3 RoPE scaling as Megatron hard-codes it; one that differs is refused, naming the field.
- A replica gathers the canonical tensors it was loaded with, bit-exact (tp 1, tp 2, pp 2).
- tp = 2 on two gloo ranks with explicit process groups (``ProcessGroupCollection``;
  ``parallel_state`` is never initialised) and a vocab-parallel loss, on the local layer spec,
  which runs without sequence parallelism: its norm without Apex is torch's, which refuses it
  (Transformer Engine, with sequence parallelism, is for the GPU check). Qwen3's q/k-norm
  gradients are summed over TP as Megatron's ``finalize_model_grads`` does.

**Test-only patches.** megatron-core 0.16.1's ``GPTModel`` does not run on CPU as shipped: it
places tensors with ``torch.cuda.current_device()`` (rotary embedding, the attention scratch
buffer) and forks a CUDA RNG state around attention. :func:`_cpu_patches` makes
``current_device`` return ``"cpu"``, ``torch.cuda.synchronize`` a no-op and the RNG tracker's
``fork`` a null context (dropout is 0, so no random number is drawn). Nothing in
``emu/`` patches torch: on a GPU the same code runs unpatched, and the GPU check compares it there.
Skipped without megatron-core, unless ``NEREUS_REQUIRE_MEGATRON=1`` (set by ``.ci/run``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

from emu.engine.canonical import init_full_state
from emu.engine.model import LlamaModel
from nereusd.errors import ConfigError
from nereusd.models import ModelSpec
from tests.support.distributed import run_distributed
from tests.support.megatron import requires_megatron
from tests.support.specs import ARCHITECTURES

pytestmark = requires_megatron

LLAMA = ModelSpec(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position=64)
SPECS = {
    "llama": LLAMA,
    "llama3-megatron-rope": dataclasses.replace(LLAMA, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0),
    "qwen2-tied": ARCHITECTURES["qwen2-tied"],
    "qwen3": ARCHITECTURES["qwen3"],
}


def _cpu_patches() -> None:
    """See the module docstring: what megatron-core needs to run on CPU, in the test process only."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def _native(spec, full):
    model = LlamaModel(spec)
    model.load_state_dict({k: v for k, v in full.items() if k in model.state_dict()}, strict=True)
    return model


def _parity_body(rank, world, names):
    """Megatron at tp = ``world`` (local spec: no sequence parallelism) against the native
    one-process model: max |Δ| of logits and of every canonical gradient, per architecture, and
    whether the replica gathers the tensors it was loaded with."""
    import torch.distributed as dist

    from emu.engine.megatron_layout import from_megatron
    from emu.engine.megatron_model import (StageGroups, allreduce_tp_replicated_grads, build_gpt_model,
                                           gather_canonical, load_canonical, logits, megatron_tensors,
                                           stage_process_groups)

    _cpu_patches()
    tp, world_group = world, dist.group.WORLD
    own = dist.new_group([rank], use_local_synchronization=True)
    out = {}
    for name in names:
        spec = SPECS[name]
        full = init_full_state(spec, seed=5)
        with torch.no_grad():   # norms off 1 and biases off 0, so that their use shows
            for k, v in full.items():
                if "norm" in k or k.endswith(".bias"):
                    v.add_(0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(len(k))))
        groups = StageGroups(tp=world_group, pp=own, dp=own, embd=own)
        model = build_gpt_model(spec, tp, 1, 0, stage_process_groups(groups), te=False)
        load_canonical(model, full, spec, tp, 1, rank, 0)
        back = gather_canonical(model, spec, tp, 1, groups)   # the weight-sync read path
        gathered_ok = sorted(back) == sorted(full) and all(torch.equal(back[k], full[k]) for k in full)
        ids = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        weights = torch.randn(2, 12, spec.vocab_size, generator=torch.Generator().manual_seed(2))
        local = logits(model, ids, spec.vocab_size)                 # [2, 12, V_padded / tp]
        cols = local.shape[-1]
        padded = torch.nn.functional.pad(weights, (0, cols * tp - spec.vocab_size))
        (local * padded[..., rank * cols:(rank + 1) * cols]).sum().backward()   # Σ over ranks = the full loss
        allreduce_tp_replicated_grads(model, world_group)
        gathered = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(gathered, local.detach().contiguous())
        got = torch.cat(gathered, dim=-1)[..., :spec.vocab_size]
        shards = [None] * tp
        dist.all_gather_object(shards, megatron_tensors(model, grads=True))
        grads = from_megatron({(t, 0): shards[t] for t in range(tp)}, spec, tp, 1)
        native = _native(spec, full)
        want = native(ids)
        (want * weights).sum().backward()
        out[name] = {"logits": (got - want.detach()).abs().max().item(),
                     "scale": want.detach().abs().max().item(),
                     "grads": max((grads[k] - p.grad).abs().max().item() for k, p in native.named_parameters()),
                     "grad_scale": max(p.grad.abs().max().item() for p in native.parameters()),
                     "grad_names": sorted(grads) == sorted(k for k, _ in native.named_parameters()),
                     "gathered": gathered_ok}
    return out


def _check(report):
    assert report, "no architecture ran"
    for name, r in report.items():
        assert r["grad_names"], name
        assert r["gathered"], f"{name}: the replica's gathered canonical tensors differ from those loaded"
        assert r["logits"] < 1e-5 * max(1.0, r["scale"]), (name, r)
        assert r["grads"] < 1e-5 * max(1.0, r["grad_scale"]), (name, r)   # fp32, summed in another order


def test_gptmodel_equals_the_native_engine_at_tp1():
    (report,) = run_distributed(_parity_body, 1, sorted(SPECS), timeout_s=240)
    _check(report)


def test_gptmodel_equals_the_native_engine_at_tp2():
    for report in run_distributed(_parity_body, 2, ["llama", "qwen3"], timeout_s=240):
        _check(report)


def _gather_body(rank, world, tp, pp, name):
    """Load canonical tensors into this rank's shard of a ``tp × pp`` layout, then gather the
    replica's canonical tensors back: the names and bits that went in."""
    import torch.distributed as dist

    from emu.engine.megatron_model import StageGroups, build_gpt_model, gather_canonical, load_canonical, \
        stage_process_groups

    _cpu_patches()
    spec = SPECS[name]
    world_group, own = dist.group.WORLD, dist.new_group([rank], use_local_synchronization=True)
    tp_rank, pp_rank = (rank, 0) if tp > 1 else (0, rank)
    groups = StageGroups(tp=world_group if tp > 1 else own, pp=world_group if pp > 1 else own, dp=own,
                         embd=world_group if pp > 1 else own)
    model = build_gpt_model(spec, tp, pp, pp_rank, stage_process_groups(groups), te=False)
    full = init_full_state(spec, seed=9)
    load_canonical(model, full, spec, tp, pp, tp_rank, pp_rank)
    back = gather_canonical(model, spec, tp, pp, groups)
    return sorted(back) == sorted(full) and all(torch.equal(back[k], full[k]) for k in full)


def test_a_replica_gathers_the_canonical_tensors_it_was_loaded_with_at_pp2():
    """The weight-sync and transition read path at pp 2 (Llama); at tp 1 and 2 the parity tests
    check it too."""
    assert run_distributed(_gather_body, 2, 1, 2, "llama", timeout_s=240) == [True, True]


def _sharded_body(rank, world, tp, pp, name):
    """This rank's ``GPTModel`` shard of a ``tp × pp`` layout (``parallel_state`` set up as a
    Megatron job does), loaded through our mapping; Megatron's own ``sharded_state_dict`` of it,
    factories applied: per tensor its checkpoint key, global shape, offset and local data."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.process_groups_config import ProcessGroupCollection

    from emu.engine.megatron_model import build_gpt_model, load_canonical

    _cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    spec = SPECS[name]
    model = build_gpt_model(spec, tp, pp, p, ProcessGroupCollection.use_mpu_process_groups(), te=False)
    load_canonical(model, init_full_state(spec, seed=11), spec, tp, pp, t, p)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    out = []
    for v in nested_values(sharded):   # SwiGLU's factory leaves two tensors (gate, up) under one key
        if isinstance(v, ShardedTensor):
            assert v.flattened_range is None
            out.append((v.key, tuple(v.global_shape), tuple(v.global_offset), v.prepend_axis_num,
                        v.data.detach().clone()))
    return out


def test_megatrons_sharded_state_dicts_at_tp2_pp2_reassemble_into_the_canonical_tensors():
    """Megatron's checkpoint view of four shards (tp 2 × pp 2) — its keys, global shapes and
    offsets, written by Megatron, not by us — put together equals what our mapping gives for
    the whole model at tp 1 / pp 1 (Transformer-Engine names, which Megatron's checkpoints use;
    per layer, stacked along the layer axis; the vocabulary padded for tp 2, the padding zero)."""
    from emu.engine.megatron_layout import padded_vocab, to_megatron

    spec = SPECS["llama"]
    globals_: dict[str, torch.Tensor] = {}
    for shards in run_distributed(_sharded_body, 4, 2, 2, "llama", timeout_s=240):
        for key, shape, offset, prepend, data in shards:
            whole = globals_.setdefault(key, torch.full(shape, float("nan")))
            local = data.reshape((1,) * prepend + tuple(data.shape))
            whole[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))] = local
    want = to_megatron(init_full_state(spec, seed=11), spec, 1, 1, 0, 0, te=True)
    stacked = {}
    for name, tensor in want.items():
        if name.startswith("decoder.layers."):
            _, _, i, rest = name.split(".", 3)
            stacked.setdefault("decoder.layers." + rest, {})[int(i)] = tensor
        else:
            stacked[name] = tensor
    expected = {k: (torch.stack([v[i] for i in sorted(v)]) if isinstance(v, dict) else v) for k, v in stacked.items()}
    assert set(globals_) == set(expected), set(globals_) ^ set(expected)
    rows = padded_vocab(spec.vocab_size, 2)
    for key, whole in globals_.items():
        assert not torch.isnan(whole).any(), f"{key}: part of the global tensor came from no rank"
        want_t = expected[key]
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert whole.shape[0] == rows and not whole[spec.vocab_size:].any(), key
            whole, want_t = whole[:spec.vocab_size], want_t[:spec.vocab_size]
        assert torch.equal(whole, want_t), key


def test_the_gpu_check_script_runs_on_cpu():
    """``scripts/gpu_check_megatron.py`` (issue 15's GPU check) with ``--device cpu``: its parity
    section passes here, so on a GPU only CUDA is new."""
    import re
    import subprocess
    import sys

    from tests.support import REPO

    proc = subprocess.run([sys.executable, "scripts/gpu_check_megatron.py", "--device", "cpu", "--repeats", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MASTER_PORT": "0", "GLOO_SOCKET_IFNAME": "lo"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"megatron: logits vs native (\S+), vs transformers (\S+); grads vs native (\S+); "
                     r"step megatron (\S+) s, native (\S+) s \((\S+)x\)", last)
    assert m, last
    assert max(float(m[1]), float(m[2]), float(m[3])) < 1e-5, last


def test_tp_beyond_the_query_groups_is_refused_on_explicit_groups():
    """megatron-core splits a query group across TP ranks only through its global parallel state."""
    from emu.engine.megatron_model import megatron_config

    with pytest.raises(ConfigError, match=r"tp=2 exceeds the model's 1 query groups"):
        megatron_config(ARCHITECTURES["qwen2-tied"], 2, 1)


def test_rope_scaling_megatron_cannot_express_is_refused():
    from emu.engine.megatron_model import rope_arguments

    assert rope_arguments(SPECS["llama3-megatron-rope"])["rope_scaling_factor"] == 8.0
    with pytest.raises(ConfigError, match=r"model.rope_original_max_position: 16 .* fixes it at 8192"):
        rope_arguments(ARCHITECTURES["llama3"])
