"""The benchmark scripts refuse bad arguments up front: argparse's one-line ``error:`` and exit
status 2, before any work starts (nothing on stdout), never a traceback. Each case runs the
script as a subprocess; the scripts chosen import in about a second."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO

BAD = [
    ("bench_control", ["--agents", "0"], "--agents"),
    ("bench_control", ["--procs", "0"], "--procs"),
    ("bench_control", ["--model", "nope"], "--model"),
    ("bench_dag", ["--cases", "0"], "--cases"),
    ("bench_dag", ["--tick-us", "0"], "--tick-us"),
    ("bench_dag", ["--site", "nope"], "--site"),
    ("bench_planner", ["--repeats", "0"], "--repeats"),
    ("bench_resume", ["--first", "0"], "--first"),
    ("bench_resume", ["--job", "/nonexistent/job.yaml"], "--job"),
    ("fuzz_protocol", ["--cases", "0"], "--cases"),
    ("chaos", ["--trials", "0"], "--trials"),
    ("tune_rl", ["--group", "0"], "--group"),
    ("bench_microbatch", ["--trace", "nope"], "--trace"),
    ("bench_zero", ["--batch", "3"], "--batch"),
    ("bench_generation", ["--tp", "0"], "--tp"),
    ("bench_adaptive", ["--curriculum", "0:24,48"], "--curriculum"),
    ("bench_adaptive", ["--curriculum", "5:24"], "--curriculum"),
    ("bench_adaptive", ["--curriculum", "0:48,10:24"], "--curriculum"),
    ("bench_adaptive", ["--curriculum", "0:24,10:500"], "--curriculum"),
    ("bench_adaptive", ["--curriculum", "0:24,30:48"], "--curriculum"),   # not below --steps 30
    ("bench_sim", ["--seeds", "0"], "--seeds"),
]


def _run(script: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"scripts/{script}.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("script, args, option", BAD, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD])
def test_a_bad_argument_is_a_usage_error(script, args, option):
    proc = _run(script, args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if f"{script}.py: error:" in line]
    assert len(errors) == 1 and option in errors[0], proc.stderr[-2000:]
    assert proc.stdout == ""   # refused before it started anything


def test_bench_engine_tp_help_prints_the_usage_instead_of_running():
    proc = _run("bench_engine_tp", ["--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: bench_engine_tp.py") and "DTensor" in proc.stdout
    assert "ms, hand-written" not in proc.stdout
