"""The ``slurm:`` and ``env:`` sections of site configs: shipped sites carry what their network
needs, and every malformed value is refused with the file and the dotted key."""

from __future__ import annotations

import pytest
import yaml

from nereusd.errors import ConfigError
from nereusd.config.site import SITE_CONFIG_DIR, load_site


def test_shipped_sections():
    frontier = load_site("frontier-mi250x")
    assert frontier.env["FI_PROVIDER"] == "cxi" and frontier.env["NCCL_SOCKET_IFNAME"] == "hsn0"
    assert frontier.slurm.gpus_per_node == 8 and frontier.slurm.gres_syntax == "gpus-per-node"
    for name in ("a100-ib", "h200-ib"):
        site = load_site(name)
        assert site.env["NCCL_IB_HCA"].startswith("mlx5_") and "NCCL_SOCKET_IFNAME" in site.env
        assert site.slurm.gpus_per_node == site.devices_per_node
    assert load_site("h200-ib").slurm.container.runtime == "pyxis"
    local = load_site("local")
    assert local.slurm.partition == "debug" and local.env["GLOO_SOCKET_IFNAME"] == "lo"


def _load(tmp_path, slurm=None, env=None, kind=None):
    doc = yaml.safe_load((SITE_CONFIG_DIR / "a100-ib.yaml").read_text())
    if slurm is not None:
        doc["slurm"].update(slurm)
    if env is not None:
        doc["env"] = env
    if kind:
        doc["device"]["kind"] = kind
        if kind == "cpu":   # host staging is for accelerators
            doc["device"].pop("host_link_gbps", None)
            doc["device"].pop("host_staging_gib", None)
    path = tmp_path / "a100-ib.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_site(str(path))


@pytest.mark.parametrize("slurm, message", [
    ({"partition": "gpu nodes"}, r"/a100-ib.yaml: slurm.partition: expected letters, digits and ._\+- only, got 'gpu nodes'$"),
    ({"time_limit": "1 day"}, r"slurm.time_limit: expected MM, MM:SS, HH:MM:SS or D-HH\[:MM\[:SS\]\], got '1 day'"),
    ({"time_limit": "24:00:00:00"}, r"slurm.time_limit: expected MM"),
    ({"gpus_per_node": 8}, r"slurm.gpus_per_node: expected devices_per_node = 4 \(one worker per GPU of the node\), got 8"),
    ({"gpus_per_node": 0}, r"slurm.gpus_per_node: a cuda site must request its GPUs \(expected 4\) or set gres_syntax: none"),
    ({"gres_syntax": "none"}, r"slurm.gres_syntax: 'none' requests no GPUs"),
    ({"gres_syntax": "gpu"}, r"slurm.gres_syntax: expected one of \['gres', 'gpus-per-node', 'none'\], got 'gpu'"),
    ({"exclusive": "yes"}, r"slurm.exclusive: expected true or false, got 'yes'"),
    ({"modules": "cuda"}, r"slurm.modules: expected a list of strings, got 'cuda'"),
    ({"modules": ["cuda 12"]}, r"slurm.modules.0: expected one module name without spaces"),
    ({"preempt_signal_s": -5}, r"slurm.preempt_signal_s: expected a number >= 0, got -5"),
    ({"preempt_signal_s": 999999}, r"slurm.preempt_signal_s: 999999 s is more than sbatch's --signal takes \(65535 s\)"),
    ({"preempt_signal_s": 1795, "time_limit": "00:30:00"},
     r"slurm.preempt_signal_s: the preemption warning 1795 s before the end of a 00:30:00 time limit \(1800 s\) "
     r"comes in its first half"),
    ({"control_port": 70000}, r"slurm.control_port: expected a port 0..65535, got 70000"),
    ({"constraint": "a;rm -rf"}, r"slurm.constraint: not a Slurm feature expression"),
    ({"reservation": "x"}, r"/a100-ib.yaml: slurm.reservation: unknown key"),
    ({"container": {"runtime": "docker", "image": "x"}}, r"slurm.container.runtime: expected one of \['apptainer', 'pyxis'\]"),
    ({"container": {"runtime": "pyxis"}}, r"slurm.container.image: required key is missing"),
    ({"container": {"runtime": "pyxis", "image": "i", "mounts": ["/a,/b"]}}, r"slurm.container.mounts.0: expected SRC\[:DST\]"),
])
def test_bad_slurm(tmp_path, slurm, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, slurm=slurm)


@pytest.mark.parametrize("env, message", [
    ({"NCCL-IB": "x"}, r"/a100-ib.yaml: env.NCCL-IB: not a valid environment variable name$"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, r"env.CUDA_VISIBLE_DEVICES: set by Slurm or Nereus"),
    ({"SLURM_NNODES": "2"}, r"env.SLURM_NNODES: set by Slurm or Nereus"),
    ({"NCCL_DEBUG": "INFO\nrm -rf /"}, r"env.NCCL_DEBUG: value may not contain a newline"),
    ({"NCCL_DEBUG": 3}, r"env.NCCL_DEBUG: expected a string value, got 3"),
])
def test_bad_env(tmp_path, env, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, env=env)


def test_cpu_site_may_request_no_gpus(tmp_path):
    site = _load(tmp_path, slurm={"gpus_per_node": 0}, kind="cpu")
    assert site.slurm.gpus_per_node == 0


def test_site_without_slurm_section_loads():
    doc = yaml.safe_load((SITE_CONFIG_DIR / "a100-ib.yaml").read_text())
    del doc["slurm"]
    from nereusd.config.site import site_from_dict
    assert site_from_dict(doc, "x.yaml").slurm is None


@pytest.mark.parametrize("text, seconds", [("30", 1800), ("30:15", 1815), ("02:00:00", 7200), ("1-00", 86400),
                                           ("1-02:30", 95400), ("2-00:00:05", 172805), ("0", 0)])
def test_time_limit_seconds_follow_sbatchs_formats(text, seconds):
    from nereusd.config.site_slurm import time_limit_s

    assert time_limit_s(text) == seconds
