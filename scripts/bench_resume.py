"""What a crashed nereusd costs, both ways (issue 17, item 2: "measure both and default to the
cheaper"): ``nereus-launch resume`` on the workers the crashed run's agent kept (their EMUs in
memory, the default) against ``resume --restart`` (new workers, the latest checkpoint loaded,
the steps since it run again).

One job (default ``examples/counting_grpo.yaml``: 4 virtual CPU devices, checkpoints every 5
steps, generation on vLLM when it is installed) is killed twice with ``kill -9`` of nereusd, each
time just after the metrics row of a step ``k`` with ``k mod 5 = 3`` (three steps after a
periodic checkpoint, early in step ``k + 1``): the first time it resumes on the kept workers,
the second time with ``--restart``. The cost of a crash is the time from the ``resume`` command
to the metrics row of the step the crash interrupted (the one both ways must run again, after
whatever else they re-run); the steps re-run before it are counted too. Both kills sit at the
same distance from their checkpoint, so the restart re-runs the same number of steps each time.

    python scripts/bench_resume.py
    python scripts/bench_resume.py --job examples/counting_grpo.yaml --first 8

Last line: ``resume: kept workers <a> s vs checkpoint restart <b> s to the interrupted step
(<r>x); steps re-run 0 vs <n>``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nereusd.config.job import load_job  # noqa: E402
from nereusd.errors import ConfigError  # noqa: E402
from nereusd.journal import read_jsonl  # noqa: E402


def _rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(read_jsonl(path)) if path.exists() else 0


def _wait_rows(run_dir: Path, rows: int, proc: subprocess.Popen, timeout_s: float = 900.0) -> float:
    """Poll (20 ms) until ``metrics.jsonl`` has ``rows`` rows; returns the monotonic time seen."""
    deadline = time.monotonic() + timeout_s
    while _rows(run_dir) < rows:
        if proc.poll() is not None:
            raise SystemExit(f"bench_resume: the job ended before step {rows - 1}: see {run_dir / 'logs'}")
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_resume: no step {rows - 1} within {timeout_s:.0f} s")
        time.sleep(0.02)
    return time.monotonic()


def _kill_nereusd(run_dir: Path, launcher: subprocess.Popen) -> None:
    os.kill(json.loads((run_dir / "nereusd.json").read_text())["pid"], signal.SIGKILL)
    launcher.communicate(timeout=120)


def _launch(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _crash_and_resume(run_dir: Path, launcher: subprocess.Popen, after_rows: int, *extra: str):
    """Kill nereusd once ``after_rows`` rows are in, resume (with ``extra``); returns the new
    launcher and ``(seconds to the interrupted step's row, steps re-run before it, mode)``."""
    _wait_rows(run_dir, after_rows, launcher)
    _kill_nereusd(run_dir, launcher)
    committed = _rows(run_dir)
    start = time.monotonic()
    resumed = _launch("resume", str(run_dir), "--quiet", *extra)
    done = _wait_rows(run_dir, committed + 1, resumed)
    record = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "nereusd_resumed"][-1]
    return resumed, (done - start, committed - int(record["step"]), record.get("mode", "checkpoint"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=str(REPO / "examples" / "counting_grpo.yaml"))
    parser.add_argument("--first", type=int, default=8, help="steps committed before the first kill (default 8)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args(argv)
    every = 5
    second = args.first + every
    if args.first < 1:
        parser.error(f"--first: expected at least 1 step before the first kill, got {args.first}")
    try:   # before launching anything (nereus-launch runs in REPO: a relative --job is relative to it)
        steps = load_job(REPO / args.job).steps
    except ConfigError as err:
        parser.error(f"--job: {err}")
    if steps <= every + 1:
        parser.error(f"--job: {Path(args.job).name} runs {steps} steps; the two kills need at least {every + 2}")
    if second >= steps:   # the job must still be running after the second kill's step
        parser.error(f"--first: expected below {steps - every} ({Path(args.job).name} runs {steps} steps; the second "
                     f"kill comes {every} steps after the first), got {args.first}")
    tmp = Path(tempfile.mkdtemp(prefix="nereus-bench-resume-"))
    run_dir = tmp / "run"
    launcher = _launch("local", args.job, "--run-dir", str(run_dir), "--quiet")
    try:
        launcher, kept = _crash_and_resume(run_dir, launcher, args.first)
        print(f"kill -9 after step {args.first - 1}, resume ({kept[2]}): step {args.first} done {kept[0]:.1f} s after "
              f"the command; {kept[1]} step(s) re-run before it", flush=True)
        launcher, restart = _crash_and_resume(run_dir, launcher, second, "--restart")
        print(f"kill -9 after step {second - 1}, resume --restart ({restart[2]}): step {second} done {restart[0]:.1f} s "
              f"after the command; {restart[1]} step(s) re-run before it", flush=True)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.communicate(timeout=120)
        if not args.keep:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
        else:
            print(f"run directory: {run_dir}")
    if kept[2] != "kept_workers":
        print(f"note: the first resume did not keep the workers ({kept[2]}): see the workers_kept event")
    print(f"resume: kept workers {kept[0]:.1f} s vs checkpoint restart {restart[0]:.1f} s to the interrupted step "
          f"({restart[0] / kept[0]:.1f}x); steps re-run {kept[1]} vs {restart[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
