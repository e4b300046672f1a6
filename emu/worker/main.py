"""The per-device worker process (started by the agent): joins the torch.distributed world and
runs the tasks nereusd sends, one at a time, in the order they arrive.

Rendezvous goes through the TCPStore that nereusd serves, under a prefix with the world's
generation number, so that a later generation can re-form the world in the same store.
Task handlers live in :mod:`emu.worker.runtime`.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing.util
import os
import shutil
import sys
import threading
import time
import traceback

import zmq

from emu.worker.world import init_world
from nereusd import protocol as P
from nereusd.errors import NereusError, ProtocolError

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m emu.worker", description="Nereus worker (started by nereus-agent).")
    parser.add_argument("--agent", required=True, help="agent ipc:// endpoint")
    parser.add_argument("--device", type=int, required=True, help="global device index")
    parser.add_argument("--local-index", type=int, required=True, help="device index on this node")
    parser.add_argument("--device-kind", choices=["cpu", "cuda", "rocm"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--generation", type=int, required=True)
    parser.add_argument("--store-host", required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--memory-bytes", type=int, required=True, help="device memory capacity to account against")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--beat-fd", type=int, default=None,
                        help="pipe to the agent: one byte per liveness beat (the agent's stall watchdog)")
    parser.add_argument("--beat-interval-s", type=float, default=1.0, help="seconds between liveness beats")
    return parser


def start_liveness_beat(fd: int, interval_s: float) -> threading.Thread:
    """Write one byte to ``fd`` every ``interval_s`` seconds from a daemon thread, for as long as
    this process runs (the agent's watchdog, :meth:`emu.agent.Agent._check_stalls`): ``c`` while
    the main thread waits on peers (:func:`emu.liveness.waiting_on_peers`; nereusd's straggler
    rule counts such a worker as arrived), ``.`` otherwise.

    The thread beats while the main thread waits in a torch op or a collective (they release
    the GIL), so a worker blocked on a stalled peer keeps beating; a stopped (``SIGSTOP``) or
    frozen process does not. A full pipe (an agent that is itself stalled) drops beats; a
    closed one (the agent is gone) ends the thread. While the worker waits on a helper process
    that is silent (a stopped vLLM engine, :mod:`emu.liveness`), no beat is written.
    """
    os.set_blocking(fd, False)
    from emu import liveness

    main_ident = threading.main_thread().ident

    def beat() -> None:
        withheld = False
        while True:
            silent = liveness.silent_helper()
            if silent is not None:   # the worker waits on a stopped helper: let the agent take both
                if not withheld:
                    log.error("%s silent for %.1f s while this worker waits on it: liveness beat withheld",
                              *silent)
                withheld = True
                time.sleep(interval_s)
                continue
            withheld = False
            try:
                os.write(fd, b"c" if liveness.waiting_on_peers(main_ident) else b".")
            except BlockingIOError:
                pass
            except OSError:
                return
            time.sleep(interval_s)

    thread = threading.Thread(target=beat, name="liveness-beat", daemon=True)
    thread.start()
    return thread


def serve(args: argparse.Namespace) -> int:
    import torch

    from emu.state.devmem import DeviceMemory
    from emu.worker.runtime import WorkerRuntime
    from nereusd.cost.memory import WORKSPACE_BYTES

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(args.device).encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(args.agent)
    parent = os.getppid()

    device, store, backend = init_world(kind=args.device_kind, local_index=args.local_index, rank=args.rank,
                        world_size=args.world_size, generation=args.generation,
                        store_host=args.store_host, store_port=args.store_port)
    memory = DeviceMemory(args.device, args.memory_bytes, workspace_bytes=WORKSPACE_BYTES[args.device_kind])
    runtime = WorkerRuntime(rank=args.rank, device_index=args.device, torch_device=device, memory=memory,
                            settle_heap_at_build=True,
                            run_dir=args.run_dir, store_client=store, backend=backend)
    sock.send_multipart(P.frames_of(P.encode(P.WorkerReady(device=args.device, pid=os.getpid()))))
    log.info("worker ready: rank %d of %d on %s", args.rank, args.world_size, device)

    while True:
        if not sock.poll(1000):
            if os.getppid() != parent:
                log.error("agent (pid %d) is gone: exiting", parent)
                return 1
            continue
        try:
            msg = P.decode(P.joined(sock.recv_multipart()))
        except ProtocolError as err:
            log.error("refused a message: %s", err)
            continue
        if isinstance(msg, P.Shutdown):
            log.info("shutdown: %s", msg.reason)
            runtime.close()
            return 0
        if not isinstance(msg, P.Task):
            log.error("refused a %r message: workers accept tasks and shutdown only", msg.type)
            continue
        start = time.perf_counter()
        try:
            result = runtime.handle(msg.args)
            reply = P.TaskResult(task_id=msg.task_id, device=args.device, ok=True, result=result,
                                 elapsed_s=time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 - every failure is reported to nereusd, which stops the job
            fatal = not isinstance(err, NereusError)
            log.error("task %s #%d failed: %s", msg.kind, msg.task_id, err,
                      exc_info=fatal)
            detail = str(err) if not fatal else f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=8)}"
            reply = P.TaskResult(task_id=msg.task_id, device=args.device, ok=False, error=detail,
                                 error_kind=type(err).__name__, elapsed_s=time.perf_counter() - start)
        sock.send_multipart(P.frames_of(result_message(reply, msg.kind)))


def result_message(reply: P.TaskResult, kind: str) -> bytes:
    """``reply`` encoded, or, when that is over the protocol's message limit, a failed result
    that says so (the job stops with it: a result nereusd cannot take would leave its task
    waiting for ever).

    ``kind``: the task's kind, for the message (:data:`~nereusd.protocol.messages.MAX_MESSAGE_BYTES`,
    :data:`~nereusd.protocol.messages.TASK_SIZE_HINT`)."""
    message = P.encode(reply)
    try:
        P.check_size(len(message), f"the result of the {kind} task on device {reply.device}", P.TASK_SIZE_HINT)
    except ProtocolError as err:
        log.error("%s", err)
        message = P.encode(P.TaskResult(task_id=reply.task_id, device=reply.device, ok=False, error=str(err),
                                        error_kind="ProtocolError", elapsed_s=reply.elapsed_s))
    return message


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.beat_fd is not None:   # first: the imports and the world's rendezvous take seconds
        start_liveness_beat(args.beat_fd, args.beat_interval_s)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s worker[dev{args.device} rank{args.rank}] %(name)s: %(message)s",
    )
    code = serve(args)
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit skips the removal of this process's multiprocessing directory (pymp-*, where the
    # listener that passes shared tensors to a vLLM engine lives). The agent removes the worker's
    # whole $TMPDIR once it has exited, however it ended (emu.tmpdirs); this covers a worker whose
    # $TMPDIR is the system's (a path too long for a private one)
    shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
    os._exit(code)  # skip slow interpreter teardown; the process group was destroyed in close()


if __name__ == "__main__":
    main()
