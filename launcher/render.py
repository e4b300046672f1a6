"""Render ``sbatch/nereus.sbatch`` for a job on a site: a pure function, golden-file tested.

:func:`render` puts the site's ``#SBATCH`` directives (sorted by option, values shell-quoted)
at the template's ``#@NEREUS_DIRECTIVES@`` line and ``export`` lines (site ``env:`` first, then
the ``NEREUS_*`` variables the template documents, each sorted and shell-quoted) at its
``#@NEREUS_ENVIRONMENT@`` line. The template holds no site literal; everything site-specific
comes from :class:`~nereusd.config.site_slurm.SlurmSpec` and the site's ``env:``.

Sources: ``man sbatch`` for the directives; submitit's ``_make_sbatch_string`` for the shape
(sorted directives, quoted values).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from nereusd.errors import ConfigError
from nereusd.config.site import SiteConfig

TEMPLATE = Path(__file__).resolve().parent.parent / "sbatch" / "nereus.sbatch"
DIRECTIVES_MARK = "#@NEREUS_DIRECTIVES@"
ENVIRONMENT_MARK = "#@NEREUS_ENVIRONMENT@"


@dataclass(frozen=True, kw_only=True)
class RenderRequest:
    """Everything a rendered script depends on besides the site and the template."""

    job_path: str
    """Absolute path of the job YAML on the cluster's shared file system."""
    run_dir: str
    """Absolute run directory on the shared file system."""
    job_name: str
    """``--job-name``."""
    nodes: int
    """``--nodes`` of this allocation."""
    python: str
    """Interpreter on the compute nodes (the site's ``slurm.python`` wins when set)."""
    mode: str = "main"
    """``main`` (nereusd + agents) or ``grow`` (agents joining a running nereusd)."""
    cpu_memory_bytes: int = 2**30
    """Accounted memory of a virtual CPU device (CPU sites only)."""
    account: str = ""
    """Overrides ``slurm.account`` (``nereus-launch submit --account``)."""
    time_limit: str = ""
    """Overrides ``slurm.time_limit``."""


def load_template() -> str:
    """The batch template's text (``sbatch/nereus.sbatch`` of this checkout).

    Raises:
        ConfigError: the template is missing (an install without the repository's ``sbatch/``).
    """
    try:
        return TEMPLATE.read_text()
    except OSError as err:
        raise ConfigError(f"{TEMPLATE}: cannot read the batch template: {err}") from None


def directives(site: SiteConfig, req: RenderRequest) -> list[tuple[str, str | None]]:
    """``(option, value)`` pairs for the ``#SBATCH`` lines, sorted by option (value ``None``: a flag).

    Raises:
        ConfigError: the site has no ``slurm:`` section, or the request is invalid.
    """
    spec = site.slurm
    if spec is None:
        raise ConfigError(f"{site.source or site.name}: no slurm: section; this site cannot be submitted to")
    if req.nodes < 1:
        raise ConfigError(f"--nodes: expected a positive integer, got {req.nodes}")
    if req.mode not in ("main", "grow", "resume"):
        raise ConfigError(f"mode: expected 'main', 'grow' or 'resume', got {req.mode!r}")
    out: dict[str, str | None] = {
        "--job-name": f"{req.job_name}-grow" if req.mode == "grow" else req.job_name,
        "--nodes": str(req.nodes),
        "--ntasks-per-node": "1",
        "--no-kill": None,
        "--output": f"{req.run_dir}/logs/slurm-%j.out",
        "--time": req.time_limit or spec.time_limit,
    }
    for option, value in (("--partition", spec.partition), ("--account", req.account or spec.account),
                          ("--qos", spec.qos), ("--constraint", spec.constraint)):
        if value:
            out[option] = value
    if spec.cpus_per_task:
        out["--cpus-per-task"] = str(spec.cpus_per_task)
    if spec.exclusive:
        out["--exclusive"] = None
    if spec.preempt_signal_s and req.mode != "grow":
        out["--signal"] = f"B:USR2@{spec.preempt_signal_s}"
    if spec.gpus_per_node and spec.gres_syntax == "gres":
        out["--gres"] = f"gpu:{spec.gpu_type + ':' if spec.gpu_type else ''}{spec.gpus_per_node}"
    elif spec.gpus_per_node and spec.gres_syntax == "gpus-per-node":
        out["--gpus-per-node"] = f"{spec.gpu_type + ':' if spec.gpu_type else ''}{spec.gpus_per_node}"
    return sorted(out.items())


def environment(site: SiteConfig, req: RenderRequest) -> list[tuple[str, str]]:
    """``(name, value)`` exports: the site's ``env:`` (sorted), then ``NEREUS_*`` (sorted)."""
    spec = site.slurm
    assert spec is not None  # directives() checked it
    nereus = {
        "NEREUS_JOB": req.job_path,
        "NEREUS_RUN_DIR": req.run_dir,
        "NEREUS_MODE": req.mode,
        "NEREUS_PYTHON": spec.python or req.python,
        "NEREUS_CONTROL_PORT": str(spec.control_port),
        "NEREUS_HEARTBEAT_TIMEOUT_S": f"{spec.heartbeat_timeout_s:g}",
        "NEREUS_RESUME_GRACE_S": f"{site.liveness.resume_grace_s:g}",
    }
    if site.device.kind == "cpu":
        nereus["NEREUS_CPU_DEVICES"] = "slurm" if spec.gpus_per_node else str(site.devices_per_node)
        nereus["NEREUS_CPU_MEMORY_BYTES"] = str(req.cpu_memory_bytes)
    if spec.modules:
        nereus["NEREUS_MODULES"] = " ".join(spec.modules)
    if spec.container is not None:
        nereus["NEREUS_CONTAINER_RUNTIME"] = spec.container.runtime
        nereus["NEREUS_CONTAINER_IMAGE"] = spec.container.image
        if spec.container.mounts:
            nereus["NEREUS_CONTAINER_MOUNTS"] = ",".join(spec.container.mounts)
    return sorted(site.env.items()) + sorted(nereus.items())


def render(template: str, site: SiteConfig, req: RenderRequest) -> str:
    """The batch script for ``req`` on ``site`` (pure: same inputs, same text).

    Raises:
        ConfigError: the template lacks a marker line, the site has no ``slurm:`` section, or
            the request is invalid.
    """
    lines = template.splitlines()
    for mark in (DIRECTIVES_MARK, ENVIRONMENT_MARK):
        if lines.count(mark) != 1:
            raise ConfigError(f"batch template: expected exactly one {mark!r} line, found {lines.count(mark)}")
    sbatch = [f"#SBATCH {opt}" if value is None else f"#SBATCH {opt}={shlex.quote(value)}"
              for opt, value in directives(site, req)]
    header = [f"# rendered by nereus-launch for site {site.name!r} ({req.mode}); edit the site YAML, not this file"]
    exports = [f"export {name}={shlex.quote(value)}" for name, value in environment(site, req)]
    out: list[str] = []
    for line in lines:
        if line == DIRECTIVES_MARK:
            out += sbatch
        elif line == ENVIRONMENT_MARK:
            out += header + exports
        else:
            out.append(line)
    return "\n".join(out) + "\n"
