"""Memory accounting of one (virtual) device.

In local mode a worker is a CPU process standing in for a GPU with a configured capacity
(DESIGN.md, "Local mode"). Every byte the engine holds for a model-stage — parameters,
gradients, Adam state, KV cache, activations — is booked here *before* it is allocated, so an
oversized plan or micro-batch fails with :class:`DeviceOutOfMemory` before any work is done,
exactly where a GPU would run out. Activation bytes come from the memory model's formula
(:func:`nereusd.cost.memory.micro_batch_activation_bytes`): one formula for the planner and the
engine. On a CUDA device the allocator's own peak is reported beside the booked one
(:meth:`DeviceMemory.cuda_peak_bytes`).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from nereusd.errors import DeviceOutOfMemory

log = logging.getLogger(__name__)


class DeviceMemory:
    """Booked memory of one device, per ``(model_stage, what)`` entry.

    Args:
        device: global device index (the worker's world rank).
        capacity_bytes: capacity in bytes.
        torch_device: when a CUDA device, :meth:`cuda_peak_bytes` reads its allocator.
        workspace_bytes: booked from the start and never freed: the framework workspace the
            memory model counts on every device (:data:`nereusd.cost.memory.WORKSPACE_BYTES`),
            so that a booked peak and a predicted one count the same things. In
            :attr:`in_use_bytes` and :attr:`peak_bytes`, not in :meth:`by_model_stage`. A
            capacity below it is no error here: the first allocation then fails with
            :class:`DeviceOutOfMemory`, as a job's first task reports it.

    Raises:
        ValueError: for a capacity that is not positive or a negative workspace.
    """

    def __init__(self, device: int, capacity_bytes: int, torch_device: Optional[torch.device] = None,
                 workspace_bytes: int = 0) -> None:
        if capacity_bytes <= 0 or workspace_bytes < 0:
            raise ValueError(f"device {device}: capacity_bytes must be positive and workspace_bytes >= 0, "
                             f"got {capacity_bytes} and {workspace_bytes}")
        self.device = device
        self.capacity_bytes = int(capacity_bytes)
        self.torch_device = torch_device
        self.workspace_bytes = int(workspace_bytes)
        self._entries: dict[tuple[str, str], int] = {}
        self._in_use = self.workspace_bytes
        self._peak = self._in_use
        self._lock = threading.Lock()

    def allocate(self, model_stage: str, what: str, nbytes: int) -> None:
        """Book ``nbytes`` for ``what`` of ``model_stage`` (added to an existing entry).

        Raises:
            DeviceOutOfMemory: if ``in_use_bytes + nbytes > capacity_bytes``; nothing is booked.
            ValueError: if ``nbytes`` is negative.
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes} for {model_stage} {what}")
        ms = str(model_stage)
        with self._lock:
            if self._in_use + nbytes > self.capacity_bytes:
                raise DeviceOutOfMemory(ms, self.device, nbytes, self._in_use, self.capacity_bytes, what)
            key = (ms, what)
            self._entries[key] = self._entries.get(key, 0) + nbytes
            self._in_use += nbytes
            self._peak = max(self._peak, self._in_use)

    def free(self, model_stage: str, what: str) -> int:
        """Release the whole entry ``(model_stage, what)``; returns its bytes (0 if absent)."""
        with self._lock:
            nbytes = self._entries.pop((str(model_stage), what), 0)
            self._in_use -= nbytes
            return nbytes

    def free_model_stage(self, model_stage: str) -> int:
        """Release every entry of ``model_stage``; returns the bytes released."""
        ms = str(model_stage)
        with self._lock:
            keys = [k for k in self._entries if k[0] == ms]
            nbytes = sum(self._entries.pop(k) for k in keys)
            self._in_use -= nbytes
            return nbytes

    @property
    def in_use_bytes(self) -> int:
        return self._in_use

    @property
    def peak_bytes(self) -> int:
        """Highest ``in_use_bytes`` since construction or :meth:`reset_peak`."""
        return self._peak

    def reset_peak(self) -> None:
        """Restart peak tracking from the current use (and the CUDA allocator's, if any)."""
        with self._lock:
            self._peak = self._in_use
        if self._is_cuda():
            torch.cuda.reset_peak_memory_stats(self.torch_device)

    def by_model_stage(self) -> dict[str, int]:
        """Booked bytes per model-stage."""
        out: dict[str, int] = {}
        for (ms, _), nbytes in self._entries.items():
            out[ms] = out.get(ms, 0) + nbytes
        return out

    def entries(self) -> dict[tuple[str, str], int]:
        """A copy of every booked entry ``(model_stage, what) -> bytes``."""
        return dict(self._entries)

    def cuda_peak_bytes(self) -> Optional[int]:
        """``torch.cuda.max_memory_allocated`` of the device, or ``None`` when not CUDA."""
        if not self._is_cuda():
            return None
        return int(torch.cuda.max_memory_allocated(self.torch_device))

    def _is_cuda(self) -> bool:
        return self.torch_device is not None and torch.device(self.torch_device).type == "cuda"
