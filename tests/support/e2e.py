"""Helpers of the end-to-end tests: job files, launching ``nereus-launch local``, waiting on
the run directory, and processes left behind."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from nereusd.journal import read_jsonl
from tests.support import REPO

WARMSTART = REPO / "examples" / "models" / "counting-warmstart"


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(cmdline)
    return found


def write_job(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace("@WARMSTART@", str(WARMSTART)))
    return path


def start(job: Path, run_dir: Path, tmp_dir: Path | None = None) -> subprocess.Popen:
    """``nereus-launch local`` the job; ``tmp_dir``: the TMPDIR of it and all it starts."""
    env = None if tmp_dir is None else {**os.environ, "TMPDIR": str(tmp_dir)}
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "local", str(job), "--run-dir", str(run_dir),
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=env)


@contextlib.contextmanager
def running(job: Path, run_dir: Path) -> Iterator[subprocess.Popen]:
    """:func:`start` the job; on leaving (a failed wait or assertion included) kill it if it
    still runs, so no test leaves a job behind."""
    proc = start(job, run_dir)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def finish(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 420) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    log = (run_dir / "logs" / "nereusd.log")
    assert proc.returncode == 0, out + (log.read_text()[-4000:] if log.exists() else "")
    return out


def run_fixed_and_switched(tmp_path: Path, template: str, forced: str) -> tuple[list[dict], list[dict]]:
    """Run ``template`` without adaptation and with the ``forced`` switches, side by side;
    returns both runs' metrics records."""
    fixed = write_job(tmp_path, "fixed", template.replace("@ENABLED@", "false").replace("@FORCED@", "[]"))
    switched = write_job(tmp_path, "switched", template.replace("@ENABLED@", "true").replace("@FORCED@", forced))
    procs = [(start(fixed, tmp_path / "fixed"), tmp_path / "fixed"),
             (start(switched, tmp_path / "switched"), tmp_path / "switched")]
    for proc, run_dir in procs:
        finish(proc, run_dir)
    return read_jsonl(tmp_path / "fixed" / "metrics.jsonl"), read_jsonl(tmp_path / "switched" / "metrics.jsonl")


def assert_trains_alike(a: list[dict], b: list[dict]) -> None:
    """Per step: the same samples, rewards and lengths; losses within reduction tolerance."""
    for x, y in zip(a, b):
        assert x["sample_position"] == y["sample_position"]
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], rel=1e-6, abs=1e-9), x["step"]
        assert x["response_length_mean"] == y["response_length_mean"], x["step"]
        for key in ("train/actor/loss", "train/actor/grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-3, abs=1e-5), (x["step"], key)


def worker_pid(run_dir: Path, device: int) -> int:
    """The pid of the live worker process of ``device`` in ``run_dir``'s job (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "emu.worker" in args and str(run_dir.resolve()) in args and args[args.index("--device") + 1] == str(device):
            return int(entry.name)
    raise AssertionError(f"no worker process of device {device} found")


def wait_for(what: str, check, timeout_s: float, run_dir: Path | None = None, interval_s: float = 0.05):
    """Poll ``check()`` every ``interval_s`` until it returns something true (returned), at most
    ``timeout_s``.

    Raises:
        AssertionError: on timeout, with the tails of the run directory's logs.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    logs = ""
    if run_dir is not None:
        for log in sorted((run_dir / "logs").glob("*")):
            logs += f"\n--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{logs}")

def assert_join_decided(events: list[dict], records: list[dict], device: int) -> None:
    """At the boundary where ``device`` joined, payback admission either used it (an admitted
    switch, and the next steps run on it) or kept the running plan because that is the cheapest
    over ``H_x``: every target's ``L̂_step·H_x + L̂_tran`` at least ``L̂_step(S)·H_x``, and the
    device stays a spare for the next step."""
    (change,) = [e for e in events if e["event"] == "pool_changed" and device in e.get("joined", [])
                 and "step" in e]
    (decision,) = [e for e in events if e["event"] == "admission" and e["step"] == change["step"]]
    assert decision["urgent"] and any(t["signal"] == "gpu_pool" for t in decision["triggers"]), decision
    after = [r for r in records if r["step"] > change["step"]]
    if decision["verdict"] == "keep":
        keep_s = decision["current_step_latency_s"] * decision["h_x"]
        assert decision["alternatives"] and all(a["step_latency_s"] * decision["h_x"] + a["l_tran_s"] >= keep_s
                                                for a in decision["alternatives"]), decision
        assert after and str(device) not in after[0]["peak_memory_bytes"]
    else:
        assert decision["verdict"] == "admit", decision
        assert after and str(device) in after[0]["peak_memory_bytes"]
