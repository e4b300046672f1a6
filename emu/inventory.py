"""Device inventory of one node: NVIDIA GPUs via NVML, AMD GPUs via amdsmi, else virtual CPU devices.

Each probe fails in its own way on a machine without that hardware (see docs/platform.md): NVML
raises ``NVMLError_LibraryNotFound`` (or another ``NVMLError``), ``import amdsmi`` raises
``KeyError: 'libamd_smi.so'`` (after printing to stdout) or ``ImportError``. Those exact
failures mean "no such device here"; anything else propagates.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os

from nereusd.protocol import DeviceInfo

log = logging.getLogger(__name__)




def probe_nvidia() -> list[DeviceInfo]:
    """NVIDIA GPUs visible to this process, or ``[]`` when NVML is absent."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        log.debug("NVML unavailable: %s", err)
        return []
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        handles = []
        if visible is not None and visible.strip() != "":
            for token in visible.split(","):
                token = token.strip()
                if token.isdigit():
                    handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(token)))
                else:
                    handles.append(pynvml.nvmlDeviceGetHandleByUUID(token))
        else:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        devices = []
        for local_index, handle in enumerate(handles):
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            devices.append(DeviceInfo(local_index=local_index, kind="cuda", name=name, memory_bytes=memory))
        return devices
    finally:
        pynvml.nvmlShutdown()


def probe_amd() -> list[DeviceInfo]:
    """AMD GPUs (GCDs) visible to this process, or ``[]`` when amdsmi is absent."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import amdsmi  # type: ignore[import-not-found]
    except (ImportError, KeyError, OSError) as err:
        log.debug("amdsmi unavailable: %r", err)
        return []
    try:
        amdsmi.amdsmi_init()
    except amdsmi.AmdSmiException as err:  # type: ignore[attr-defined]
        log.debug("amdsmi init failed: %s", err)
        return []
    try:
        devices = []
        for local_index, handle in enumerate(amdsmi.amdsmi_get_processor_handles()):
            info = amdsmi.amdsmi_get_gpu_asic_info(handle)
            vram = amdsmi.amdsmi_get_gpu_memory_total(handle, amdsmi.AmdSmiMemoryType.VRAM)
            devices.append(DeviceInfo(local_index=local_index, kind="rocm",
                                      name=str(info.get("market_name", "AMD GPU")), memory_bytes=int(vram)))
        return devices
    finally:
        amdsmi.amdsmi_shut_down()


def virtual_cpu_devices(count: int, memory_bytes: int) -> list[DeviceInfo]:
    """``count`` virtual devices, each a CPU process with ``memory_bytes`` of accounted memory."""
    return [DeviceInfo(local_index=i, kind="cpu", name="virtual-cpu", memory_bytes=memory_bytes) for i in range(count)]


def discover(cpu_devices: int | None, cpu_memory_bytes: int) -> list[DeviceInfo]:
    """The node's devices: GPUs if any are found, else ``cpu_devices`` virtual CPU devices.

    ``cpu_devices`` forces virtual CPU devices even where GPUs exist (local mode on a
    workstation); ``None`` means probe.

    Raises:
        RuntimeError: if there are no GPUs and no CPU device count was given.
    """
    if cpu_devices is not None:
        return virtual_cpu_devices(cpu_devices, cpu_memory_bytes)
    gpus = probe_nvidia() or probe_amd()
    if gpus:
        return gpus
    raise RuntimeError("no NVIDIA or AMD GPU found on this node; pass --cpu-devices N to run on virtual CPU devices")
