"""Site configs: the hardware of a cluster (or of this machine, in local mode).

A site YAML (``site_configs/<name>.yaml``) gives the node shape, the device (kind, memory,
peak compute per dtype, HBM bandwidth) and the links (intra-node, inter-node). The cost and
memory models and the planner read nothing else about the hardware.

Units: ``*_gbps`` are **gigabytes per second** (10^9 bytes/s) per device and per direction,
``*_tflops`` are 10^12 FLOP/s per device (dense, no sparsity), ``memory_gib`` is 2^30 bytes.

The ``slurm:`` section (partition, account, QoS, constraint, GPUs per node and the GRES syntax,
time limit, modules or container; :class:`~nereusd.config.site_slurm.SlurmSpec`) says how to ask the
cluster's Slurm for nodes; ``env:`` gives the communication environment the site needs (NCCL or
RCCL variables, the OFI/CXI provider for Slingshot, InfiniBand HCAs and the socket interface).
Both are validated as strictly as the rest (:mod:`nereusd.config.site_slurm`). A site without a
``slurm:`` section can be planned for but not submitted to.

Loading is strict: unknown keys, missing keys and values of the wrong type raise
:class:`~nereusd.errors.ConfigError` with the file name and the dotted key, e.g.
``h200-ib.yaml: network.inter_node_gbps: expected a number, got 'fast'``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Mapping


from nereusd.cost.calibration import MAX_EFFICIENCY
from nereusd.errors import ConfigError, shortened
from nereusd.config.site_slurm import ContainerSpec, SlurmSpec, check_env, check_slurm  # noqa: F401 (re-exported)

YAML11_EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
"""A number in exponent form that PyYAML (YAML 1.1) leaves a string when it lacks a dot: ``5e-1``."""

GIB = 1 << 30
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
DeviceKind = Literal["cpu", "cuda", "rocm"]
Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]

#: Directories searched, in order, for a bare site name ``NAME`` → ``NAME.yaml``.
#: The directories of ``$NEREUS_SITE_CONFIGS`` (if set; separated by ``os.pathsep``) come first,
#: then the repository's ``site_configs/``.
SITE_CONFIG_DIR = Path(__file__).resolve().parents[2] / "site_configs"


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one virtual CPU device in local mode)."""

    kind: DeviceKind
    """``cpu`` (virtual device, gloo), ``cuda`` (NCCL) or ``rocm`` (RCCL)."""
    model: str
    """Marketing name, for reports only."""
    memory_gib: float
    """Usable device memory in GiB (2^30 bytes)."""
    peak_tflops: Mapping[str, float]
    """Dense peak compute in TFLOP/s per dtype (keys among fp32, tf32, bf16, fp16, fp8)."""
    hbm_gbps: float
    """Device memory bandwidth in GB/s (10^9 bytes/s); bounds decoding."""
    compute_dtype: Dtype = "bf16"
    """Dtype that jobs on this site compute in by default (``fp32`` for CPU devices)."""
    layer_launch_us: float = 0.0
    """Fixed time per transformer layer per decode step, microseconds: kernel launches and
    framework dispatch, independent of the batch. It makes generation waves cost what they
    do on small batches (decode that is neither HBM- nor compute-bound). 0: not modelled."""
    host_cores: int = 0
    """Cores the devices of one node share (virtual CPU devices, ``kind: cpu``); the peaks above
    are then each device's fair share with every device busy. A device whose neighbours idle
    runs faster, up to a whole core (:meth:`SiteConfig.lone_speedup`). 0 (default, and every
    GPU): each device has its own compute."""
    host_link_gbps: float = 0.0
    """Achieved copy bandwidth between one device and host memory, GB/s per direction (pinned
    ``cudaMemcpy``/``hipMemcpy``; PCIe or the CPU–GPU fabric). With :attr:`host_staging_gib` it lets
    a transition stage a holding in host memory (:func:`nereusd.transition.memory.stage_in_host`)
    and prices that copy. 0 (default): no host staging."""
    host_staging_gib: float = 0.0
    """Host memory, GiB, that one device's worker may borrow during a transition to stage its
    holdings (a share of the node's RAM, leaving the rest to the job's processes). 0 (default):
    no host staging."""


