"""``nereus-launch report RUN_DIR``: PNG plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nereusd.errors import NereusError
from nereusd.journal import METRICS_FILE, read_jsonl

#: (file name, title, y label, series key(s)) of the per-step plots.
_SERIES = (
    ("reward.png", "Reward", "mean reward", ("reward_mean",)),
    ("response_length.png", "Response length", "tokens", ("response_length_mean", "response_length_max")),
    ("step_latency.png", "Step latency", "seconds", ("step_latency_s",)),
    ("tokens_per_s.png", "Throughput", "generated tokens / s", ("tokens_per_s",)),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="write PNG plots of a run directory's metrics",
        description="Plot reward, response length, step and stage latency, throughput and peak memory per "
                    "device from RUN_DIR/metrics.jsonl into RUN_DIR/plots/ (or --out).",
    )
    parser.add_argument("run_dir", help="a run directory written by 'nereus-launch local'")
    parser.add_argument("--out", help="output directory (default RUN_DIR/plots)")
    parser.set_defaults(func=run_report)


def write_plots(run_dir: Path, out_dir: Path) -> list[Path]:
    """Write the plots and return their paths.

    Raises:
        NereusError: if ``run_dir`` has no metrics.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(run_dir / METRICS_FILE)
    if not records:
        raise NereusError(f"{run_dir / METRICS_FILE}: no metrics to plot (is this a run directory?)")
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    written = []
    for name, title, ylabel, keys in _SERIES:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for key in keys:
            ax.plot(steps, [r.get(key) for r in records], label=key, marker="." if len(steps) < 60 else None)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    stages = sorted({s for r in records for s in r.get("stage_latency_s", {})})
    bottom = [0.0] * len(records)
    for stage in stages:
        values = [r.get("stage_latency_s", {}).get(stage, 0.0) for r in records]
        ax.bar(steps, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title="Stage latency", xlabel="step", ylabel="seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "stage_latency.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "stage_latency.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    devices = sorted({d for r in records for d in r.get("peak_memory_bytes", {})}, key=int)
    for device in devices:
        ax.plot(steps, [r.get("peak_memory_bytes", {}).get(device, 0) / 2**20 for r in records],
                label=f"device {device}")
    ax.set(title="Peak memory per device", xlabel="step", ylabel="MiB")
    ax.grid(alpha=0.3)
    if devices:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "peak_memory.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "peak_memory.png")
    return written


def run_report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    out_dir = Path(args.out) if args.out else run_dir / "plots"
    for path in write_plots(run_dir, out_dir):
        print(path)
    return 0
