"""``nereus-launch simulate``: replay an RL job on length and pool traces under several policies.

Example::

    nereus-launch simulate --model llama-3.1-8b --algorithm ppo --site site_configs/h200-ib.yaml \\
        --gpus 64 --steps 1000 --length-trace generated-ramp --pool-trace us-east-2b \\
        --policies frozen-start,frozen-final,nereus,greedy,periodic-3,oracle --out runs/sim [--json]

Trace names resolve to the copies shipped in ``nereusd/data/traces`` (see its
``SOURCES.md``): length traces ``verl-amd-7b-grpo``, ``verl-0.5b-ppo``, ``deepgrpo-baseline``,
``deepgrpo-tree`` or ``generated-ramp[:start:end]`` (labelled *generated* in every output);
pool traces ``us-east-2b``, ``us-west-2a`` or ``constant``. Paths work too. Prints a table per
policy (mean step latency, total time, switches, transition time and share, OOM events, vs the
better frozen baseline %, share of the oracle's headroom captured); ``--out`` also writes ``summary.json``, ``run.json``, ``table.txt`` and PNG plots;
``--json`` prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from launcher.cli import DefaultsHelpFormatter, bounded_float, bounded_int, output_directory
from nereusd.config.curriculum import parse_stages
from nereusd.config.job import MAX_SEQUENCES, MAX_TOKENS
from nereusd.errors import ConfigError, NereusError
from nereusd.models import PRESETS, shortest_context
from nereusd.sim.policies import parse_policies
from nereusd.sim.report import _title, format_table, summary, write
from nereusd.planner.space import GENERATION_ENGINES
from nereusd.sim.scenario import Scenario, build, run_policies
from nereusd.sim.truth import MAX_CONTENTION_PER_H, MAX_NOISE_SIGMA, TRUTH_KINDS, TruthConfig
from nereusd.traces import DEFAULT_COLUMN, LENGTH_TRACES, POOL_TRACES


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="replay a job on traces under adaptation policies (no GPUs used)",
                              description=__doc__.split("\n\n")[0].replace("``", ""),
                              formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"preset name ({', '.join(sorted(PRESETS))}), HF model directory or config.json")
    p.add_argument("--algorithm", default="ppo", choices=["ppo", "grpo", "remax"], help="RL algorithm (its model-stages)")
    p.add_argument("--reward-model", choices=("model", "none"), default="model",
                   help="a reward model-stage (model, of --model's shape), or none: a rule-based reward (a verifier "
                   "such as the counting or gsm8k task's), as nereus-launch plan --reward-model none")
    p.add_argument("--site", default="h200-ib", help="site config path or name")
    p.add_argument("--gpus", type=int, default=64, help="devices of the simulated cluster (whole nodes)")
    p.add_argument("--steps", type=int, default=1000,
                   help="RL steps to complete (a generated ramp spans them: fewer steps, a steeper ramp)")
    p.add_argument("--length-trace", default="generated-ramp",
                   help=f"shipped name ({', '.join(sorted(LENGTH_TRACES))}), generated-ramp[:start:end] (tokens, "
                   "geometric over --steps), or a CSV path (FILE.csv or FILE.csv:COLUMN, default column "
                   f"{DEFAULT_COLUMN}: each step's longest response, one row per step; a trace shorter than "
                   "--steps repeats)")
    p.add_argument("--max-new-tokens-schedule", default=None, metavar="STEP:CAP,…",
                   help="a response-length curriculum, as a job's rollout.max_new_tokens_schedule (e.g. "
                   "0:8192,500:16384,800:24576, DeepScaleR's 8K/16K/24K): from step STEP each step's length is the "
                   "trace's cut at CAP tokens, and the controller knows each step's cap (default: none, no curriculum)")
    p.add_argument("--join", choices=("background", "immediate"), default="background",
                   help="how devices that come back join, as a job's pool.join: background (the vLLM engines the "
                   "controller expects on them start while the job runs on; they join once those are up) or "
                   "immediate (they join at once and the transition starts their engines)")
    p.add_argument("--pool-trace", default="constant",
                   help=f"shipped name ({', '.join(sorted(POOL_TRACES))}), constant, or a JSON path "
                   "({\"metadata\": {\"gap_seconds\": S}, \"data\": [instance counts, one per S seconds]}; "
                   "scaled so its largest count is the whole cluster, started there, repeating)")
    p.add_argument("--policies", default="frozen-start,frozen-final,nereus,greedy,periodic-3,oracle",
                   help="comma-separated: frozen-start (or frozen: the launch layout, DP-rescaled on pool changes, "
                   "relaunched larger after an OOM), frozen-final (launched for the longest responses), nereus, "
                   "nereus@<gamma>, greedy, periodic-<k>, oracle (the best plan every step, switches free), "
                   "oracle@<h> (the oracle leaving a share h of memory free, e.g. oracle@0.1: the planner's headroom)")
    p.add_argument("--prompt-length", type=bounded_int(1, MAX_TOKENS), default=512, help="prompt tokens per sequence")
    p.add_argument("--global-batch", type=bounded_int(1, MAX_SEQUENCES), default=1024, help="sequences per RL step")
    p.add_argument("--seed", type=int, default=0, help="seed of the ground truth and of a generated ramp")
    p.add_argument("--noise", type=bounded_float(0.0, MAX_NOISE_SIGMA), default=TruthConfig.noise_sigma,
                   help="per-step time noise: the log-normal sigma of each model-stage's time (0 to 2)")
    p.add_argument("--contention-per-h", type=bounded_float(0.0, MAX_CONTENTION_PER_H),
                   default=TruthConfig.contention_per_h,
                   help="network contention episodes per hour of simulated wall clock (the ground truth's)")
    p.add_argument("--generation", choices=GENERATION_ENGINES, default="native",
                   help="generation engine: native (the EMU's decoder) or vllm (each replica's vLLM engine holds a "
                   "weight copy and a KV cache preallocated for its wave; a transition that gives a device a new "
                   "replica starts engines, priced by --engine-rebuild-s)")
    p.add_argument("--engine-rebuild-s", type=bounded_float(0.0, 86400.0), default=TruthConfig.engine_rebuild_s,
                   help="seconds a vLLM engine start-up adds to a transition or launch that starts engines (engines "
                   "start in parallel; needs --generation vllm)")
    p.add_argument("--truth", choices=TRUTH_KINDS, default="measured",
                   help="ground truth: measured (formulas of its own from published hardware figures, with "
                   "effects the controller's cost model lacks; nereusd/sim/measured.py) or efficiency (the "
                   "controller's cost model with hidden per-class efficiencies; nereusd/sim/truth.py)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (policies run independently)")
    p.add_argument("--out", help="directory for summary.json, run.json, table.txt and PNG plots")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _stages(text: str) -> tuple[tuple[int, int], ...]:
    """:func:`nereusd.config.curriculum.parse_stages` of ``--max-new-tokens-schedule`` (the scenario
    checks the stages).

    Raises:
        ConfigError: for text of another form."""
    try:
        return parse_stages(text)
    except ValueError as err:
        raise ConfigError(f"--max-new-tokens-schedule: {err}") from None


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise NereusError(f"--jobs: expected a positive number of worker processes, got {args.jobs}")
    if args.out:
        output_directory(args.out)
    scenario = Scenario(model=args.model, algorithm=args.algorithm, site=args.site, gpus=args.gpus,
                        steps=args.steps, length_trace=args.length_trace, pool_trace=args.pool_trace,
                        prompt_length=args.prompt_length, global_batch=args.global_batch, seed=args.seed,
                        reward_model=args.reward_model == "model",
                        generation=args.generation, max_new_tokens_schedule=_stages(args.max_new_tokens_schedule or ""),
                        join=args.join)
    truth = TruthConfig(seed=args.seed, noise_sigma=args.noise, contention_per_h=args.contention_per_h,
                        engine_rebuild_s=args.engine_rebuild_s, kind=args.truth)
    policies = parse_policies(args.policies)
    start = time.perf_counter()
    sim, meta = build(scenario, truth)
    prompt = sim.problem.workload.prompt_length
    short = shortest_context({r.value: spec for r, spec in sim.problem.specs.items()}, prompt + sim.max_response_length)
    if short:   # stderr: --json's stdout stays one JSON object
        print(f"warning: prompts of {prompt} tokens plus the length trace's longest response "
              f"({sim.max_response_length}) exceed the {short[0]} model's max_position={short[1].max_position}: "
              f"a job of this shape is refused at launch; the simulation runs it anyway (a what-if)", file=sys.stderr)
    trace_steps = meta["length_trace_steps"]
    if trace_steps < args.steps:
        print(f"warning: the length trace has {trace_steps} steps, fewer than --steps {args.steps}: "
              f"it repeats from its start after step {trace_steps - 1}", file=sys.stderr)
    from tqdm import tqdm

    # progress on stderr (a terminal only: tqdm's disable=None), one tick a policy
    with tqdm(total=len(policies), unit="policy", desc=f"simulating {args.steps} steps", disable=None,
              dynamic_ncols=True, file=sys.stderr) as bar:
        def done(result) -> None:
            bar.set_postfix_str(f"{result.policy.name} done", refresh=False)
            bar.update(1)

        results = run_policies(sim, policies, jobs=args.jobs, on_done=done)
    meta["wall_s"] = round(time.perf_counter() - start, 2)
    rows = summary(results)
    if not args.json:   # the table first: a file that cannot be written below loses nothing shown
        print(_title(meta))
        print(format_table(rows), flush=True)
    try:
        files = write(args.out, results, meta, sim.lengths, sim.pool_trace) if args.out else []
    except OSError as err:
        raise NereusError(f"--out {args.out}: cannot write {err.filename or 'a file'} ({err.strerror})") from None
    if args.json:
        print(json.dumps({**meta, "summary": rows, "files": [str(f) for f in files]}, default=str))
        return 0
    print(f"simulated in {meta['wall_s']:.1f} s" + (f"; wrote {len(files)} files to {args.out}" if files else ""))
    return 0
