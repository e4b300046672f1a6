"""Token-budget micro-batches against padded ones on a long-tailed length distribution.

    .venv/bin/python scripts/bench_microbatch.py [--trace verl-amd-7b-grpo] [--step 1] [--reps 3]

**Lengths.** The shipped length traces hold per-step mean, min and max, not per-sample lengths.
Per-sample response lengths are drawn from a **log-normal fitted to one step's mean and max**
(``response_length_mean``, ``response_length_max``; by default step 1 of
``verl-amd_deepseek-llm-7b-chat_gsm8k_grpo_resp1024.csv``: mean 192, max 1024): its ``μ, σ``
give the step's mean, and the expected largest of the batch's ``n`` samples
(``exp(μ + σ·z)``, ``z = Φ⁻¹(1 − 1/(n+1))``) equals the step's max; draws are clipped to the
step's [min, max]. Prompt lengths: the same fit of ``prompt_length_mean``/``prompt_length_max``.
Every length is divided by ``--scale`` (default 4) so that a step runs in seconds on two CPU
cores; the shape of the distribution is kept.

**What runs.** One training step (:meth:`emu.engine.stage.StageEngine.train_step`, a GRPO-style
policy loss) of one replica (tp·pp·dp = 1·1·1, fp32, gloo-free) on the same sequences, twice:

- *padded* — the fairest form of the count-based alternative: ``--micro-batch`` sequences per
  micro-batch, each micro-batch padded only to its own longest sequence (not the call's);
- *token budget* — ``train.max_tokens_per_micro_batch`` = ``--micro-batch`` × the longest
  sequence, i.e. the same worst-case activation bound a user sizing ``micro_batch`` for the
  longest sequence has; sequences packed padding-free (:mod:`emu.engine.batch`).

Both give the same gradients (checked: the parameters after the step are compared). Step time is
the median of ``--reps`` steps after one warm-up; peak is the virtual device's booked peak
(:mod:`emu.state.devmem`) above the resident parameters, gradients and Adam state.

Last line: ``microbatch: token-budget <a> s/step; padded <b> s/step (<r>x); peak <p> vs <q> MiB``
with ``r = b/a`` (above 1: token budgets are faster) and ``p``, ``q`` the peaks (token budget,
padded).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path
from statistics import NormalDist

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from emu.engine.parallel import build_stage_groups  # noqa: E402
from emu.engine.stage import StageEngine  # noqa: E402
from emu.state.devmem import DeviceMemory  # noqa: E402
from nereusd.models import ModelSpec  # noqa: E402
from nereusd.plan import Candidate, ModelStage, Role, Stage  # noqa: E402
from nereusd.traces import LENGTH_DIR, LENGTH_TRACES  # noqa: E402

MIB = float(1 << 20)
COLUMNS = tuple(f"{kind}_length_{stat}" for kind in ("response", "prompt") for stat in ("mean", "max", "min"))
"""The columns of a trace's row that the fit reads."""
SPEC = ModelSpec(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4,
                 num_kv_heads=2, max_position=2048, architecture="qwen2")


def trace_row(name: str, step: int) -> dict[str, float]:
    """Row ``step`` of a shipped verl-format length trace (columns in nereusd/data/traces/SOURCES.md).

    Raises:
        OSError: the file cannot be read.
        KeyError: it has no ``step`` column.
        LookupError: it has no row ``step``.
        ValueError: a value of that row is not a number.
    """
    import csv

    file = LENGTH_TRACES[name][0] if name in LENGTH_TRACES else name
    with open(LENGTH_DIR / file, newline="") as fh:
        for row in csv.DictReader(fh):
            if int(float(row["step"])) == step:
                return {k: float(v) for k, v in row.items() if v not in ("", None)}
    raise LookupError(f"{file}: no step {step}")


def fit_lognormal(mean: float, largest: float, n: int) -> tuple[float, float]:
    """``(μ, σ)`` of a log-normal with mean ``mean`` whose expected largest of ``n`` draws is ``largest``.

    ``log(largest) − log(mean) = σ·z − σ²/2`` with ``z = Φ⁻¹(1 − 1/(n+1))``; the smaller root
    ``σ = z − sqrt(z² − 2·log(largest/mean))`` (``σ = z`` when the max is beyond any log-normal's reach).
    """
    z = NormalDist().inv_cdf(1 - 1 / (n + 1))
    gap = math.log(max(largest, mean) / mean)
    sigma = z - math.sqrt(max(0.0, z * z - 2 * gap))
    return math.log(mean) - sigma * sigma / 2, sigma


def draw(mean: float, largest: float, smallest: float, n: int, rng: random.Random) -> list[int]:
    mu, sigma = fit_lognormal(mean, largest, n)
    return [int(min(largest, max(smallest, round(rng.lognormvariate(mu, sigma))))) for _ in range(n)]


