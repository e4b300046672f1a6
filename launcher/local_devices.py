"""The devices ``nereus-launch local`` runs on, checked before anything starts: GPUs that must be
there (``--gpus``), and a site that describes other devices than those."""

from __future__ import annotations

from nereusd.errors import NereusError


def check_gpus() -> None:
    """``--gpus`` on a node without a GPU is refused before any process starts and before the run
    directory is touched; it used to start nereusd and the agent, whose probe then failed. The
    agent's own probe (:func:`emu.inventory.discover`).

    Raises:
        NereusError: no NVIDIA or AMD GPU is visible to this process.
    """
    from emu.inventory import probe_amd, probe_nvidia

    if not (probe_nvidia() or probe_amd()):
        raise NereusError("--gpus: no NVIDIA or AMD GPU found on this node; without --gpus the job runs on "
                          "virtual CPU devices")


def site_mismatch(site, gpus: bool) -> str | None:
    """Why the job's site does not describe the devices ``local`` runs (``None`` when it does): a
    GPU site without ``--gpus`` gives virtual CPU devices that GPU's memory and figures, and the
    planner plans for them."""
    if gpus or site.device_kind == "cpu":
        return None
    return (f"site {site.name!r} describes {site.device_kind} devices of {site.device.memory_gib:g} GiB; without "
            f"--gpus this job runs on virtual CPU devices given that memory, and plans with that site's "
            f"figures (site: local describes this machine)")
