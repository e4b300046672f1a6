"""``nereus-launch plan``: print the plan the planner picks for a model, algorithm, site and pool.

Example::

    nereus-launch plan --model llama-3.1-8b --algorithm ppo --site site_configs/h200-ib.yaml \\
        --gpus 64 --prompt-length 512 --response-length 8192 --global-batch 1024 [--json]

Prints a table (model-stage, tp, pp, dp, micro-batch, ZeRO stage, devices, predicted latency,
the model-stage's own peak memory, and its fullest device's peak against the capacity, in GiB or
on devices under 1 GiB in MiB), the predicted step latency and the search time; ``--json`` prints
the same as one JSON object with keys ``plan``, ``predicted_step_latency_s`` and ``search_time_ms``.
``--memory-gib`` replaces the site's device memory, as a job's ``memory_gib`` does. An
infeasible request exits with status 1 and says which model-stage cannot fit and by how much.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from launcher.cli import DefaultsHelpFormatter, bounded_int
from nereusd.cost.calibration import Calibration
from nereusd.cost.model import CostModel
from nereusd.config.job import MAX_SEQUENCES, MAX_TOKENS
from nereusd.errors import ConfigError, shortened
from nereusd.models import PRESETS, resolve_model, shortest_context
from nereusd.plan import MAX_DEVICES, Role
from nereusd.planner.search import Infeasible, Planner
from nereusd.planner.space import GENERATION_ENGINES, PlannerOptions, PlanProblem, generation_engines
from nereusd.config.site import load_site
from nereusd.workflow import Workload, build_workflow

GIB = float(1 << 30)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="show the plan the planner picks (no job is started)",
                              formatter_class=DefaultsHelpFormatter,
                              description="Print the plan the planner picks for a model, algorithm, site and "
                                          "pool. It plans from --model/--site/--gpus, not from a job file: a "
                                          "job's own launch plan is journalled when the job starts "
                                          "(RUN_DIR/events.jsonl, event launch_plan; 'local' also prints it).")
    p.add_argument("--model", required=True, help=f"preset name ({', '.join(PRESETS)}), "
                   "a HF model directory or a config.json")
    p.add_argument("--reward-model", help="a different model for the reward role (default: --model); 'none' for a "
                   "rule-based reward (a verifier such as the counting or gsm8k task's: no reward model-stage)")
    p.add_argument("--critic-model", help="a different model for the critic role (default: --model)")
    p.add_argument("--algorithm", default="ppo", choices=["ppo", "grpo", "remax"],
                   help="RL algorithm; it decides the model-stages (default: %(default)s)")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="asynchronous execution (generation overlaps training)")
    p.add_argument("--site", required=True, help="site config path or name (site_configs/NAME.yaml)")
    p.add_argument("--gpus", type=int, required=True, help="devices in the pool")
    p.add_argument("--prompt-length", type=bounded_int(1, MAX_TOKENS), default=512, help="longest prompt in tokens (default: %(default)s)")
    p.add_argument("--response-length", type=bounded_int(1, MAX_TOKENS), default=1024,
                   help="longest response in tokens the plan must hold (default: %(default)s)")
    p.add_argument("--global-batch", type=bounded_int(1, MAX_SEQUENCES), default=256, help="sequences per RL step")
    p.add_argument("--mini-batches", type=bounded_int(1, MAX_SEQUENCES), default=1, help="optimizer steps per RL step")
    p.add_argument("--micro-batch", type=bounded_int(1, MAX_SEQUENCES), default=1,
                   help="per-replica training micro-batch, at most (sequences; as train.micro_batch): lowered to "
                        "a divisor of each replica's share that fits; generation waves are searched on their own")
    p.add_argument("--any-divisor", action="store_true", help="TP/PP may be any divisor, not only 2^k")
    p.add_argument("--recompute", action="store_true", help="allow activation recomputation")
    p.add_argument("--zero", nargs="?", const=(1, 2), default=(), metavar="STAGES", type=_zero_stages,
                   help="training model-stages may also run ZeRO (optimizer state, and at stage 2 gradients, "
                        "sharded across DP; the deepspeed backend, tp = pp = 1): --zero allows stages 1 and 2, "
                        "--zero 1 only stage 1; without it, no ZeRO")
    p.add_argument("--generation", choices=GENERATION_ENGINES, default="native",
                   help="generation engine whose memory the plan holds: native (the EMU's decoder) or vllm (each "
                   "replica's engine keeps a weight copy and a KV cache preallocated for prompt + response "
                   "tokens of its wave), as 'simulate --generation' (default: %(default)s)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="each device's memory in GiB instead of the site's (a job's memory_gib)")
    p.add_argument("--calibration", help="calibration state JSON to use (default: priors)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    parse = p.parse_known_args

    def refuse_job_files(args=None, namespace=None):
        """A job YAML given as an argument is named in the error, before argparse's "required:
        --model, --site, --gpus" (a user's first guess is ``plan JOB.yaml``)."""
        tokens = list(sys.argv[1:] if args is None else args)
        for i, token in enumerate(tokens):
            value_of_option = i > 0 and tokens[i - 1].startswith("--") and "=" not in tokens[i - 1]
            if token.endswith((".yaml", ".yml")) and not token.startswith("-") and not value_of_option:
                p.error(f"{token}: plan reads no job file; give the job's --model, --site and --gpus (and "
                        "--algorithm, --prompt-length, --response-length, --global-batch, --memory-gib as it sets "
                        "them). A job's own launch plan is printed by 'local' and journalled at its start")
        return parse(args, namespace)

    p.parse_known_args = refuse_job_files


