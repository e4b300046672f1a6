"""The Megatron backend's GPU check (issue 15), one rank, a few minutes on one GPU.

1. **Parity at tp = pp = 1.** Tiny Llama, Qwen2 (q/k/v biases, tied) and Qwen3 (q/k norms)
   models with random weights (norms and biases moved off their initial values): megatron-core's
   ``GPTModel`` built by :mod:`emu.engine.megatron_model` and loaded through our mapping, the
   native engine's ``LlamaModel`` and ``transformers``' model, in fp32. Max |Δ| of the logits
   against both, and of every canonical gradient of a fixed weighted-logit loss against the
   native engine's.
2. **Step time** of a 1.1 B model (TinyLlama-1.1B's shape: hidden 2,048, 22 layers, 32 heads /
   4 kv heads, vocab 32,000; batch 4 × 1,024 tokens; bf16 on a GPU): forward, backward and an AdamW step, median of
   ``--repeats`` after two warm-ups, Megatron's local layer spec (or Transformer Engine's when
   installed) against the native engine on the same device.

The tp 2 / pp 2 checks need no GPU and run in ``make test`` (``tests/unit/emu/test_megatron_model.py``:
Megatron's own sharded state dicts reassembled through our mapping, TP 2 parity on gloo). Multi-rank
Megatron runs on GPUs need two or more GPUs (NCCL refuses two ranks on one GPU).

``--device cpu`` runs the same on CPU with a small model in fp32, with the test-only patches of
``tests/unit/emu/test_megatron_model.py`` (``torch.cuda.current_device`` → ``"cpu"``, a no-op
``torch.cuda.synchronize``, a null CUDA-RNG fork): that is how the script itself is tested here.
On a GPU nothing is patched. Last line:

    megatron: logits vs native <a>, vs transformers <b>; grads vs native <c>; step megatron <s> s, native <n> s (<r>x)

Usage (GPU machine: Python 3.12, torch with CUDA, megatron-core 0.16.1 and transformers installed;
the project's device machine has neither, so bring their Python 3.12 wheels — megatron-core 0.16.1,
transformers and what it needs beyond torch — as ``../.library/device/README.md`` says):

    python scripts/gpu_check_megatron.py [--device cuda] [--repeats 5]

``make test`` runs it with ``--device cpu --repeats 1`` (``tests/unit/emu/test_megatron_model.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from emu.engine.canonical import init_full_state  # noqa: E402
from emu.engine.hf_io import save_pretrained  # noqa: E402
from emu.engine.model import LlamaModel  # noqa: E402
from nereusd.models import ModelSpec  # noqa: E402

TINY = {
    "llama": ModelSpec(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position=256),
    "qwen2": ModelSpec(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       architecture="qwen2"),
    "qwen3": ModelSpec(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position=256, rms_norm_eps=1e-6, explicit_head_dim=32,
                       architecture="qwen3"),
}
ONE_B = ModelSpec(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32,
                  num_kv_heads=4, max_position=4096)
"""TinyLlama-1.1B's shape (1.10 B parameters)."""
SMALL = ModelSpec(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                  num_kv_heads=2, max_position=512)


