"""Load-test nereusd's control plane: one :class:`~nereusd.daemon.control_plane.ControlPlane` (the
real ROUTER socket, decoder, registry and dispatch, in this process) against simulated agents on
loopback — 1,024 agents of 8 devices each (8,192 workers) by default, in ``--procs`` processes.

A simulated agent speaks the real agent protocol on the wire: it registers, heartbeats every
second, and answers every frame of tasks for its devices (``ToWorkers``, one per agent and task)
with one ``FromWorkers`` frame of results carrying a metrics dict, as the agent relays the
results of instant workers. It only parses the JSON and fills a pre-encoded result: on a
cluster each agent validates and relays its own frames on its own node, in parallel, while here
1,024 of them would share nereusd's two cores (one real agent's relay of one frame is timed and
printed apart). So what is timed is nereusd's share of a safe boundary plus the loopback round
trip:

- **step**: dispatch the next step's generation task to every device (prompts per replica) and
  collect every result (``submit`` + ``collect``);
- **transition**: dispatch a real transition DAG — ``plan_transition`` for the actor training
  model-stage of ``--model`` going from dp N/2 to dp N — as the transition runner does
  (``TransitionRunner.run_ops``): ``transition_prepare`` to every worker of the world (each its
  slice and its ops of the first ready set; the communicator plan and the plans once per agent
  frame), then every later ready set as one ``transition_run``, each collected. The
  ``transition_finish`` after them builds the target plan's engines, a step-like task, and is
  not dispatched.

Building the step's task arguments (one validated ``GenerateArgs`` per device, with its prompts)
is the RL driver's work, and building every worker's ``transition_prepare`` args
(:func:`~nereusd.transition.runner.prepare_task`) the transition runner's, not the control
plane's: both are timed apart, before each boundary, and printed with the boundary they would
make (an earlier version of this script timed the step's inside the boundary). The control plane's CPU time per boundary (this process: ZeroMQ's I/O thread included)
is printed beside its wall time.

Once the agents registered and the transition DAG is built, the set-up heap is frozen
(:func:`~nereusd.heap.settle_heap`), as nereusd does once its world is formed.

A boundary is one step plus, every ``--transition-every`` boundaries, one transition; the first
``--warmup`` boundaries (first use of every socket and buffer) are printed and not counted.
Lost messages are what the simulated agents sent minus what the control plane received
(registrations, heartbeats, results). The planner's solve time for the same pool is measured
separately (not part of a boundary). RSS is this process's peak.

    python scripts/bench_control.py                  # 1,024 agents, 8,192 workers
    python scripts/bench_control.py --agents 64      # a quick run

Last line: ``control: <a> agents <w> workers; boundary p99 <t> ms; lost <l>; rss <m> MiB``.
Target (issue 17): t < 1,000 and l = 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq  # noqa: E402

from nereusd import protocol as P  # noqa: E402

MAX_SOCKETS = 8192
TASK_IDS = re.compile(rb'"type":"to_worker","device":(\d+),"task":\{"v":1,"type":"task","task_id":(\d+),')
"""The device and task id of every item of a ``to_workers`` frame (as ``encode_to_workers`` writes it)."""


def raise_limits(sockets: int) -> None:
    """Raise the open-file limit to its hard maximum and ZeroMQ's socket limit: 1,024 sockets
    exceed both defaults (1,024 files, 1,023 sockets).

    Raises:
        SystemExit: the hard open-file limit is below what ``sockets`` need.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = sockets * 2 + 256
    if hard != resource.RLIM_INFINITY and hard < want:
        raise SystemExit(f"bench_control: the hard open-file limit is {hard}; {want} needed (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want) if hard == resource.RLIM_INFINITY else hard, hard))
    zmq.Context.instance().set(zmq.MAX_SOCKETS, max(MAX_SOCKETS, sockets + 64))


# ------------------------------------------------------------------------------ simulated agents
def serve_agents(endpoint: str, first: int, count: int, devices: int) -> None:
    """Run agents ``first .. first+count-1`` until nereusd says shut down; print what was sent."""
    raise_limits(count)
    ctx = zmq.Context.instance()
    socks, sent, received = [], 0, 0
    poller = zmq.Poller()
    for i in range(first, first + count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.IDENTITY, f"agent-sim{i}".encode())
        sock.connect(endpoint)
        sock.send(P.encode(P.RegisterAgent(node_id=f"sim{i}", hostname="loopback", pid=os.getpid(), devices=[
            P.DeviceInfo(local_index=d, kind="cpu", name="simulated", memory_bytes=2**30) for d in range(devices)])))
        sent += 1
        socks.append(sock)
        poller.register(sock, zmq.POLLIN)
    node_of = {sock: f"sim{i}" for i, sock in zip(range(first, first + count), socks)}
    next_beat = {sock: time.monotonic() + (k % 100) / 100 for k, sock in enumerate(socks)}
    metrics = {"loss": 0.1, "grad_norm": 1.0, "entropy": 2.0, "kl": 0.01, "clip_frac": 0.1, "lr": 1e-6}
    # one relayed result as the real agent encodes it, the devices and the task id left open
    result = P.encode(P.FromWorker(device=0, payload=P.TaskResult(task_id=1, device=2, ok=True,
                                                                 result={"metrics": metrics}, elapsed_s=0.001)))
    result = result.replace(b"%", b"%%").replace(b'"device":0', b'"device":%d', 1) \
        .replace(b'"task_id":1', b'"task_id":%d', 1).replace(b'"device":2', b'"device":%d', 1)
    running, stopped = True, 0
    while running:
        for sock, _ in poller.poll(50):
            while running:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                received += 1
                # the agents' own parsing is not nereusd's share (docstring): find the items' ids
                tasks = TASK_IDS.findall(frame)
                if tasks:   # a to_workers frame: answered as the agent relays instant workers' results
                    sock.send(b'{"v":1,"type":"from_workers","items":[' + b",".join(
                        result % (int(d), int(t), int(d)) for d, t in tasks) + b"]}")
                    sent += 1
                elif b'"type":"shutdown"' in frame[:40]:
                    stopped += 1
                    running = stopped < count
        now = time.monotonic()
        for sock in socks:
            if now >= next_beat[sock]:
                sock.send(P.encode(P.Heartbeat(node_id=node_of[sock], workers_alive=[])))
                sent += 1
                next_beat[sock] = now + 1.0
    print(json.dumps({"sent": sent, "received": received}), flush=True)
    for sock in socks:
        sock.close()


# ------------------------------------------------------------------------------ the boundary
def step_args(devices: list[int], prompts_per_device: int) -> dict[int, P.GenerateArgs]:
    return {d: P.GenerateArgs(model_stage="actor/generation", prompts=[[1] * 256] * prompts_per_device,
                              max_new_tokens=1024, temperature=1.0, greedy=False, stop_ids=[2], pad_id=0,
                              seed=d, seeds=list(range(prompts_per_device)))
            for d in devices}


def transition_dag(model: str, devices: int):
    """The real DAG of the actor training model-stage of ``model`` going from dp devices/2 to dp
    devices (tp 1), and its JSON."""
    from nereusd.models import preset
    from nereusd.plan import Candidate, ModelStage, Plan, Role
    from nereusd.transition import plan_transition

    ms = ModelStage.parse("actor/training")
    half = max(1, devices // 2)
    current = Plan({ms: Candidate(tp=1, pp=1, dp=half, devices=tuple(range(half)), micro_batch=1)})
    target = Plan({ms: Candidate(tp=1, pp=1, dp=devices, devices=tuple(range(devices)), micro_batch=1)})
    dag = plan_transition(current, target, {Role.ACTOR: preset(model)}, devices_per_node=8, check=False)
    return dag, dag.to_json()


def dispatch_transition(control, world: list[int], dag, prepared) -> None:
    """What :class:`~nereusd.transition.runner.TransitionRunner` sends for the DAG's ops (its
    :meth:`~nereusd.transition.runner.TransitionRunner.run_ops`): ``transition_prepare`` to
    every worker (its slice of the DAG and its ops of the first ready set; the communicator plan
    and the plans once per agent, ``prepared`` = :func:`~nereusd.transition.runner.prepare_task`),
    then every later ready set as ``transition_run``, each collected. Its ``transition_finish``
    (the target plan's engines built, like a step's task) is not dispatched."""
    from nereusd.transition.runner import TransitionProgress, TransitionRunner

    TransitionRunner(control, world, timeout_s=120).run_ops(dag, TransitionProgress(), prepared)


def planner_solve_s(devices: int) -> float | None:
    """Seconds of one planner solve for PPO on Llama-3.1-8B over ``devices`` H200s (reported
    beside the boundary, not in it)."""
    from nereusd.cost.model import CostModel
    from nereusd.planner.search import Infeasible, Planner
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_planner import make_problem

    problem = make_problem("h200-ib", "llama-3.1-8b", devices, 2048)
    start = time.perf_counter()
    try:
        Planner(problem, CostModel(problem.site)).solve()
    except Infeasible:
        return None
    return time.perf_counter() - start


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse out-of-range options and an unknown ``--model`` before any agent starts."""
    from nereusd.errors import ConfigError
    from nereusd.models import preset

    for option, value, least in (("--agents", args.agents, 1), ("--devices-per-agent", args.devices_per_agent, 1),
                                 ("--boundaries", args.boundaries, 1), ("--warmup", args.warmup, 0),
                                 ("--transition-every", args.transition_every, 0),
                                 ("--prompts-per-device", args.prompts_per_device, 1), ("--procs", args.procs, 1)):
        if value < least:
            parser.error(f"{option}: expected at least {least}, got {value}")
    if not math.isfinite(args.max_dag_gib) or args.max_dag_gib < 0:
        parser.error(f"--max-dag-gib: expected a finite size of 0 or more GiB, got {args.max_dag_gib}")
    try:
        preset(args.model)
    except ConfigError as err:
        parser.error(f"--model: {err}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=1024)
    parser.add_argument("--devices-per-agent", type=int, default=8)
    parser.add_argument("--boundaries", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=1,
                        help="boundaries run first and left out of the percentiles (printed apart; default 1)")
    parser.add_argument("--transition-every", type=int, default=5, help="a transition every N boundaries (0: none)")
    parser.add_argument("--model", default="counting-tiny",
                        help="model of the transition DAG (default counting-tiny; a preset name)")
    parser.add_argument("--prompts-per-device", type=int, default=4)
    parser.add_argument("--max-dag-gib", type=float, default=0.5,
                        help="leave transitions out when their prepare messages to all workers exceed this "
                        "(default 0.5)")
    parser.add_argument("--procs", type=int, default=4, help="processes the simulated agents run in")
    parser.add_argument("--no-planner", action="store_true", help="skip the planner solve-time measurement")
    parser.add_argument("--serve-agents", nargs=4, type=str, metavar=("ENDPOINT", "FIRST", "COUNT", "DEVICES"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_agents:
        endpoint, first, count, devices = args.serve_agents
        serve_agents(endpoint, int(first), int(count), int(devices))
        return 0
    check_args(parser, args)

    from nereusd.daemon.control_plane import ControlPlane

    raise_limits(args.agents)
    workers = args.agents * args.devices_per_agent
    control = ControlPlane("tcp://127.0.0.1:0", heartbeat_timeout_s=60.0, max_devices_per_agent=args.devices_per_agent)
    print(f"bench_control: {args.agents} agents x {args.devices_per_agent} devices in {args.procs} processes",
          flush=True)
    per = -(-args.agents // args.procs)
    procs = []
    for first in range(0, args.agents, per):
        count = min(per, args.agents - first)
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-agents", control.endpoint, str(first),
                                       str(count), str(args.devices_per_agent)],
                                      stdout=subprocess.PIPE, text=True))
    try:
        return _measure(args, control, procs, workers)
    finally:
        for proc in procs:   # simulators of a failed run must not poll on
            if proc.poll() is None:
                proc.kill()


def _measure(args: argparse.Namespace, control, procs: list[subprocess.Popen], workers: int) -> int:
    from nereusd.heap import settle_heap

    start = time.monotonic()
    world = control.wait_for_devices(workers, timeout_s=300)
    print(f"bench_control: {len(control.agents)} agents registered {len(world)} devices in "
          f"{time.monotonic() - start:.1f} s", flush=True)
    dag = None
    if args.transition_every:
        import emu.state.executor  # noqa: F401 - imports torch: set-up, not the first transition's dispatch
        from nereusd.transition.runner import first_ops, prepare_task

        dag, dag_json = transition_dag(args.model, workers)
        t0 = time.perf_counter()
        prepared_args, shared = prepare_task(dag, world, first_ops(dag))
        built_s = time.perf_counter() - t0
        shared_bytes = len(json.dumps(shared, separators=(",", ":")))
        slice_bytes = sum(len(a.dag) for a in prepared_args.values())
        total_gib = (shared_bytes * args.agents + slice_bytes) / 2**30
        print(f"bench_control: transition DAG ({args.model}, dp {workers // 2} -> {workers}): {len(dag.ops)} ops, "
              f"{len(dag_json) / 2**20:.2f} MiB whole; prepare: slices {slice_bytes / 2**20:.1f} MiB in all, the "
              f"communicator plan and plans {shared_bytes / 2**10:.0f} KiB once per agent, about {total_gib:.2f} GiB "
              f"per transition (the whole DAG to each worker would be {len(dag_json) * workers / 2**30:.1f} GiB); "
              f"built in {built_s * 1e3:.0f} ms", flush=True)
        if shared_bytes > P.MAX_MESSAGE_BYTES or total_gib > args.max_dag_gib:
            print(f"bench_control: transitions left out: {total_gib:.1f} GiB per transition (over --max-dag-gib "
                  f"{args.max_dag_gib:g} or the frame limit)", flush=True)
            dag = None
    settle_heap()   # set-up done, as nereusd does before its first step (its docstring has the why)
    warm_ms = []
    for _ in range(args.warmup):   # first use of every socket, schema and buffer: printed, not counted
        t0 = time.perf_counter()
        control.run(step_args(world, args.prompts_per_device), timeout_s=120)
        warm_ms.append((time.perf_counter() - t0) * 1e3)
    if warm_ms:
        print(f"bench_control: warm-up boundaries (not counted): {', '.join(f'{t:.0f}' for t in warm_ms)} ms",
              flush=True)
    step_ms, boundary_ms, transition_ms, cpu_ms, args_ms = [], [], [], [], []
    for b in range(args.boundaries):
        a0 = time.perf_counter()
        # the RL driver's part, timed apart: one validated GenerateArgs per device
        by_device = step_args(world, args.prompts_per_device)
        transition_due = dag is not None and (b + 1) % args.transition_every == 0
        # the transition runner's, likewise: every worker's slice (prepare_task)
        prepared = prepare_task(dag, world, first_ops(dag)) if transition_due else None
        t0, c0 = time.perf_counter(), time.process_time()
        args_ms.append((t0 - a0) * 1e3)
        control.run(by_device, timeout_s=120)
        t1 = time.perf_counter()
        step_ms.append((t1 - t0) * 1e3)
        if transition_due:
            dispatch_transition(control, world, dag, prepared)
            transition_ms.append((time.perf_counter() - t1) * 1e3)
        boundary_ms.append((time.perf_counter() - t0) * 1e3)
        cpu_ms.append((time.process_time() - c0) * 1e3)
        print(f"bench_control: boundary {b}: {boundary_ms[-1]:.0f} ms (step tasks {step_ms[-1]:.0f} ms; "
              f"this process on CPU {cpu_ms[-1]:.0f} ms; building the args before it {args_ms[-1]:.0f} ms)",
              flush=True)
    control.poll(1.5)   # the last heartbeats in flight
    control.shutdown_agents("benchmark done", wait_s=0.0)   # their dropped connections are expected now
    sent = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        sent += json.loads(out.strip().splitlines()[-1])["sent"]
    control.poll(0.5)
    lost = sent - control.received_messages
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    solve = None if args.no_planner else planner_solve_s(workers)
    control.close()

    def p99(xs: list[float]) -> float:
        return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) >= 2 else xs[0]   # within the data

    print(f"bench_control: step tasks p50 {statistics.median(step_ms):.0f} ms, p99 {p99(step_ms):.0f} ms; "
          f"transition dispatch {', '.join(f'{t:.0f} ms' for t in transition_ms) or 'none'}")
    print(f"bench_control: the control plane (this process, ZeroMQ I/O threads included) on CPU per boundary "
          f"p50 {statistics.median(cpu_ms):.0f} ms, p99 {p99(cpu_ms):.0f} ms")
    print(f"bench_control: building the step's {workers} GenerateArgs (the RL driver's part) and, before a "
          f"transition, every worker's prepare args (the transition runner's): not in a boundary, "
          f"p50 {statistics.median(args_ms):.0f} ms, max {max(args_ms):.0f} ms; boundary with it p99 "
          f"{p99([a + b for a, b in zip(args_ms, boundary_ms)]):.0f} ms")
    print(f"bench_control: messages sent by agents {sent}, received {control.received_messages}, "
          f"refused {control.refused_messages}")
    if solve is not None:
        print(f"bench_control: planner solve for {workers} GPUs (PPO, Llama-3.1-8B, h200-ib): {solve:.1f} s "
              "(not part of a boundary)")
    print(f"control: {args.agents} agents {workers} workers; boundary p99 {p99(boundary_ms):.0f} ms; lost {lost}; "
          f"rss {rss_mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