def _zero_stages(text: str) -> tuple[int, ...]:
    """``--zero``'s value: comma-separated ZeRO stages from {1, 2}, at least one."""
    try:
        stages = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected stages such as 1 or 1,2, got {text!r}") from None
    if not stages or not set(stages) <= {1, 2}:
        raise argparse.ArgumentTypeError(f"ZeRO stages are 1 and 2, got {text!r}")
    return stages


def run(args: argparse.Namespace) -> int:
    site = load_site(args.site)
    if not 1 <= args.gpus <= MAX_DEVICES:
        raise ConfigError(f"--gpus must be between 1 and {MAX_DEVICES:,}, got {args.gpus}")
    site = site.with_nodes(max(1, math.ceil(args.gpus / site.devices_per_node)))
    if args.memory_gib is not None:
        if not (math.isfinite(args.memory_gib) and 0 < args.memory_gib <= 1e6):
            raise ConfigError(f"--memory-gib must be a number of GiB in (0, 1e6], got {args.memory_gib}")
        site = dataclasses.replace(site, device=dataclasses.replace(site.device, memory_gib=args.memory_gib))
    for flag, value in (("--model", args.model), ("--reward-model", args.reward_model),
                        ("--critic-model", args.critic_model)):
        if value and Path(value).suffix.lower() in (".yaml", ".yml"):
            raise ConfigError(f"{flag} {value}: a YAML file; {flag} takes a preset name, a HF model directory or "
                              "a config.json. 'plan' does not read job files: a job's launch plan is printed by "
                              "'nereus-launch local' and journalled as the launch_plan event of RUN_DIR/events.jsonl")
    actor = resolve_model(args.model)
    specs = {r: actor for r in Role}
    rule_reward = (args.reward_model or "").lower() == "none"
    if rule_reward:
        del specs[Role.REWARD]
    elif args.reward_model:
        try:
            specs[Role.REWARD] = resolve_model(args.reward_model)
        except ConfigError as err:   # the model resolver does not know --reward-model's own 'none'
            raise ConfigError(f"--reward-model: {err}; or 'none' for a rule-based reward") from None
    if args.critic_model:
        specs[Role.CRITIC] = resolve_model(args.critic_model)
    workflow = build_workflow(args.algorithm, asynchronous=args.asynchronous, reward_model=not rule_reward)
    if args.critic_model and not any(m.role is Role.CRITIC for m in workflow.model_stages):
        # it was ignored (an adversarial trial, 2026-12-07), where a job file refuses models.critic
        raise ConfigError(f"--critic-model: {args.algorithm} has no critic; leave it out")
    try:
        workload = Workload(prompt_length=args.prompt_length, response_length=args.response_length,
                            global_batch=args.global_batch, mini_batches=args.mini_batches,
                            micro_batch=args.micro_batch)
    except ConfigError as err:   # Workload's own checks, in the flags' names
        message = str(err)
        for field in ("prompt_length", "response_length", "global_batch", "mini_batches", "micro_batch"):
            message = message.replace(f"workload.{field}", "--" + field.replace("_", "-"))
        raise ConfigError(message.replace("global_batch=", "--global-batch ")) from None
    warnings = []
    short = shortest_context({r.value: s for r, s in specs.items()}, args.prompt_length + args.response_length)
    if short:
        warnings.append(f"--prompt-length {args.prompt_length} plus --response-length {args.response_length} exceeds "
                        f"the {short[0]} model's max_position={short[1].max_position}: a job of this shape "
                        f"is refused at launch")
    if args.micro_batch > workload.mini_batch_size:
        warnings.append(f"--micro-batch {args.micro_batch} exceeds the {workload.mini_batch_size} "
                        f"sequences of an optimizer step (--global-batch / --mini-batches): each replica runs "
                        f"its whole share as one micro-batch")
    for line in warnings if not args.json else []:
        print(f"warning: {line}", file=sys.stderr)
    engines = generation_engines(workflow, args.generation, args.prompt_length + args.response_length)
    problem = PlanProblem(workflow, specs, workload, site, tuple(range(args.gpus)), engines=engines)
    try:
        missing = bool(args.calibration) and not Path(args.calibration).is_file()
    except OSError as err:   # a name too long for the file system
        raise ConfigError(f"--calibration {shortened(args.calibration)}: {err.strerror}") from None
    if missing:
        what = "not a regular file" if Path(args.calibration).exists() else "no such file"
        raise ConfigError(f"--calibration {args.calibration}: {what}")
    calibration = Calibration.load(args.calibration) if args.calibration else Calibration()
    options = PlannerOptions(any_divisor=args.any_divisor, allow_recompute=args.recompute,
                             zero_stages=(0, *args.zero) if args.zero else ())
    try:
        result = Planner(problem, CostModel(site, calibration), options, suggest=True).solve()
    except Infeasible as err:
        if args.json:
            print(json.dumps({"error": str(err), "warnings": warnings, "model_stage": str(err.model_stage) if err.model_stage else None,
                              "need_gib": err.need_bytes / GIB, "usable_gib": err.usable_bytes / GIB}))
        else:
            print(f"infeasible: {err}", file=sys.stderr)
        return 1
    rows = []
    for m, cand in result.plan.items():
        opt = result.options[m]
        peak = max(result.peak_bytes[d] for d in cand.devices)
        rows.append({
            "model_stage": str(m), "tp": cand.tp, "pp": cand.pp, "dp": cand.dp,
            "micro_batch": cand.micro_batch, "recompute": cand.recompute, "zero_stage": cand.zero_stage,
            "devices": list(cand.devices),
            "predicted_latency_s": round(opt.latency_s, 4), "peak_memory_gib": round(peak / GIB, 2),
            "own_peak_gib": round(opt.peak_bytes / GIB, 4), "capacity_gib": round(site.device_memory_bytes / GIB, 4),
            "peak_bytes": int(peak), "own_peak_bytes": int(opt.peak_bytes), "capacity_bytes": site.device_memory_bytes,
        })
    out = {"plan": rows, "predicted_step_latency_s": round(result.predicted_step_latency_s, 4),
           "search_time_ms": round(result.search_time_s * 1e3, 2),
           "site": site.name, "gpus": args.gpus, "algorithm": args.algorithm, "asynchronous": args.asynchronous,
           "zero_stages": list(args.zero), "generation": args.generation, "warnings": warnings}
    if args.json:
        print(json.dumps(out))
        return 0
    print(format_table(rows, result.usable_bytes))
    print(f"predicted step latency: {result.predicted_step_latency_s:.2f} s")
    print(f"search time: {result.search_time_s * 1e3:.1f} ms")
    return 0