@dataclass(frozen=True, kw_only=True)
class NetworkSpec:
    """Links between devices; bandwidths per device and direction, in GB/s (10^9 bytes/s)."""

    intra_node_gbps: float
    """Device-to-device bandwidth inside a node (NVLink, Infinity Fabric, loopback)."""
    inter_node_gbps: float
    """Per-device bandwidth across nodes (one NIC share per device)."""
    intra_node_latency_us: float = 5.0
    """Per-message latency inside a node, microseconds (α of the α-β model)."""
    inter_node_latency_us: float = 10.0
    """Per-message latency across nodes, microseconds."""
    intra_node_latency_growth: float = 1.0
    """What each doubling of a group inside a node adds to a small all-reduce's latency, as a
    share of the 2-rank latency (:func:`nereusd.cost.formulas.ring_collective_parts`): 1 is
    Rabenseifner's ``2⌈log2 n⌉·α``; measure it with nccl-tests' ``all_reduce_perf -b 8 -e 8`` on
    2, 4 and 8 GPUs of a node, ``(t8 − t2) / (2·t2)``."""
    inter_node_latency_growth: float = 1.0
    """The same across nodes (``all_reduce_perf`` over 2, 4, 8 … nodes, one GPU each)."""
    intra_node_all_reduce_efficiency: float = 0.0
    """A large all-reduce's measured bus bandwidth inside a node over ``intra_node_gbps``
    (nccl-tests' ``all_reduce_perf -b 1G -e 1G`` on a node's GPUs: its ``busbw`` over the link
    figure), or 0: not measured. Given, the cost model prices the training engines' all-reduces
    there at this efficiency instead of learning it from whole model-stage times, which cannot
    tell a collective from the compute beside it while a job runs one layout
    (:meth:`nereusd.cost.calibration.Calibration.pin`)."""
    inter_node_all_reduce_efficiency: float = 0.0
    """The same across nodes (``all_reduce_perf`` over nodes, one GPU each), or 0."""
    communicator_setup_s: float = 0.5
    """Seconds to create one new communicator (NCCL/RCCL/gloo group), used by transitions."""


@dataclass(frozen=True, kw_only=True)
class LivenessSpec:
    """How long a silent process may take before it counts as lost."""

    worker_stall_s: float = 120.0
    """A worker whose liveness beat (a thread in the worker, every
    :func:`~nereusd.config.site.beat_interval_s` seconds) is silent this long is stopped or frozen
    (``SIGSTOP``, a swapped-out or wedged process): its agent kills it and reports it, and
    nereusd treats its device as lost. A worker blocked in a collective on a stalled peer keeps
    beating, so the stalled one is the one named. The beat thread needs the GIL for a moment
    per beat, so this must exceed the longest call that holds the GIL (torch ops and
    collectives release it)."""
    straggler_factor: float = 10.0
    """See :attr:`straggler_min_s`: the bound in multiples of the time half a task's workers took."""
    straggler_min_s: float = 600.0
    """A worker that beats but makes no progress (a live-locked loop) is caught by its task
    instead: in generation, inference and training tasks (workers doing like work), once half of
    a task's workers returned, after ``t_half`` seconds, a worker still without a result
    ``max(straggler_min_s, straggler_factor × t_half)`` seconds after it could start the task
    (its dispatch, or its previous task's result) is killed and its device treated as lost
    (cause ``worker_stalled``). Both must exceed the slowest healthy worker of any such task —
    in RL generation the replica with the longest responses — or a healthy straggler is killed.
    A worker waiting on peers (blocked in a collective, its beat says so) for 5 s counts as
    arrived with the returned ones: it waits for the straggler. A worker blocked on a frozen
    peer is the peer's beat's case."""
    task_max_s: float = 3600.0
    """Any task (one-worker tasks, transitions, checkpoints and builds included): a worker that
    has neither returned nor waits on peers this long after it could start the task is killed
    and its device treated as lost (cause ``worker_stalled``). Must exceed the longest healthy
    task of the job — a generation with the longest responses, a vLLM engine start."""
    resume_grace_s: float = 60.0
    """How long an agent outlives a silent (crashed) nereusd with its workers and their EMUs
    before it stops them and exits (``nereus-agent --daemon-timeout-s``; on Slurm the batch
    script's ``NEREUS_RESUME_GRACE_S``). A nereusd resumed in the run directory within it takes
    them back (:mod:`nereusd.daemon.kept`); ``nereus-launch resume --restart`` stops them at once."""


