"""``nereus-agent``: the per-node agent (one per node, started by ``srun`` or by local mode).

It registers the node's devices with nereusd (ZeroMQ DEALER), starts and supervises one
worker process per device, relays nereusd's tasks to its workers and their results back over
``ipc://`` sockets in a directory only the job's user can open, sends heartbeats, and reports
a worker that exits. It stops its workers when nereusd says so, on SIGTERM/SIGINT, or when
nereusd stops answering heartbeats for ``--daemon-timeout-s`` (the site's
``liveness.resume_grace_s``). Within that grace, a nereusd resumed in the same run directory
(a new ``nereusd.json``) gets the agent back with its workers and their EMUs in memory
(:meth:`Agent._rejoin`); it keeps them if their state is where the job's journal is, else it
restarts them from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from emu.inventory import discover
from emu.tmpdirs import (AGENT_SOCKET_BYTES, IPC_PATH_MAX_BYTES, MULTIPROCESSING_SOCKET_BYTES, SHORT_TMP,
                         agent_dir_prefix, inductor_cache_dir, private_dir, remove_orphaned_dirs)
from nereusd import protocol as P
from nereusd.errors import NereusError, ProtocolError
from nereusd.config.site import beat_interval_s
from nereusd.daemon.security import JobKeys, load_keys, make_client
from nereusd.journal import ENDPOINT_FILE
from nereusd.slurm import visible_gpus

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
ORPHANED_AFTER_S = 3.0
"""nereusd silent this long (it acknowledges every heartbeat): look for a resumed one in the run
directory, once a second, until the grace (``--daemon-timeout-s``) ends."""
RELAY_BATCH_BYTES = 8 * 2**20
"""A relayed message is closed once its workers' messages pass this size (a single larger result
still travels alone, in several frames past the protocol's frame limit)."""


@dataclass
class _Beat:
    """The read end of one worker's liveness pipe, when it last beat and since when it has been
    waiting on peers (monotonic seconds)."""

    fd: int
    last_s: float
    waiting_since_s: float | None = None
    """Since its beats say ``c`` (waiting on peers, :func:`emu.liveness.waiting_on_peers`); ``None``: not."""

    def drain(self, now_s: float) -> None:
        """Read whatever beats arrived; any byte counts as alive at ``now_s``, the last one says
        whether it waits on peers."""
        try:
            while chunk := os.read(self.fd, 4096):
                self.last_s = now_s
                if chunk[-1:] == b"c":
                    self.waiting_since_s = self.waiting_since_s if self.waiting_since_s is not None else now_s
                else:
                    self.waiting_since_s = None
        except BlockingIOError:
            pass
        except OSError:   # closed: the worker is gone, its exit is reported by _check_workers
            pass

    def waiting_s(self, now_s: float) -> float:
        """Seconds it has been waiting on peers without a break (0: not waiting)."""
        return 0.0 if self.waiting_since_s is None else now_s - self.waiting_since_s


