"""Measure decode time per token step at several batch sizes, to set a site's
``device.layer_launch_us`` (site_configs/*.yaml; nereusd.cost.model ``launch`` class).

One process, the engine's own generation loop (:func:`emu.engine.generate.generate`) on a model
directory, ``--steps`` tokens per sequence (no end-of-sequence stop). Prints seconds per step
per batch size and the estimate ``(per-step time at batch 1) / layers``: the part of a decode
step that does not shrink with the batch. Divide by the devices sharing a core when virtual
devices share cores.

    .venv/bin/python scripts/probe_decode.py --model examples/models/counting-warmstart
"""

from __future__ import annotations

import argparse
import time

import torch

from emu.engine.generate import SamplingParams, generate
from emu.engine.hf_io import load_pretrained
from emu.engine.model import LlamaModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="examples/models/counting-warmstart", help="model directory")
    parser.add_argument("--steps", type=int, default=96, help="decode steps per sequence")
    parser.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the workers use 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec, state = load_pretrained(args.model)
    model = LlamaModel(spec)
    model.load_state_dict(state)
    model.eval()
    per_step: dict[int, float] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [[1, 2, 3, 4]] * batch
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            with torch.no_grad():
                generate(model, prompts, SamplingParams(max_new_tokens=args.steps, stop_ids=(), seed=0))
            best = min(best, time.perf_counter() - start)
        per_step[batch] = best / args.steps
        print(f"batch {batch:4d}: {per_step[batch] * 1e3:8.3f} ms per decode step")
    smallest = min(per_step)
    print(f"layer_launch_us estimate: {per_step[smallest] / spec.num_layers * 1e6:.0f} "
          f"(batch {smallest}, {spec.num_layers} layers, {args.threads} thread(s))")


if __name__ == "__main__":
    main()