def beat_interval_s(worker_stall_s: float) -> float:
    """Seconds between a worker's liveness beats: a tenth of the stall bound, at most 1 s, so
    a stall is detected within ``worker_stall_s`` plus one beat."""
    return min(1.0, worker_stall_s / 10.0)


@dataclass(frozen=True, kw_only=True)
class SiteConfig:
    """A cluster's hardware as loaded from a site YAML (never mutated after load)."""

    name: str
    """Site name; a bare ``--site NAME`` finds ``site_configs/NAME.yaml``."""
    nodes: int
    """Nodes to plan for by default (the launcher may allocate another count)."""
    devices_per_node: int
    """Accelerators per node (virtual devices in local mode)."""
    device: DeviceSpec
    network: NetworkSpec
    description: str = ""
    """Free text: where the numbers come from."""
    slurm: SlurmSpec | None = None
    """How to ask this cluster's Slurm for nodes; ``None``: the site cannot be submitted to."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment exported to nereusd, agents and workers (NCCL/RCCL, OFI/CXI, IB HCA, …)."""
    liveness: LivenessSpec = field(default_factory=LivenessSpec)
    """When a silent worker counts as lost (:class:`LivenessSpec`)."""
    source: str = ""
    """Path the config was loaded from ("" when built in code)."""

    @property
    def device_kind(self) -> str:
        return self.device.kind

    @property
    def device_memory_bytes(self) -> int:
        """Capacity of one device in bytes (``memory_gib · 2^30``)."""
        return int(round(self.device.memory_gib * GIB))

    @property
    def total_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.device.hbm_gbps * 1e9

    @property
    def layer_launch_s(self) -> float:
        """:attr:`DeviceSpec.layer_launch_us` in seconds."""
        return self.device.layer_launch_us * 1e-6

    def busy_speedup(self, busy: int) -> float:
        """How much faster than its fair share (this site's per-device figures) each device of a
        node runs while ``busy`` of the node's devices compute: ``min(dpn/cores, dpn/busy)``
        when the devices share ``host_cores`` cores (:attr:`DeviceSpec.host_cores`), else 1."""
        cores, dpn = self.device.host_cores, self.devices_per_node
        if not 0 < cores < dpn:
            return 1.0
        return min(dpn / cores, dpn / max(1, busy))

    def lone_speedup(self, devices: int) -> float:
        """:meth:`busy_speedup` of one device, for a model-stage on ``devices`` packed devices
        that holds every device of each node it is on (so nothing else runs there: a
        pipeline's fill and drain free cores for its busy stages); else 1.

        Like :meth:`nereusd.cost.model.CostModel.spans_nodes`, it counts devices and assumes
        them packed node by node (what placement does): a stage on devices ``0, 1, 2, 4`` of a
        four-device node is taken as one whole node. A stage on part of a node gets no speed-up
        even when nothing else runs beside it (a pool of three local devices)."""
        if devices % self.devices_per_node:
            return 1.0
        return self.busy_speedup(1)

    def with_busy_devices(self, busy: int) -> "SiteConfig":
        """This site as seen by ``busy`` devices per node with the others idle: compute,
        memory bandwidth and per-layer dispatch :meth:`busy_speedup` times faster (a benchmark
        that runs two engines on a four-device, two-core node gives each a whole core)."""
        f = self.busy_speedup(busy)
        if f == 1.0:
            return self
        d = self.device
        return dataclasses.replace(self, device=dataclasses.replace(
            d, peak_tflops=MappingProxyType({k: v * f for k, v in d.peak_tflops.items()}),
            hbm_gbps=d.hbm_gbps * f, layer_launch_us=d.layer_launch_us / f))

    @property
    def intra_node_gbps(self) -> float:
        return self.network.intra_node_gbps

    @property
    def inter_node_gbps(self) -> float:
        return self.network.inter_node_gbps

    @property
    def compute_dtype(self) -> str:
        return self.device.compute_dtype

    @property
    def batches_p2p(self) -> bool:
        """Whether the devices' communication library runs a batch of point-to-point sends and
        receives (``torch.distributed.batch_isend_irecv``) as one call: NCCL and RCCL do (a group
        call), gloo, on ``cpu`` devices, runs each op on its own and pays its latency per op."""
        return self.device.kind != "cpu"

    def peak_flops(self, dtype: str | None = None) -> float:
        """Dense peak FLOP/s of one device for ``dtype`` (default: the site's ``compute_dtype``).

        Falls back to fp32 when the dtype is not listed (a CPU without bf16 units).

        Raises:
            ConfigError: if neither ``dtype`` nor fp32 is listed.
        """
        peaks = self.device.peak_tflops
        dtype = dtype or self.device.compute_dtype
        if dtype in peaks:
            return peaks[dtype] * 1e12
        if "fp32" in peaks:
            return peaks["fp32"] * 1e12
        raise ConfigError(f"{Path(self.source).name if self.source else self.name}: device.peak_tflops: no entry "
                          f"for {dtype!r}" + ("" if dtype == "fp32" else " nor for fp32, its fallback"))

    def node_of(self, device: int) -> int:
        """Node index of global device index ``device`` (``device // devices_per_node``)."""
        return device // self.devices_per_node

    def with_nodes(self, nodes: int) -> "SiteConfig":
        """The same site with another node count (a new object; this one is unchanged).

        Raises:
            ConfigError: if ``nodes`` < 1.
        """
        if not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"{self.name}: nodes: expected a positive integer, got {nodes!r}")
        return dataclasses.replace(self, nodes=nodes)


