"""Chaos trials against local jobs (issue 17): faults injected into running jobs, each job checked
against an undisturbed run of the same job.

Fault types (one long job each absorbs ``--trials`` faults in sequence):

- ``worker_kill``: SIGKILL a worker of the plan mid-step; then ``pool --add 1`` restores the pool.
- ``transition_kill``: ``pool --add 1``, and SIGKILL a worker as soon as nereusd journals the
  join, while the world re-forms and the plan moves onto the new device.
- ``agent_kill``: ``pool --add 1`` (an agent of its own), and once its device is in the world,
  SIGKILL that agent (its worker follows: a node lost).
- ``nereusd_kill``: SIGKILL nereusd; the launcher writes a ``crashed`` summary; then
  ``nereus-launch resume``.
- ``sigstop``: SIGSTOP a worker of the plan; the agent's watchdog (``liveness.worker_stall_s``,
  4 s in this script's site) kills it; then ``pool --add 1``.
- ``disk_full``: the run directory is a small tmpfs (a file in the checkpoint's way where
  mounting is not allowed); fill it before a checkpoint, expect a clean ``StorageFault`` stop
  with the previous checkpoint whole, free the space and ``nereus-launch resume``.

A trial counts as **recovered** when the job went on by itself (a ``fallback`` or spare
``device_lost``, or ``resume`` after a crash), a **clean stop** when it stopped with a storage
fault and its latest checkpoint verified. At the end of each job: ``summary.json`` succeeded,
every step in ``metrics.jsonl`` once with the reference's sample positions (no sample lost or
repeated), rewards and lengths equal and losses within 1e-3 relative; a job that fails these
counts its trials as **lost data**. **Leftover processes** are those still naming the run
directory after its job ended. Generation runs on the native engine here (restarts take seconds,
not a vLLM engine start each); the control plane, agents, workers and recovery are the real ones.
Added devices join at once (``pool.join: immediate``): the trials time their faults against the
join, and a background join (the default) of a few seconds outlasted the fast subset's 18-step
jobs, which then ended with the fault not injected (``agent_kill`` and ``transition_kill``, and the
fast subset's exit status 1, on 2026-12-06). Background joins under faults: the unit tests of
:mod:`nereusd.daemon.joins` and ``tests/e2e/test_pool_cmd.py``, ``test_vllm_generation.py``.

    python scripts/chaos.py                     # 25 trials of each of the 6 types (150)
    python scripts/chaos.py --trials 1          # the fast subset (.ci/run)

Last line: ``chaos: <n> trials; recovered <r>; clean stops <s>; lost data <l>; leftover processes <p>``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from emu.state.checkpoint import verify_checkpoint  # noqa: E402
from launcher.procs import run_processes  # noqa: E402
from nereusd.errors import StorageError  # noqa: E402
from nereusd.journal import read_jsonl  # noqa: E402
from tests.support.e2e import WARMSTART, processes_mentioning  # noqa: E402

FAULTS = ("worker_kill", "transition_kill", "agent_kill", "nereusd_kill", "sigstop", "disk_full")

JOB = """
name: chaos-{fault}
algorithm: grpo
seed: 11
steps: {steps}
devices: 3
site: {site}
models: {{actor: "{model}"}}
backends: {{actor/generation: native}}
rollout: {{prompts_per_step: 3, group_size: 4, max_new_tokens: 8}}
train: {{global_batch: 12, micro_batch: 2, kl_coef: 0.0}}
plan: {{default: {{tp: 1, pp: 1}}}}
checkpoint: {{every_steps: 2}}
pool: {{join: immediate}}
"""


@dataclass
class Tally:
    trials: int = 0
    recovered: int = 0
    clean_stops: int = 0
    lost: int = 0
    leftovers: int = 0
    notes: list[str] = field(default_factory=list)


def say(text: str) -> None:
    print(f"chaos: {text}", flush=True)


def launch(job: Path, run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "local", str(job), "--run-dir", str(run_dir),
                             "--quiet"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def resume(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "resume", str(run_dir), "--quiet"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def pool_add(run_dir: Path) -> bool:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "pool", str(run_dir), "--add", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    if out.returncode and "has ended" not in out.stderr:   # a job that just ended is no fault of the pool
        say(f"pool --add 1 failed: {out.stderr.strip()[-300:]}")
    return out.returncode == 0


def events(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "events.jsonl")


def steps_done(run_dir: Path) -> int:
    return len(read_jsonl(run_dir / "metrics.jsonl"))


def wait(what: str, check, timeout_s: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(check())
        time.sleep(0.05)
    say(f"timed out after {timeout_s:.0f} s waiting for {what}")
    return False


def count(run_dir: Path, event: str, **match) -> int:
    return sum(1 for e in events(run_dir) if e["event"] == event and all(e.get(k) == v for k, v in match.items()))


def world(run_dir: Path) -> list[int]:
    formed = [e["devices"] for e in events(run_dir) if e["event"] == "world_formed"]
    return formed[-1] if formed else []


def plan_devices(run_dir: Path) -> list[int]:
    records = read_jsonl(run_dir / "metrics.jsonl")
    if not records:
        return world(run_dir)
    return sorted({d for c in records[-1]["plan"].values() for d in c["devices"]})


def pids(run_dir: Path, module: str) -> dict[str, int]:
    """``{"--device N" or "--node-id X": pid}`` of the live ``module`` processes of ``run_dir``."""
    flag = "--device" if module == "emu.worker" else "--node-id"
    return {args[args.index(flag) + 1]: pid for pid, args in run_processes(run_dir, (module,)).items()
            if flag in args}


def progressed(run_dir: Path, since: int, steps: int, total: int) -> bool:
    return steps_done(run_dir) >= min(since + steps, total)


def recovery_count(run_dir: Path) -> int:
    return count(run_dir, "fallback", action="checkpoint_restart") + sum(
        1 for e in events(run_dir) if e["event"] == "device_lost" and e.get("spare"))


def restore_pool(run_dir: Path, proc: subprocess.Popen) -> None:
    """Add a device and wait until the world has 3 again (the job may also end first)."""
    if proc.poll() is not None or not pool_add(run_dir):
        return
    wait("the added device in the world", lambda: len(world(run_dir)) >= 3 or proc.poll() is not None, 120, proc)


# ----------------------------------------------------------------------------------- faults
def trial(fault: str, run_dir: Path, proc: subprocess.Popen, rng: random.Random, tally: Tally,
          total: int) -> subprocess.Popen:
    """Inject one fault into the running job (of ``total`` steps); returns the process now
    supervising it."""
    start_steps = steps_done(run_dir)
    if not wait("progress", lambda: progressed(run_dir, start_steps, 3, total) or proc.poll() is not None, 180,
                proc):
        return proc
    if proc.poll() is not None:
        return proc
    before = recovery_count(run_dir)
    if fault in ("worker_kill", "sigstop"):
        victims = [d for d in plan_devices(run_dir) if str(d) in pids(run_dir, "emu.worker")]
        if not victims:
            return proc
        pid = pids(run_dir, "emu.worker")[str(rng.choice(victims))]
        os.kill(pid, signal.SIGKILL if fault == "worker_kill" else signal.SIGSTOP)
        ok = wait("recovery", lambda: recovery_count(run_dir) > before, 120, proc)
        tally.recovered += ok
        restore_pool(run_dir, proc)
    elif fault == "transition_kill":
        def joins() -> int:   # the boundary's re-plan onto the joined device (not the registration)
            return sum(1 for e in events(run_dir) if e["event"] == "pool_changed" and e.get("joined"))
        joined = joins()
        if not pool_add(run_dir):
            return proc
        wait("the join", lambda: joins() > joined, 120, proc)
        workers: dict[str, int] = {}
        wait("a worker to kill", lambda: bool(workers.update(pids(run_dir, "emu.worker")) or workers), 30, proc)
        if not workers:
            return proc
        victims = [d for d in world(run_dir) if str(d) in workers] or [int(d) for d in workers]
        try:
            os.kill(workers[str(rng.choice(victims))], signal.SIGKILL)
        except ProcessLookupError:   # it had just exited (a re-formation restarts workers)
            pass
        ok = wait("recovery", lambda: recovery_count(run_dir) > before, 120, proc)
        tally.recovered += ok
        if len(world(run_dir)) < 3:
            restore_pool(run_dir, proc)
    elif fault == "agent_kill":
        agents = set(pids(run_dir, "emu.agent"))
        if not pool_add(run_dir):
            return proc
        wait("the new agent's device in the world", lambda: len(world(run_dir)) >= 4 or proc.poll() is not None,
             120, proc)
        new = [n for n in pids(run_dir, "emu.agent") if n not in agents]
        if new:
            os.kill(pids(run_dir, "emu.agent")[new[0]], signal.SIGKILL)
            ok = wait("recovery", lambda: recovery_count(run_dir) > before, 120, proc)
            tally.recovered += ok
    elif fault == "nereusd_kill":
        pid = json.loads((run_dir / "nereusd.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=120)
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary.get("status") == "crashed":
            proc = resume(run_dir)
            tally.recovered += 1
    elif fault == "disk_full":
        proc = _disk_full(run_dir, proc, tally)
    tally.trials += 1
    return proc


def _disk_full(run_dir: Path, proc: subprocess.Popen, tally: Tally) -> subprocess.Popen:
    filler = run_dir / "filler"
    step = steps_done(run_dir)
    blocker = None
    if os.path.ismount(run_dir):
        free = shutil.disk_usage(run_dir).free
        with open(filler, "wb") as fh:   # leave 512 KiB: a metrics line fits, a checkpoint does not
            fh.truncate(0)
            chunk = b"\0" * (1 << 20)
            left = max(0, free - (1 << 19))
            while left > 0:
                n = min(len(chunk), left)
                try:
                    fh.write(chunk[:n])
                except OSError:
                    break
                left -= n
    else:   # no mount allowed: a file where the next periodic checkpoint's directory goes
        nxt = step + (2 - step % 2) if step % 2 else step + 2
        blocker = run_dir / "checkpoints" / f"step{nxt:06d}.partial"
        blocker.parent.mkdir(exist_ok=True)
        blocker.write_text("in the way")
    proc.communicate(timeout=240)
    summary = json.loads((run_dir / "summary.json").read_text())
    latest = [e for e in events(run_dir) if e["event"] == "checkpoint"]
    try:
        intact = bool(latest) and verify_checkpoint(Path(latest[-1]["dir"]) / "actor") > 0
    except StorageError:
        intact = False
    if summary.get("status") == "succeeded":   # the job ended before the fault mattered
        filler.unlink(missing_ok=True)
        return proc
    if summary.get("error_kind") == "StorageFault" and intact:
        tally.clean_stops += 1
    else:
        tally.notes.append(f"disk_full: stopped as {summary.get('status')}/{summary.get('error_kind')}, "
                           f"checkpoint intact: {intact}")
    filler.unlink(missing_ok=True)
    if blocker is not None:
        blocker.unlink(missing_ok=True)
    return resume(run_dir)


# ----------------------------------------------------------------------------------- jobs
def compare(run_dir: Path, reference: list[dict], steps: int) -> list[str]:
    """What is wrong with a finished job against the undisturbed reference ([] when nothing)."""
    problems = []
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        return [f"no summary: {err}"]
    if summary.get("status") != "succeeded":
        problems.append(f"status {summary.get('status')}: {summary.get('error', '')[:200]}")
    records = read_jsonl(run_dir / "metrics.jsonl")
    if [r["step"] for r in records] != list(range(steps)):
        problems.append(f"steps in metrics.jsonl: {[r['step'] for r in records][:12]}... (want 0..{steps - 1} once)")
        return problems
    for r, ref in zip(records, reference):
        if r["sample_position"] != ref["sample_position"]:
            problems.append(f"step {r['step']}: sample position {r['sample_position']} != {ref['sample_position']}")
        if r["reward_mean"] != ref["reward_mean"] or r["response_length_mean"] != ref["response_length_mean"]:
            problems.append(f"step {r['step']}: reward {r['reward_mean']} vs {ref['reward_mean']}")
        a, b = r["train/actor/loss"], ref["train/actor/loss"]
        if abs(a - b) > 1e-3 * abs(b) + 1e-5:
            problems.append(f"step {r['step']}: loss {a} vs {b}")
    return problems


def run_fault(fault: str, root: Path, site: Path, steps: int, trials: int, reference: list[dict],
              rng: random.Random, tally: Tally, mount: bool) -> None:
    job = root / f"{fault}.yaml"
    job.write_text(JOB.format(fault=fault, steps=steps, site=site, model=WARMSTART))
    run_dir = root / fault
    mounted = False
    if fault == "disk_full" and mount:
        run_dir.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(run_dir)],
                                 capture_output=True).returncode == 0
        if not mounted:
            run_dir.rmdir()
    before = Tally()
    start = time.monotonic()
    proc = launch(job, run_dir)
    done = 0
    while done < trials and proc.poll() is None:
        try:
            proc = trial(fault, run_dir, proc, rng, before, steps)
        except Exception as err:  # noqa: BLE001 - a fault of this script: say so, go on with the job
            before.notes.append(f"{fault}: trial {done} not injected: {type(err).__name__}: {err}")
        done += 1
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out = "(killed after 600 s)"
    problems = compare(run_dir, reference, steps)
    leftover = processes_mentioning(str(run_dir.resolve()))
    tally.trials += before.trials
    tally.recovered += before.recovered
    tally.clean_stops += before.clean_stops
    tally.notes += before.notes
    tally.leftovers += len(leftover)
    if problems:
        tally.lost += before.trials
        tally.notes.append(f"{fault}: {'; '.join(problems[:5])}")
    say(f"{fault}: {before.trials} trials, recovered {before.recovered}, clean stops {before.clean_stops}, "
        f"{'correct' if not problems else 'WRONG: ' + problems[0]}, leftover {len(leftover)}, "
        f"{time.monotonic() - start:.0f} s" + (" (tmpfs run dir)" if mounted else ""))
    if problems:
        say(out[-1500:])
    if mounted:
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=25, help="trials per fault type (default 25)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    parser.add_argument("--steps", type=int, default=None, help="steps per job (default 8 per trial + 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--no-mount", action="store_true", help="disk_full without a tmpfs (a file in the way)")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials: expected at least 1, got {args.trials}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps: expected at least 1, got {args.steps}")
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown fault types {unknown} (known: {', '.join(FAULTS)})")
    if not faults:
        parser.error(f"--faults: expected at least one of {', '.join(FAULTS)}")
    steps = args.steps or 8 * args.trials + 10
    root = Path(tempfile.mkdtemp(prefix="nereus-chaos-"))
    site = root / "local-chaos.yaml"
    text = (REPO / "site_configs" / "local.yaml").read_text()
    site.write_text(text.replace("worker_stall_s: 60", "worker_stall_s: 4").replace("name: local", "name: local-chaos"))
    rng = random.Random(args.seed)
    started = time.monotonic()
    say(f"reference run: {steps} steps, undisturbed")
    ref_job = root / "reference.yaml"
    ref_job.write_text(JOB.format(fault="reference", steps=steps, site=site, model=WARMSTART))
    ref = launch(ref_job, root / "reference")
    out, _ = ref.communicate(timeout=1800)
    if ref.returncode != 0:
        say(f"the reference run failed:\n{out[-2000:]}")
        return 1
    reference = read_jsonl(root / "reference" / "metrics.jsonl")
    tally = Tally()
    for fault in faults:
        run_fault(fault, root, site, steps, args.trials, reference, rng, tally, mount=not args.no_mount)
    for note in tally.notes:
        say(f"note: {note}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    say(f"{time.monotonic() - started:.0f} s in all")
    print(f"chaos: {tally.trials} trials; recovered {tally.recovered}; clean stops {tally.clean_stops}; "
          f"lost data {tally.lost}; leftover processes {tally.leftovers}")
    return 0 if tally.lost == 0 and tally.leftovers == 0 and tally.recovered + tally.clean_stops == tally.trials else 1


if __name__ == "__main__":
    sys.exit(main())