def make_engine(memory: DeviceMemory, micro_batch: int, budget: int | None) -> StageEngine:
    cand = Candidate(1, 1, 1, (0,))
    eng = StageEngine(model_stage=ModelStage(Role.ACTOR, Stage.TRAINING), spec=SPEC, candidate=cand, rank=0,
                      groups=build_stage_groups(cand, 0), device=torch.device("cpu"), memory=memory,
                      value_head=False, trainable=True, lr=1e-4, grad_clip=1.0, micro_batch=micro_batch,
                      max_tokens_per_micro_batch=budget)
    eng.initialize(seed=0)
    return eng


def policy_loss(outputs, batch):
    loss = -(batch["weight"] * batch["advantages"] * outputs["logprobs"]).sum()
    return loss, {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="verl-amd-7b-grpo", help=f"one of {sorted(LENGTH_TRACES)} or a file "
                        "in nereusd/data/traces/length (verl columns)")
    parser.add_argument("--step", type=int, default=1, help="trace step whose mean and max are fitted")
    parser.add_argument("--sequences", type=int, default=64, help="sequences of the replica's step")
    parser.add_argument("--micro-batch", type=int, default=4, help="padded micro-batch (sequences)")
    parser.add_argument("--scale", type=float, default=4.0, help="divide every length by this")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more than the idle cores makes "
                        "both timings noisy)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for option, value in (("--sequences", args.sequences), ("--micro-batch", args.micro_batch),
                          ("--reps", args.reps), ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{option}: expected at least 1, got {value}")
    if not math.isfinite(args.scale) or args.scale <= 0:
        parser.error(f"--scale: expected a finite number above 0, got {args.scale}")
    try:
        row = trace_row(args.trace, args.step)
    except OSError as err:
        parser.error(f"--trace {args.trace}: {err.strerror or err} (one of {', '.join(sorted(LENGTH_TRACES))} "
                     f"or a file in {LENGTH_DIR})")
    except KeyError as err:
        parser.error(f"--trace {args.trace}: not a verl-format length trace (no {err} column)")
    except LookupError as err:
        parser.error(f"--step {args.step}: {err}")
    except ValueError as err:
        parser.error(f"--trace {args.trace}: not a verl-format length trace ({err})")
    missing = [k for k in COLUMNS if k not in row]
    if missing:
        parser.error(f"--trace {args.trace}: step {args.step} has no {', '.join(missing)} (not a verl-format length "
                     "trace?)")
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    s = args.scale
    responses = draw(row["response_length_mean"] / s, row["response_length_max"] / s,
                     max(1.0, row["response_length_min"] / s), args.sequences, rng)
    prompts = draw(row["prompt_length_mean"] / s, row["prompt_length_max"] / s,
                   max(1.0, row["prompt_length_min"] / s), args.sequences, rng)
    seqs = [[rng.randrange(SPEC.vocab_size) for _ in range(p + r)] for p, r in zip(prompts, responses)]
    longest = max(len(x) for x in seqs)
    budget = args.micro_batch * longest
    total = sum(responses)
    per_token = {"weight": [[1.0 / total] * r for r in responses],
                 "advantages": [[rng.gauss(0, 1)] * r for r in responses]}
    print(f"lengths: log-normal fitted to step {args.step} of {args.trace} (response mean "
          f"{row['response_length_mean']:.0f} max {row['response_length_max']:.0f}, prompt mean "
          f"{row['prompt_length_mean']:.0f} max {row['prompt_length_max']:.0f}), ÷{s:g}", flush=True)
    print(f"drawn: {args.sequences} sequences, response mean {statistics.mean(responses):.1f} max {max(responses)}, "
          f"sequence mean {statistics.mean(len(x) for x in seqs):.1f} max {longest}; padded micro_batch "
          f"{args.micro_batch}, token budget {budget}", flush=True)
    results = {}
    for name, mb, b in (("padded", args.micro_batch, None), ("token-budget", args.micro_batch, budget)):
        memory = DeviceMemory(0, 1 << 40)
        eng = make_engine(memory, mb, b)
        resident = memory.in_use_bytes
        times = []
        for rep in range(args.reps + 1):
            memory.reset_peak()
            start = time.perf_counter()
            eng.train_step(seqs, prompts, per_token, policy_loss)
            if rep:
                times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times), (memory.peak_bytes - resident) / MIB, eng.full_state())
        print(f"{name}: {results[name][0]:.3f} s/step (median of {args.reps}: "
              f"{', '.join(f'{t:.3f}' for t in times)}), peak {results[name][1]:.1f} MiB", flush=True)
    a, p, state_a = results["token-budget"]
    b, q, state_b = results["padded"]
    diff = max(float((state_a[k] - state_b[k]).abs().max()) for k in state_a)
    print(f"parameters after {args.reps + 1} steps differ by at most {diff:.2e} (same sequences, same loss)")
    print(f"microbatch: token-budget {a:.3f} s/step; padded {b:.3f} s/step ({b / a:.2f}x); "
          f"peak {p:.1f} vs {q:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