def resolve_site_path(path_or_name: str | os.PathLike) -> Path:
    """Find the YAML for a path or a bare site name.

    A value containing a path separator or ending in ``.yaml``/``.yml`` is a path. A bare name
    ``NAME`` is looked up as ``NAME.yaml`` in the directories of ``$NEREUS_SITE_CONFIGS`` (if set,
    in order), then in the repository's ``site_configs/``.

    Raises:
        ConfigError: if nothing is found; the message lists where it looked.
    """
    text = os.fspath(path_or_name)
    shown = shortened(text)
    try:
        if os.sep in text or "/" in text or text.endswith((".yaml", ".yml")):
            path = Path(text)
            if not path.is_file():
                raise ConfigError(f"{text}: " + ("a directory, not a site config file" if path.is_dir()
                                                 else "no such site config file"))
            return path
        dirs = [Path(d) for d in os.environ.get("NEREUS_SITE_CONFIGS", "").split(os.pathsep) if d]
        dirs.append(SITE_CONFIG_DIR)
        for d in dirs:
            candidate = d / f"{text}.yaml"
            if candidate.is_file():
                return candidate
    except OSError as err:   # a name too long for the file system
        raise ConfigError(f"site {shown}: {err.strerror}") from None
    known = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})
    raise ConfigError(f"site {text!r}: not found in {[str(d) for d in dirs]} (known: {known})")


def require_site(path_or_name: str | os.PathLike, key: str) -> None:
    """Check that the site ``key`` names exists (:func:`resolve_site_path`): a site that is not
    there is the error of where it was named (``job.yaml: site``, ``--site``), while a malformed
    one names its own file when it is loaded.

    Raises:
        ConfigError: ``<key>: site '<name>': not found …``.
    """
    try:
        resolve_site_path(path_or_name)
    except ConfigError as err:
        raise ConfigError(f"{key}: {err}") from None


def load_site(path_or_name: str | os.PathLike) -> SiteConfig:
    """Load and validate a site config from a path or a bare name (see :func:`resolve_site_path`).

    Raises:
        ConfigError: ``<file>: <dotted.key>: <problem>`` for unknown or missing keys and values
            of the wrong type or range; also for unreadable files or YAML syntax errors.
    """
    from nereusd.config.yamlfile import read_yaml

    path = resolve_site_path(path_or_name)
    data = read_yaml(path)
    if data is None:   # nothing but comments: "<top>: expected a mapping, got None" said less
        raise ConfigError(f"{path}: the file is empty (a site config is a mapping: name, nodes, device, network, …)")
    return site_from_dict(data, source=str(path))


def site_from_dict(data: Any, source: str = "<site>") -> SiteConfig:
    """Validate a parsed YAML document into a :class:`SiteConfig`.

    Raises:
        ConfigError: as :func:`load_site`, naming ``source``, the file's path.
    """
    label = source
    site = _build(SiteConfig, data, label, "", skip=("source",))
    if site.slurm is not None:
        check_slurm(site.slurm, device_kind=site.device.kind, devices_per_node=site.devices_per_node, label=label)
    check_env(site.env, label=label)
    return dataclasses.replace(site, source=source)