def cpu_patches() -> None:
    """What megatron-core 0.16.1's GPTModel needs to run on CPU (``--device cpu`` only)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def one_rank_groups():
    from emu.engine.megatron_model import StageGroups, stage_process_groups

    world = dist.group.WORLD
    return stage_process_groups(StageGroups(tp=world, pp=world, dp=world, embd=world))


def megatron_model(spec: ModelSpec, full: dict[str, torch.Tensor], device: str, dtype: torch.dtype):
    from emu.engine.megatron_model import build_gpt_model, load_canonical

    from emu.engine.megatron_model import uses_te

    model = build_gpt_model(spec, 1, 1, 0, one_rank_groups(), dtype=dtype)
    load_canonical(model, full, spec, 1, 1, 0, 0)
    return model.to(device), uses_te(model)


def native_model(spec: ModelSpec, full: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> LlamaModel:
    model = LlamaModel(spec)
    model.load_state_dict({k: v for k, v in full.items() if k in model.state_dict()}, strict=True)
    return model.to(device=device, dtype=dtype)


def parity(device: str) -> dict[str, float]:
    """Section 1: the worst differences over the three architectures."""
    import transformers

    from emu.engine.megatron_layout import from_megatron
    from emu.engine.megatron_model import logits, megatron_tensors

    worst = {"logits_native": 0.0, "logits_hf": 0.0, "grads_native": 0.0}
    for name, spec in TINY.items():
        full = init_full_state(spec, seed=3)
        gen = torch.Generator().manual_seed(4)
        for k, v in full.items():   # norms and biases off their initial values, so that their use shows
            if "norm" in k or k.endswith(".bias"):
                v.add_(0.1 * torch.randn(v.shape, generator=gen))
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(tmp, spec, full)
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).to(device).eval()
        mega, te = megatron_model(spec, full, device, torch.float32)
        ours = native_model(spec, full, device, torch.float32)
        ids = torch.randint(0, spec.vocab_size, (2, 24), generator=gen).to(device)
        weights = torch.randn(2, 24, spec.vocab_size, generator=gen).to(device)
        got = logits(mega, ids, spec.vocab_size)
        want = ours(ids)
        with torch.no_grad():
            ref = hf(ids).logits
        (got * weights).sum().backward()
        (want * weights).sum().backward()
        grads = from_megatron({(0, 0): {k: v.cpu() for k, v in megatron_tensors(mega, grads=True).items()}},
                              spec, 1, 1, te=te)
        scale = max(p.grad.abs().max().item() for p in ours.parameters())
        d_native = (got - want).abs().max().item()
        d_hf = (got - ref).abs().max().item()
        d_grads = max((grads[k] - p.grad.cpu()).abs().max().item()
                      for k, p in ours.named_parameters()) / max(1.0, scale)
        print(f"gpu_check_megatron: {name}: logits vs native {d_native:.2e}, vs transformers {d_hf:.2e}; "
              f"gradients vs native {d_grads:.2e} (relative to the largest, {scale:.3g})", flush=True)
        worst["logits_native"] = max(worst["logits_native"], d_native)
        worst["logits_hf"] = max(worst["logits_hf"], d_hf)
        worst["grads_native"] = max(worst["grads_native"], d_grads)
    return worst


def step_time(model: torch.nn.Module, forward, ids: torch.Tensor, repeats: int, device: str) -> float:
    """Median seconds of forward + backward + AdamW step (two warm-ups first)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = forward(ids)
        out.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(device: str, repeats: int) -> tuple[float, float, str]:
    """Section 2: (Megatron s, native s, what ran)."""
    from emu.engine.megatron_model import logits

    spec, dtype, shape = (ONE_B, torch.bfloat16, (4, 1024)) if device == "cuda" else (SMALL, torch.float32, (2, 128))
    full = init_full_state(spec, seed=0)
    ids = torch.randint(0, spec.vocab_size, shape).to(device)
    mega, te = megatron_model(spec, full, device, dtype)
    mega_s = step_time(mega, lambda x: logits(mega, x, spec.vocab_size), ids, repeats, device)
    del mega
    if device == "cuda":
        torch.cuda.empty_cache()
    ours = native_model(spec, full, device, dtype)
    native_s = step_time(ours, ours, ids, repeats, device)
    what = (f"{spec.num_parameters() / 1e6:,.1f} M parameters, batch {shape[0]} x {shape[1]}, {str(dtype)[6:]}, "
            f"Megatron {'Transformer Engine' if te else 'local'} spec")
    return mega_s, native_s, what


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    if args.device == "cpu":
        cpu_patches()
    else:
        from emu.engine.megatron_model import seed_model_parallel_rng

        torch.cuda.set_device(0)
        seed_model_parallel_rng(1234, tp_rank=0)
    worst = parity(args.device)
    mega_s, native_s, what = speed(args.device, args.repeats)
    print(f"gpu_check_megatron: step time ({what}): Megatron {mega_s:.3f} s, native {native_s:.3f} s", flush=True)
    print(f"megatron: logits vs native {worst['logits_native']:.1e}, vs transformers {worst['logits_hf']:.1e}; "
          f"grads vs native {worst['grads_native']:.1e}; step megatron {mega_s:.3f} s, native {native_s:.3f} s "
          f"({mega_s / native_s:.2f}x)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
