"""The torch.distributed rendezvous store that nereusd serves.

Workers of world generation ``g`` join through ``PrefixStore("nereus/gen<g>/", store)``, so a
later generation (after a pool change) re-forms the world in the same store without stale keys.
This is the only place in nereusd that imports torch, and it does so when the store starts.
"""

from __future__ import annotations

from datetime import timedelta


class RendezvousStore:
    """A ``torch.distributed.TCPStore`` master on ``host`` (port 0 picks a free port)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        self.host = host
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
        self.port = int(self._store.port)
        self.generation = 0

    def next_generation(self) -> int:
        """Start a new world generation and return its number."""
        self.generation += 1
        return self.generation