# ---------------------------------------------------------------------------------------------
# The strict builder: walks a frozen dataclass's fields and their type hints.

def _fail(label: str, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{label}: {key or '<top>'}: {problem}")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _build(cls: type, data: Any, label: str, prefix: str, skip: tuple[str, ...] = ()) -> Any:
    if not isinstance(data, Mapping):
        raise _fail(label, prefix, f"expected a mapping, got {shortened(data)}")   # not a whole foreign file
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise _fail(label, _join(prefix, unknown[0]), f"unknown key (allowed: {sorted(fields)})")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _fail(label, key, "required key is missing")
            continue
        kwargs[name] = _value(hints[name], data[name], label, key)
    _check_ranges(cls, kwargs, label, prefix)
    return cls(**kwargs)


def _value(hint: Any, value: Any, label: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, label, key)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        assert len(args) == 1, hint
        return _value(args[0], value, label, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise _fail(label, key, f"expected true or false, got {value!r}")
        return value
    if hint == tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise _fail(label, key, f"expected a list of strings, got {value!r}")
        return tuple(value)
    if hint is str:
        if not isinstance(value, str):
            raise _fail(label, key, f"expected a string, got {value!r}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(label, key, f"expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str) and YAML11_EXPONENT.fullmatch(value.strip()):
            value = float(value)   # YAML 1.1 reads 5e-1 (no dot) as a string; a job file's loader takes it too
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _fail(label, key, f"expected a number, got {value!r}")
        try:
            number = float(value)   # an integer past a float's range raises OverflowError
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise _fail(label, key, f"expected a finite number, got {str(value)[:40]}")
        return number
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise _fail(label, key, f"expected one of {list(allowed)}, got {value!r}")
        return value
    if hint == Mapping[str, float]:
        if not isinstance(value, Mapping):
            raise _fail(label, key, f"expected a mapping, got {shortened(value)}")
        out = {}
        for k, v in value.items():
            if k not in DTYPES:
                raise _fail(label, f"{key}.{k}", f"unknown dtype (allowed: {list(DTYPES)})")
            out[k] = _value(float, v, label, f"{key}.{k}")
            if out[k] <= 0:
                raise _fail(label, f"{key}.{k}", f"expected a positive number, got {v!r}")
            if out[k] > 1e6:   # the only such mapping is peak_tflops
                raise _fail(label, f"{key}.{k}", f"{v!r} is implausibly large (at most 1e+06 TFLOP/s; the unit is "
                            "10^12 FLOP/s per device)")
            if out[k] < 1e-6:
                raise _fail(label, f"{key}.{k}", f"{v!r} is implausibly small (at least 1e-06 TFLOP/s, a "
                            "MFLOP/s; the unit is 10^12 FLOP/s per device)")
        if not out:
            raise _fail(label, key, "expected at least one dtype")
        return MappingProxyType(out)
    if hint == Mapping[str, str]:
        if not isinstance(value, Mapping):
            raise _fail(label, key, f"expected a mapping of names to strings, got {value!r}")
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise _fail(label, f"{key}.{k}", f"expected a string value, got {v!r}")
        return MappingProxyType(dict(value))
    raise AssertionError(f"site loader cannot handle {hint!r} at {key}")


_POSITIVE = {
    SiteConfig: ("nodes", "devices_per_node"),
    DeviceSpec: ("memory_gib", "hbm_gbps"),
    NetworkSpec: ("intra_node_gbps", "inter_node_gbps"),
    LivenessSpec: ("worker_stall_s", "resume_grace_s", "straggler_factor", "straggler_min_s", "task_max_s"),
}
_MAXIMUM = {
    SiteConfig: {"nodes": 1e6, "devices_per_node": 1e4},
    DeviceSpec: {"memory_gib": 1e6, "hbm_gbps": 1e7, "layer_launch_us": 1e7, "host_cores": 1e5,
                 "host_link_gbps": 1e7, "host_staging_gib": 1e6},
    NetworkSpec: {"intra_node_gbps": 1e7, "inter_node_gbps": 1e7, "intra_node_latency_us": 1e7,
                  "inter_node_latency_us": 1e7, "communicator_setup_s": 1e4, "intra_node_latency_growth": 10.0,
                  "inter_node_latency_growth": 10.0, "intra_node_all_reduce_efficiency": MAX_EFFICIENCY,
                  "inter_node_all_reduce_efficiency": MAX_EFFICIENCY},
    LivenessSpec: {"worker_stall_s": 1e7, "resume_grace_s": 1e7, "straggler_factor": 1e6, "straggler_min_s": 1e7,
                   "task_max_s": 1e7},
}
"""Upper bounds far above any real value (a 1 PiB device, a 10 s layer launch): what they catch is
a wrong unit or a typo, which would otherwise overflow the byte counts or price every step at
centuries."""
_MINIMUM = {
    DeviceSpec: {"memory_gib": 1e-6, "hbm_gbps": 1e-3, "host_link_gbps": 1e-3},
    NetworkSpec: {"intra_node_gbps": 1e-3, "inter_node_gbps": 1e-3},
}
"""Lower bounds far below any real value (a KiB device, a MB/s link) for the keys the cost model
divides by: ``hbm_gbps: 1e-300`` priced a step at 1e296 s and ``simulate`` grew to 17 GB."""
_NON_NEGATIVE = {NetworkSpec: ("intra_node_latency_us", "inter_node_latency_us", "communicator_setup_s",
                              "intra_node_latency_growth", "inter_node_latency_growth",
                              "intra_node_all_reduce_efficiency", "inter_node_all_reduce_efficiency"),
                 DeviceSpec: ("layer_launch_us", "host_cores", "host_link_gbps", "host_staging_gib")}


def _check_ranges(cls: type, kwargs: dict, label: str, prefix: str) -> None:
    for name in _POSITIVE.get(cls, ()):
        if name in kwargs and kwargs[name] <= 0:
            raise _fail(label, _join(prefix, name), f"expected a positive number, got {kwargs[name]!r}")
    for name in _NON_NEGATIVE.get(cls, ()):
        if name in kwargs and kwargs[name] < 0:
            raise _fail(label, _join(prefix, name), f"expected a number >= 0, got {kwargs[name]!r}")
    for name, limit in _MINIMUM.get(cls, {}).items():
        if name in kwargs and 0 < kwargs[name] < limit:
            raise _fail(label, _join(prefix, name), f"{kwargs[name]!r} is implausibly small (at least {limit:g}; "
                        "check the unit in the key's name)")
    for name, limit in _MAXIMUM.get(cls, {}).items():
        if name in kwargs and kwargs[name] > limit:
            raise _fail(label, _join(prefix, name), f"{kwargs[name]!r} is implausibly large (at most {limit:g}; "
                        "check the unit in the key's name)")
    if cls is DeviceSpec and "peak_tflops" in kwargs:
        dtype = kwargs.get("compute_dtype", "bf16")
        if dtype not in kwargs["peak_tflops"] and "fp32" not in kwargs["peak_tflops"]:
            fallback = "" if dtype == "fp32" else " nor for fp32, its fallback"
            raise _fail(label, _join(prefix, "peak_tflops"), f"no entry for the compute dtype {dtype!r} "
                        f"({_join(prefix, 'compute_dtype')}){fallback}: the cost model prices every FLOP at "
                        "that peak")
    for key in ("host_link_gbps", "host_staging_gib"):
        if cls is DeviceSpec and kwargs.get(key) and kwargs.get("kind") == "cpu":
            raise _fail(label, _join(prefix, key), "host staging is for accelerators; a virtual CPU device's "
                        "memory is host memory already (leave it out)")
    if cls is DeviceSpec and bool(kwargs.get("host_link_gbps")) != bool(kwargs.get("host_staging_gib")):
        given, missing = (("host_link_gbps", "host_staging_gib") if kwargs.get("host_link_gbps")
                          else ("host_staging_gib", "host_link_gbps"))
        raise _fail(label, _join(prefix, missing), f"required with {_join(prefix, given)}: host staging needs "
                    "both the link's speed and the host memory a device may borrow (leave both out to turn it off)")
    if cls is DeviceSpec and kwargs.get("host_cores") and kwargs.get("kind") != "cpu":
        raise _fail(label, _join(prefix, "host_cores"), f"describes virtual CPU devices sharing cores; "
                    f"device.kind is {kwargs.get('kind')!r} (each GPU has its own compute: leave it out)")