class Agent:
    """One node's agent. See the module docstring."""

    def __init__(self, *, connect: str, node_id: str, devices: list[P.DeviceInfo], run_dir: Path,
                 daemon_timeout_s: float = 60.0, keys: JobKeys | None = None) -> None:
        self.node_id = node_id
        self.devices = devices
        self.run_dir = run_dir
        self.daemon_timeout_s = daemon_timeout_s
        self._ctx = zmq.Context.instance()
        self._keys = keys
        self._up = self._connect(connect)
        self._daemon_pid: int | None = None
        """The pid in ``nereusd.json`` when this agent registered: another one there is a resumed nereusd."""
        self._next_look_s = 0.0
        orphaned = remove_orphaned_dirs()   # of agents killed before they could remove them
        if orphaned:
            log.info("removed %d directories of agents that are gone: %s", len(orphaned), ", ".join(orphaned[:4]))
        ipc_dir = private_dir(agent_dir_prefix(), AGENT_SOCKET_BYTES)   # mode 0700: only this user
        if ipc_dir is None:
            raise RuntimeError(f"no directory for the agent's socket: $TMPDIR ({tempfile.gettempdir()}) and "
                               f"{SHORT_TMP} are too long for a Unix socket path ({IPC_PATH_MAX_BYTES} bytes); "
                               "set TMPDIR to a shorter directory")
        self._ipc_dir = Path(ipc_dir)
        self._down = self._ctx.socket(zmq.ROUTER)
        self._down.setsockopt(zmq.LINGER, 0)
        self._down.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.ipc_endpoint = f"ipc://{self._ipc_dir}/workers.sock"
        self._down.bind(self.ipc_endpoint)
        self.global_devices: list[int] = []
        self.workers: dict[int, subprocess.Popen] = {}
        self._beats: dict[int, _Beat] = {}
        self.worker_stall_s = 120.0
        """Kill and report a worker whose liveness beat is silent this long (from ``SpawnWorkers``)."""
        self._reported_exit: set[int] = set()
        self._worker_tmp: dict[subprocess.Popen, str] = {}
        """Each worker's own ``$TMPDIR`` (:mod:`emu.tmpdirs`), removed once the worker has exited."""
        self._stopping = False
        self._last_daemon_s = time.monotonic()
        self._poller: zmq.Poller | None = None

    # ------------------------------------------------------------------ helpers
    def _connect(self, endpoint: str) -> zmq.Socket:
        """A DEALER to nereusd at ``endpoint`` (CURVE with the job's client key, if any)."""
        up = self._ctx.socket(zmq.DEALER)
        up.setsockopt(zmq.LINGER, 500)
        up.setsockopt(zmq.IDENTITY, f"agent-{self.node_id}-{os.getpid()}".encode())
        if self._keys is not None:
            make_client(up, self._keys)  # CURVE: only holders of the job's client key get in
        up.connect(endpoint)
        return up

    def _announced(self) -> dict | None:
        """``RUN_DIR/nereusd.json`` (endpoint and pid of the run's nereusd), or ``None``."""
        try:
            record = json.loads((self.run_dir / ENDPOINT_FILE).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _send_up(self, msg: P._Message) -> None:
        self._up.send_multipart(P.frames_of(P.encode(msg)))

    def _alive(self) -> list[int]:
        return sorted(d for d, p in self.workers.items() if p.poll() is None)

    def register(self, timeout_s: float = 30.0, kept: list[int] | None = None,
                 kept_workers: list[int] | None = None) -> None:
        """Register with nereusd and wait for the welcome (global device indices). ``kept``: the
        global indices this agent's devices had with a lost nereusd; ``kept_workers``: those of
        them whose workers it kept.

        Raises:
            ProtocolError: if nereusd refuses the registration.
            TimeoutError: if nereusd does not answer.
        """
        announced = self._announced()
        self._daemon_pid = announced.get("pid") if announced else None
        self._send_up(P.RegisterAgent(node_id=self.node_id, hostname=socket.gethostname(), pid=os.getpid(),
                                      devices=self.devices, slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                                      kept_devices=kept or [], kept_workers=kept_workers or []))
        if not self._up.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"nereusd did not answer the registration within {timeout_s:.0f} s")
        msg = P.decode(P.joined(self._up.recv_multipart()))
        if isinstance(msg, P.ErrorReply):
            raise ProtocolError(f"nereusd refused registration: {msg.reason}")
        if not isinstance(msg, P.Welcome):
            raise ProtocolError(f"expected a welcome, got {msg.type!r}")
        self.global_devices = msg.global_devices
        log.info("node %s registered; devices %s", self.node_id, self.global_devices)

    def _rejoin(self, now_s: float) -> bool:
        """While nereusd is silent: if a resumed nereusd announced itself in the run directory,
        re-register with it, offering the workers this agent kept (the new nereusd checks that
        they are the ones its world needs), or its devices alone (under their old global numbers)
        when none is alive: a node whose devices held no worker (spares) stays in the pool. It
        had exited, and after the batch script restarted nereusd in the allocation, which starts
        no agents, its node left the job for good (an adversarial trial on Slurm, 2026-12-07).
        Returns False (the agent stops its workers and exits) when the new nereusd refused it (a
        new job that is not this one's continuation owns the directory: other keys).
        """
        if now_s < self._next_look_s:
            return True
        self._next_look_s = now_s + 1.0
        announced = self._announced()
        if not announced or announced.get("pid") in (None, self._daemon_pid) or not announced.get("endpoint"):
            return True
        alive = self._alive() if self.global_devices else []
        log.warning("nereusd (pid %s) resumed at %s: re-registering devices %s %s", announced["pid"],
                    announced["endpoint"], self.global_devices,
                    f"with the workers of {alive} and their state" if alive else "(no worker of them is alive)")
        self._poller.unregister(self._up)
        self._up.close(linger=0)
        self._up = self._connect(announced["endpoint"])
        self._poller.register(self._up, zmq.POLLIN)
        try:
            # under their old numbers, workers or not: a node without workers that registered
            # first as a new one took the numbers of the devices whose workers were kept
            self.register(kept=list(self.global_devices or []), kept_workers=alive)
        except (TimeoutError, ProtocolError) as err:
            log.error("the resumed nereusd did not take this agent back: %s; stopping", err)
            return False
        self._last_daemon_s = time.monotonic()
        return True

    # ------------------------------------------------------------------ workers
    def _spawn(self, msg: P.SpawnWorkers) -> None:
        log_dir = Path(msg.run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.worker_stall_s = msg.worker_stall_s
        for spec in msg.workers:
            beat_read, beat_write = os.pipe()
            info = self.devices[spec.local_index]
            argv = [
                sys.executable, "-m", "emu.worker",
                "--agent", self.ipc_endpoint,
                "--device", str(spec.device),
                "--local-index", str(spec.local_index),
                "--device-kind", info.kind,
                "--rank", str(spec.rank if spec.rank is not None else spec.device),
                "--world-size", str(msg.world_size),
                "--generation", str(msg.generation),
                "--store-host", msg.store_host,
                "--store-port", str(msg.store_port),
                "--memory-bytes", str(spec.memory_capacity_bytes),
                "--run-dir", msg.run_dir,
                "--beat-fd", str(beat_write),
                "--beat-interval-s", f"{beat_interval_s(msg.worker_stall_s):g}",
            ]
            env = dict(os.environ)
            threads = str(msg.threads_per_worker)
            env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
            if msg.store_host.startswith("127."):
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            tmp_dir = private_dir(agent_dir_prefix(spec.device), MULTIPROCESSING_SOCKET_BYTES)
            if tmp_dir is not None:
                env.update(TMPDIR=tmp_dir, TORCHINDUCTOR_CACHE_DIR=env.get("TORCHINDUCTOR_CACHE_DIR")
                           or inductor_cache_dir())
            log_file = open(log_dir / f"worker-{spec.device}.log", "ab")
            try:
                self.workers[spec.device] = subprocess.Popen(
                    argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    pass_fds=(beat_write,),
                )
            except BaseException:
                if tmp_dir is not None:
                    shutil.rmtree(tmp_dir, ignore_errors=True)
                raise
            finally:
                log_file.close()
                os.close(beat_write)
            self._close_beat(spec.device)   # a restarted device: the old worker's pipe
            if tmp_dir is not None:
                self._worker_tmp[self.workers[spec.device]] = tmp_dir
            os.set_blocking(beat_read, False)
            self._beats[spec.device] = _Beat(beat_read, time.monotonic())
            if self._poller is not None:
                self._poller.register(beat_read, zmq.POLLIN)
            self._reported_exit.discard(spec.device)
            log.info("started worker for device %d (pid %d)", spec.device, self.workers[spec.device].pid)

    def _close_beat(self, device: int) -> None:
        beat = self._beats.pop(device, None)
        if beat is not None:
            if self._poller is not None:
                self._poller.unregister(beat.fd)
            os.close(beat.fd)

    def _drop_tmp(self) -> None:
        """Remove the ``$TMPDIR`` of every worker that has exited, however it ended (shut down,
        signalled, killed as stalled)."""
        for proc in [p for p in self._worker_tmp if p.poll() is not None]:
            shutil.rmtree(self._worker_tmp.pop(proc), ignore_errors=True)

    def _check_workers(self) -> None:
        self._drop_tmp()
        for device, proc in self.workers.items():
            code = proc.poll()
            if code is not None and device not in self._reported_exit:
                self._reported_exit.add(device)
                self._close_beat(device)
                log.warning("worker of device %d exited with %s", device, code)
                self._send_up(P.WorkerExited(node_id=self.node_id, device=device, exitcode=code))
        self._check_stalls()

    def _check_stalls(self) -> None:
        """Kill (``SIGKILL``, which also ends a stopped process) and report every live worker whose
        liveness beat has been silent for more than :attr:`worker_stall_s`: to nereusd it is a
        lost device, like a worker that died."""
        now = time.monotonic()
        for device, beat in list(self._beats.items()):
            proc = self.workers[device]
            if proc.poll() is not None or device in self._reported_exit:
                continue
            beat.drain(now)
            silent_s = now - beat.last_s
            if silent_s <= self.worker_stall_s:
                continue
            log.error("worker of device %d (pid %d) silent for %.1f s (bound %.0f s): stalled; killing it",
                      device, proc.pid, silent_s, self.worker_stall_s)
            proc.kill()
            code = proc.wait()
            self._reported_exit.add(device)
            self._close_beat(device)
            self._send_up(P.WorkerExited(node_id=self.node_id, device=device, exitcode=code,
                                         stalled_s=round(silent_s, 3)))

    def stop_workers(self, reason: str, grace_s: float = 5.0) -> None:
        """Ask workers to exit, then SIGTERM, then SIGKILL what is left."""
        for device, proc in self.workers.items():
            if proc.poll() is None:
                try:
                    self._down.send_multipart([str(device).encode(), *P.frames_of(P.encode(P.Shutdown(reason=reason)))])
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._alive():
            time.sleep(0.05)
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and self._alive():
            time.sleep(0.05)
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def stop_devices(self, devices: list[int], reason: str) -> None:
        """Stop the workers of ``devices`` at once (SIGTERM, SIGKILL after 3 s), as a preempted
        GPU would lose its process; their exit is reported to nereusd like any other."""
        procs = [self.workers[d] for d in devices if d in self.workers]
        log.warning("stopping the workers of devices %s: %s", devices, reason)
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # ------------------------------------------------------------------ loop
    def _on_daemon(self, frames: list[bytes]) -> bool:
        """Handle one message from nereusd (its frames: :func:`~nereusd.protocol.messages.frames_of`);
        returns False when the agent must stop."""
        self._last_daemon_s = time.monotonic()
        try:
            msg = P.decode(P.joined(frames))
        except ProtocolError as err:
            log.error("refused a message from nereusd: %s", err)
            self._send_up(P.ErrorReply(reason=str(err)))
            return True
        if isinstance(msg, P.SpawnWorkers):
            self._spawn(msg)
        elif isinstance(msg, (P.ToWorker, P.ToWorkers)):
            undelivered = []
            shared = msg.shared if isinstance(msg, P.ToWorkers) else None
            for item in (msg.items if isinstance(msg, P.ToWorkers) else [msg]):
                try:
                    frames = P.frames_of(P.encode(P.with_shared(item.task, shared)))
                    self._down.send_multipart([str(item.device).encode(), *frames])
                except (zmq.ZMQError, ProtocolError) as err:
                    undelivered.append(P.FromWorker(device=item.device, payload=P.TaskResult(
                        task_id=item.task.task_id, device=item.device, ok=False,
                        error=f"task for the worker of device {item.device} not delivered: {err}",
                        error_kind="ProtocolError" if isinstance(err, ProtocolError) else "WorkerError")))
            if undelivered:
                self._send_up(P.FromWorkers(items=undelivered))
        elif isinstance(msg, P.StopWorkers):
            self.stop_devices(msg.devices, msg.reason)
        elif isinstance(msg, P.Shutdown):
            log.info("nereusd asked to shut down: %s", msg.reason)
            return False
        elif isinstance(msg, (P.Heartbeat, P.Welcome)):
            pass
        elif isinstance(msg, P.ErrorReply):
            log.error("nereusd refused a message: %s", msg.reason)
        else:
            self._send_up(P.ErrorReply(reason=f"agent does not accept {msg.type!r}"))
        return True

    def _on_worker(self, identity: bytes, frames: list[bytes]) -> P.FromWorker | None:
        """One worker message (its frames) checked and wrapped for the relay (``None``: refused, logged)."""
        try:
            device = int(identity.decode())
            msg = P.decode(P.joined(frames))
            if device not in self.workers:
                raise ProtocolError(f"message from unknown worker identity {identity!r}")
            if not isinstance(msg, (P.WorkerReady, P.TaskResult)):
                raise ProtocolError(f"workers may not send {msg.type!r}")
        except (ValueError, ProtocolError) as err:
            log.error("refused a worker message: %s", err)
            return None
        return P.FromWorker(device=device, payload=msg)

    def _relay_up(self) -> None:
        """Relay every message the workers have sent so far to nereusd, in one message, or in
        several of about :data:`RELAY_BATCH_BYTES` when results are large (one result travels
        alone, in several frames past :data:`~nereusd.protocol.messages.MAX_FRAME_BYTES`)."""
        items, size = [], 0
        while len(items) < P.MAX_BATCH_ITEMS:
            try:
                identity, *frames = self._down.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            item = self._on_worker(identity, frames)
            if item is None:
                continue
            nbytes = sum(len(f) for f in frames)
            if items and size + nbytes > RELAY_BATCH_BYTES:
                self._send_up(P.FromWorkers(items=items))
                items, size = [], 0
            items.append(item)
            size += nbytes
        if items:
            self._send_up(P.FromWorkers(items=items))

    def run(self) -> int:
        """Serve until shutdown; returns the process exit code."""
        poller = self._poller = zmq.Poller()
        poller.register(self._up, zmq.POLLIN)
        poller.register(self._down, zmq.POLLIN)
        for beat in self._beats.values():
            poller.register(beat.fd, zmq.POLLIN)
        next_beat = 0.0
        code = 0
        try:
            while not self._stopping:
                events = dict(poller.poll(100))
                if self._up in events:
                    if not self._on_daemon(self._up.recv_multipart()):
                        break
                if self._down in events:
                    self._relay_up()
                now = time.monotonic()
                for beat in list(self._beats.values()):
                    if beat.fd in events:
                        beat.drain(now)
                self._check_workers()
                if now >= next_beat:
                    waiting = {d: round(b.waiting_s(now), 1) for d, b in self._beats.items() if b.waiting_s(now) >= 1.0}
                    self._send_up(P.Heartbeat(node_id=self.node_id, workers_alive=self._alive(), waiting_s=waiting))
                    next_beat = now + HEARTBEAT_INTERVAL_S
                if now - self._last_daemon_s > self.daemon_timeout_s:
                    log.error("nereusd silent for %.0f s: stopping workers", now - self._last_daemon_s)
                    code = 1
                    break
                if now - self._last_daemon_s > ORPHANED_AFTER_S and not self._rejoin(now):
                    code = 1
                    break
        finally:
            self.stop_workers("agent stopping")
            try:
                self._send_up(P.Heartbeat(node_id=self.node_id, workers_alive=[]))
            except zmq.ZMQError:
                pass
            self.close()
        return code

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    def close(self) -> None:
        for device in list(self._beats):
            self._close_beat(device)
        self._drop_tmp()
        self._down.close(0)
        self._up.close()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nereus-agent",
        description="Per-node Nereus agent: registers this node's devices with nereusd and runs one worker per device.",
    )
    parser.add_argument("--connect", required=True, help="nereusd endpoint, e.g. tcp://head:5555")
    parser.add_argument("--node-id", default=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
                        help="node name (default: $SLURMD_NODENAME, else the hostname)")
    parser.add_argument("--cpu-devices", default=None,
                        help="use N virtual CPU devices instead of probing for GPUs (local mode); 'slurm': one "
                             "per GPU that Slurm made visible to this task (the project's test cluster)")
    parser.add_argument("--cpu-memory-bytes", type=int, default=2**30,
                        help="accounted memory of each virtual CPU device (default 1 GiB)")
    parser.add_argument("--run-dir", required=True, help="the job's run directory (worker logs go to RUN_DIR/logs)")
    parser.add_argument("--daemon-timeout-s", type=float, default=60.0,
                        help="stop the workers if nereusd is silent this long (default 60); a nereusd resumed "
                             "in the run directory within it takes them back, their state in memory")
    parser.add_argument("--keys-dir", default=None,
                        help="the job's CURVE key directory (RUN_DIR/keys); required when nereusd uses keys")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=f"%(asctime)s %(levelname)s agent[{args.node_id}] %(name)s: %(message)s")
    cpu_devices = args.cpu_devices
    if cpu_devices == "slurm":
        gpus = visible_gpus(os.environ)
        log.info("Slurm made %d GPU(s) visible via %s=%s", gpus.count, gpus.source, ",".join(gpus.ids))
        cpu_devices = gpus.count
    elif cpu_devices is not None:
        if not str(cpu_devices).isdigit():
            log.error("--cpu-devices: expected a count or 'slurm', got %r", cpu_devices)
            return 2
        cpu_devices = int(cpu_devices)
    try:
        keys = load_keys(args.keys_dir, "client") if args.keys_dir else None
    except NereusError as err:
        log.error("%s", err)
        return 2
    devices = discover(cpu_devices, args.cpu_memory_bytes)
    agent = Agent(connect=args.connect, node_id=args.node_id, devices=devices, run_dir=Path(args.run_dir),
                  daemon_timeout_s=args.daemon_timeout_s, keys=keys)
    signal.signal(signal.SIGTERM, agent.request_stop)
    signal.signal(signal.SIGINT, agent.request_stop)
    try:
        agent.register()
    except (TimeoutError, ProtocolError) as err:
        log.error("%s", err)
        agent.close()
        return 1
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