def _ranges(devices: list[int]) -> str:
    """``[0,1,2,3,8]`` → ``0-3,8``."""
    parts, start = [], None
    for i, d in enumerate(devices):
        if start is None:
            start = d
        if i + 1 == len(devices) or devices[i + 1] != d + 1:
            parts.append(f"{start}-{d}" if d != start else f"{d}")
            start = None
    return ",".join(parts)


def format_table(rows: list[dict], usable_bytes: int) -> str:
    """The plan as an aligned text table; memory in GiB, or MiB on devices under 1 GiB (the
    local site's: a tiny model's peaks read 0.0 GiB)."""
    capacity = max((r["capacity_bytes"] for r in rows), default=GIB)
    scale, unit = (GIB, "GiB") if capacity >= GIB else (1 << 20, "MiB")
    header = ["model-stage", "tp", "pp", "dp", "mb", "zero", "devices", "latency s", f"own {unit}",
              f"device peak / capacity {unit}"]
    body = [[r["model_stage"], str(r["tp"]), str(r["pp"]), str(r["dp"]),
             str(r["micro_batch"]) + ("R" if r["recompute"] else ""), str(r.get("zero_stage", 0)),
             _ranges(r["devices"]), f"{r['predicted_latency_s']:.2f}", f"{r['own_peak_bytes'] / scale:.1f}",
             f"{r['peak_bytes'] / scale:.1f} / {r['capacity_bytes'] / scale:.1f}"]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + body]
    lines.append(f"(own: the model-stage's peak per device; device peak: its fullest device with every "
                 f"model-stage on it; usable per device with 10 % headroom: {usable_bytes / scale:.1f} {unit}; "
                 "R = recomputation)")
    return "\n".join(lines)
