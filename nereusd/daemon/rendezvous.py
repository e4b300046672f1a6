"""The torch.distributed rendezvous store that nereusd serves.

Workers of world generation ``g`` join through ``PrefixStore("nereus/gen<g>/", store)``, so a
later generation (after a pool change) re-forms the world in the same store without stale keys.
This is the only place in nereusd that imports torch, and it does so when the store starts.

Exposure: torch's ``TCPStore`` has no authentication, and its server listens on every interface
whatever host it is given. So nereusd binds the listening socket itself, on ``host`` only (the
loopback address in local mode, the address it advertises on Slurm), and hands torch the bound
descriptor (``master_listen_fd``). The port is random (port 0) and the store lives as long as
nereusd. Still reachable from that address: the store itself, and the gloo/NCCL and vLLM
listeners the workers open (see README, "Reliability").
"""

from __future__ import annotations

import socket
from datetime import timedelta


class RendezvousStore:
    """A ``torch.distributed.TCPStore`` master listening on ``host`` only (port 0 picks a free port).

    Args:
        host: an IPv4/IPv6 address or a host name; a name is resolved and the first address bound.
        port: the port to listen on; 0 picks a free one (:attr:`port` says which).
        timeout_s: the store's operation timeout.

    Raises:
        OSError: ``host`` cannot be resolved or bound (not an address of this machine), or ``port``
            is taken.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        self.host = host
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)   # kept open: torch serves on its fd
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(address)
        self._listener.listen(1024)
        self.port = int(self._listener.getsockname()[1])
        self._store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s),
                                    master_listen_fd=self._listener.fileno())
        self.generation = 0

    def next_generation(self) -> int:
        """Start a new world generation and return its number."""
        self.generation += 1
        return self.generation
