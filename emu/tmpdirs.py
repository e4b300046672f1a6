"""Private temporary directories for the processes Nereus starts, removed when the process is gone.

Workers and vLLM engine processes end with ``os._exit`` (a worker on shutdown, an engine on
``close``), and the agent stops a worker with ``SIGTERM``, then ``SIGKILL``, at every restart and
device removal: none of these runs the clean-up of what the process left in ``$TMPDIR``. Left
there, each run added files to ``/tmp`` that nothing removed: a worker's multiprocessing directory
(``pymp-*``, holding the listener through which shared tensors reach its vLLM engine), and each
engine start's vLLM rendezvous file (TP 1, ``vllm_dist_<uuid>``) or ZMQ ipc sockets (TP > 1,
``<uuid>``): 560 files, 72 sockets and 458 directories after two days of runs here
(2026-12-07). So the agent gives each worker, and a worker each engine, a directory of its own as
``$TMPDIR`` and removes it once the process has exited.

An agent killed with ``SIGKILL`` (a test, a node's job step killed after Slurm's ``KillWait``)
removes neither its own directory nor its workers': their names carry its pid, and the next agent
to start on the node removes those of agents that are gone (:func:`remove_orphaned_dirs`).

A Unix socket's path may not exceed :data:`IPC_PATH_MAX_BYTES`, and a private directory makes the
paths of the sockets inside it longer: where they would not fit under the system's temporary
directory (a long ``$TMPDIR``), the directory is made under :data:`SHORT_TMP` instead, and where
not even there, the process keeps the system's (see :func:`private_dir`).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import tempfile

import psutil

IPC_PATH_MAX_BYTES = 107
"""The longest path a Unix socket binds to (``sizeof(sockaddr_un.sun_path)`` less its terminator,
Linux); ZMQ and multiprocessing refuse longer ones."""

AGENT_SOCKET_BYTES = len("/workers.sock")
"""What the agent adds to its socket directory for the socket its workers connect to."""

MULTIPROCESSING_SOCKET_BYTES = len("/pymp-12345678/listener-12345678")
"""What multiprocessing adds to ``$TMPDIR`` for a listener socket (``util.get_temp_dir`` and
``connection.arbitrary_address``: ``pymp-`` and ``listener-`` with 8 random characters each)."""

VLLM_SOCKET_BYTES = len("/") + 36
"""What vLLM adds to its ipc base path (``$TMPDIR``) for a ZMQ socket: a uuid4
(``vllm.utils.network_utils.get_open_zmq_ipc_path``)."""


def sockets_fit(directory: str, socket_bytes: int) -> bool:
    """Whether a socket path inside ``directory``, ``socket_bytes`` longer than the directory's,
    is within :data:`IPC_PATH_MAX_BYTES`."""
    return len(directory.encode()) + socket_bytes <= IPC_PATH_MAX_BYTES


SHORT_TMP = "/tmp"
"""Where a private directory goes when the system's temporary directory is too long for the
sockets inside it (sockets take no space there)."""


def private_dir(prefix: str, socket_bytes: int) -> str | None:
    """A new directory (mode 0700) for one process's ``$TMPDIR`` or sockets: under the system's
    temporary directory, or under :data:`SHORT_TMP` where the sockets inside it would not fit
    there (:func:`sockets_fit`; a long ``$TMPDIR`` made every local job fail at its agent's
    socket); ``None`` (nothing created) when they fit under neither."""
    for base in (None, SHORT_TMP):
        try:
            path = tempfile.mkdtemp(prefix=prefix, dir=base)
        except OSError:   # no SHORT_TMP here
            continue
        if sockets_fit(path, socket_bytes):
            return path
        shutil.rmtree(path, ignore_errors=True)
    return None


AGENT_DIR = re.compile(r"nereus-(?:agent|w\d+)-(\d+)-")
"""The names of an agent's private directories, with its pid: its socket's (``nereus-agent-<pid>-``)
and each worker's ``$TMPDIR`` (``nereus-w<device>-<pid>-``), :func:`agent_dir_prefix`."""


def agent_dir_prefix(worker_device: int | None = None) -> str:
    """The :func:`private_dir` prefix of this agent's socket directory, or (``worker_device``) of
    the ``$TMPDIR`` of its worker of that device: named with the agent's pid (:data:`AGENT_DIR`)."""
    kind = "agent" if worker_device is None else f"w{worker_device}"
    return f"nereus-{kind}-{os.getpid()}-"


def remove_orphaned_dirs() -> list[str]:
    """Remove this user's private directories of agents that are gone (:data:`AGENT_DIR` names
    whose pid no process holds), under the system's temporary directory and :data:`SHORT_TMP`;
    returns their paths. A worker of a killed agent may still run until its task ends; its
    ``$TMPDIR`` goes too (no agent can take that worker back). A pid taken again by another
    process keeps its directories until a later sweep."""
    removed = []
    for base in dict.fromkeys((tempfile.gettempdir(), SHORT_TMP)):
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            match = AGENT_DIR.match(entry.name)
            try:
                mine = match is not None and entry.is_dir(follow_symlinks=False) \
                    and entry.stat(follow_symlinks=False).st_uid == os.getuid()
            except OSError:   # gone meanwhile
                continue
            if mine and not psutil.pid_exists(int(match.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def inductor_cache_dir() -> str:
    """torch.compile's cache directory where torch keeps it by default, under the *system's*
    temporary directory (``torchinductor_<user>``), for a process whose ``$TMPDIR`` is private:
    the cache then outlives it, and the next process reuses what it compiled. The rule of
    ``torch._inductor.runtime.cache_dir_utils.default_cache_dir`` (torch 2.13), restated because
    importing it takes ~5 s in the agent, which imports no torch otherwise."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
