"""Site configs: shipped YAMLs load; malformed ones fail with file and dotted key."""

from __future__ import annotations

from pathlib import Path

import os
import pytest
import yaml

from nereusd.errors import ConfigError
from nereusd.config.site import SITE_CONFIG_DIR, load_site, site_from_dict

SHIPPED = ["local", "h200-ib", "a100-ib", "frontier-mi250x", "l40s-pcie"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_by_name_and_by_path(name):
    by_name = load_site(name)
    by_path = load_site(str(SITE_CONFIG_DIR / f"{name}.yaml"))
    assert by_name.name == name
    assert by_name.device_memory_bytes == by_path.device_memory_bytes > 0
    assert by_name.device_kind in ("cpu", "cuda", "rocm")
    assert by_name.peak_flops() > 0 and by_name.hbm_bytes_per_s > 0
    assert by_name.intra_node_gbps >= by_name.inter_node_gbps > 0


def test_local_shape():
    site = load_site("local")
    assert (site.nodes, site.devices_per_node, site.device_kind) == (1, 4, "cpu")
    assert site.device_memory_bytes == 512 * 2**20
    assert site.compute_dtype == "fp32"


def test_env_var_directory_first(tmp_path, monkeypatch):
    doc = yaml.safe_load((SITE_CONFIG_DIR / "local.yaml").read_text())
    doc["nodes"] = 3
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("NEREUS_SITE_CONFIGS", str(tmp_path))
    assert load_site("local").nodes == 3


def test_unknown_name_lists_known():
    with pytest.raises(ConfigError, match=r"site 'nosuch': not found .*h200-ib"):
        load_site("nosuch")


def test_missing_path(tmp_path):
    with pytest.raises(ConfigError, match=r"nope/x.yaml: no such site config file"):
        load_site("nope/x.yaml")
    (tmp_path / "site.yaml").mkdir()   # it said "no such site config file" (an adversarial trial)
    with pytest.raises(ConfigError, match=r"site.yaml: a directory, not a site config file"):
        load_site(str(tmp_path / "site.yaml"))


def _write(tmp_path: Path, mutate) -> Path:
    doc = yaml.safe_load((SITE_CONFIG_DIR / "h200-ib.yaml").read_text())
    mutate(doc)
    path = tmp_path / "h200-ib.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_numbers_in_exponent_form_without_a_dot_read_as_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads ``5e-1`` as a string; a site file refused it ("expected a number,
    got '5e-1'") where a job file's loader takes it (an adversarial helper, 2026-12-05)."""
    path = tmp_path / "sci.yaml"
    text = (SITE_CONFIG_DIR / "local.yaml").read_text()
    path.write_text(text.replace("  memory_gib: 0.5 ", "  memory_gib: 5e-1 ").replace("  hbm_gbps: 8.0 ", "  hbm_gbps: 8E0 "))
    site = load_site(path)
    assert site.device.memory_gib == 0.5 and site.device.hbm_gbps == 8.0
    path.write_text(text.replace("  memory_gib: 0.5 ", "  memory_gib: 5e-1x "))
    with pytest.raises(ConfigError, match=r"device.memory_gib: expected a number, got '5e-1x'"):
        load_site(path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["network"].__setitem__("inter_node_gbps", "fast"),
         r"/h200-ib.yaml: network.inter_node_gbps: expected a number, got 'fast'$"),
        (lambda d: d.__setitem__("nodes", 2.5), r"/h200-ib.yaml: nodes: expected an integer, got 2.5$"),
        (lambda d: d.__setitem__("nodes", 0), r"/h200-ib.yaml: nodes: expected a positive number, got 0$"),
        (lambda d: d.__setitem__("devices_per_node", True), r"devices_per_node: expected an integer, got True"),
        (lambda d: d.__setitem__("colour", "red"), r"/h200-ib.yaml: colour: unknown key"),
        (lambda d: d["device"].__setitem__("memory_gb", 1), r"/h200-ib.yaml: device.memory_gb: unknown key"),
        (lambda d: d["device"].pop("memory_gib"), r"/h200-ib.yaml: device.memory_gib: required key is missing$"),
        (lambda d: d["device"].__setitem__("kind", "tpu"),
         r"/h200-ib.yaml: device.kind: expected one of \['cpu', 'cuda', 'rocm'\], got 'tpu'$"),
        (lambda d: d["device"]["peak_tflops"].__setitem__("int4", 3), r"device.peak_tflops.int4: unknown dtype"),
        (lambda d: d["device"]["peak_tflops"].__setitem__("bf16", -1), r"device.peak_tflops.bf16: expected a positive"),
        (lambda d: d["device"].__setitem__("peak_tflops", {}), r"device.peak_tflops: expected at least one dtype"),
        (lambda d: d.__setitem__("network", [1, 2]), r"/h200-ib.yaml: network: expected a mapping, got \[1, 2\]$"),
        (lambda d: d["network"].__setitem__("communicator_setup_s", -1), r"network.communicator_setup_s: expected a number >= 0"),
        (lambda d: d.__setitem__("env", {"NCCL_DEBUG": 3}), r"env.NCCL_DEBUG: expected a string value, got 3"),
        (lambda d: d.__setitem__("slurm", {"partition": {"a": 1}}), r"slurm.partition: expected a string, got \{'a': 1\}"),
        (lambda d: d["device"].__setitem__("host_cores", -2), r"device.host_cores: expected a number >= 0, got -2"),
        (lambda d: d["device"].__setitem__("host_cores", 2.5), r"device.host_cores: expected an integer, got 2.5"),
        (lambda d: d["device"].__setitem__("host_cores", 4),
         r"/h200-ib.yaml: device.host_cores: describes virtual CPU devices sharing cores; device.kind is 'cuda'"),
        (lambda d: d["device"].__setitem__("host_link_gbps", -1), r"device.host_link_gbps: expected a number >= 0"),
        (lambda d: d["device"].__setitem__("host_staging_gib", "32G"), r"device.host_staging_gib: expected a number"),
        (lambda d: d["device"].__setitem__("host_link_gbps", 1e-9), r"device.host_link_gbps: 1e-09 is implausibly small"),
        (lambda d: d["device"].update(kind="cpu", host_link_gbps=0, host_staging_gib=4),
         r"/h200-ib.yaml: device.host_staging_gib: host staging is for accelerators"),
        # one without the other turned staging off without a word (2026-12-06)
        (lambda d: d["device"].pop("host_staging_gib"),
         r"/h200-ib.yaml: device.host_staging_gib: required with device.host_link_gbps"),
        (lambda d: d["device"].pop("host_link_gbps"),
         r"/h200-ib.yaml: device.host_link_gbps: required with device.host_staging_gib"),
        # a compute dtype without a peak (nor fp32's) was accepted, and the job failed once started
        (lambda d: d["device"].__setitem__("peak_tflops", {"fp16": 900.0}),
         r"/h200-ib.yaml: device.peak_tflops: no entry for the compute dtype 'bf16' \(device.compute_dtype\) nor for "
         r"fp32, its fallback"),
        # finite but absurd: overflowed the byte count, or priced steps at centuries
        (lambda d: d["device"].__setitem__("memory_gib", 1e308),
         r"/h200-ib.yaml: device.memory_gib: 1e\+308 is implausibly large \(at most 1e\+06"),
        (lambda d: d["network"].__setitem__("intra_node_latency_us", 1e300), r"network.intra_node_latency_us: 1e\+300 is"),
        (lambda d: d["network"].__setitem__("intra_node_latency_growth", -0.5),
         r"network.intra_node_latency_growth: expected a number >= 0, got -0.5"),
        (lambda d: d["network"].__setitem__("inter_node_latency_growth", 50), r"network.inter_node_latency_growth: 50"),
        (lambda d: d["network"].__setitem__("intra_node_all_reduce_efficiency", 80),
         r"network.intra_node_all_reduce_efficiency: 80.0 is implausibly large \(at most 1.5"),
        (lambda d: d["network"].__setitem__("inter_node_all_reduce_efficiency", -0.7),
         r"network.inter_node_all_reduce_efficiency: expected a number >= 0"),
        (lambda d: d["device"]["peak_tflops"].__setitem__("bf16", 1e30), r"device.peak_tflops.bf16: 1e\+30 is implausibly"),
        # tiny divisors priced a step at 1e296 s; simulate grew to 17 GB (a bad-input search, 2026-12-05)
        (lambda d: d["device"]["peak_tflops"].__setitem__("bf16", 1e-300),
         r"device.peak_tflops.bf16: 1e-300 is implausibly small"),
        (lambda d: d["device"].__setitem__("hbm_gbps", 1e-300), r"device.hbm_gbps: 1e-300 is implausibly small"),
        (lambda d: d["network"].__setitem__("inter_node_gbps", 1e-9), r"network.inter_node_gbps: 1e-09 is implausibly"),
    ],
)
def test_malformed(tmp_path, mutate, message):
    path = _write(tmp_path, mutate)
    with pytest.raises(ConfigError, match=message):
        load_site(str(path))


def test_slurm_and_env_sections(tmp_path):
    path = _write(tmp_path, lambda d: d.update(slurm={"partition": "gpu", "modules": ["cuda/12"], "gpus_per_node": 8},
                                               env={"NCCL_IB_HCA": "mlx5"}))
    site = load_site(str(path))
    assert site.slurm.modules == ("cuda/12",) and site.env["NCCL_IB_HCA"] == "mlx5"


def test_yaml_syntax_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML at line 2"):
        load_site(str(path))


def test_top_level_not_mapping():
    with pytest.raises(ConfigError, match=r"x.yaml: <top>: expected a mapping"):
        site_from_dict([1], source="x.yaml")


def test_with_nodes_is_a_copy():
    site = load_site("h200-ib")
    bigger = site.with_nodes(128)
    assert bigger.total_devices == 1024 and site.nodes == 16
    with pytest.raises(ConfigError, match="nodes: expected a positive integer, got 0"):
        site.with_nodes(0)


def test_a_foreign_file_given_as_a_site_is_not_echoed_whole(tmp_path):
    """``--site /etc/passwd`` printed the whole file in the error (an adversarial helper, 2026-12-05)."""
    path = tmp_path / "foreign.yaml"
    path.write_text("secret " * 500)
    with pytest.raises(ConfigError, match=r"/foreign.yaml: <top>: expected a mapping, got 'secret secret") as err:
        load_site(path)
    assert len(str(err.value)) < 200


def test_an_empty_site_file_says_so(tmp_path):
    """A site file of comments only read "<top>: expected a mapping, got None" (2026-12-06)."""
    path = tmp_path / "mine.yaml"
    path.write_text("# to fill in\n")
    with pytest.raises(ConfigError, match=r"mine.yaml: the file is empty"):
        load_site(str(path))


def test_env_var_holds_several_directories_in_order(tmp_path, monkeypatch):
    """``$NEREUS_SITE_CONFIGS`` is a ``:``-separated search path (the README's "a directory of";
    a docs audit, 2026-12-06, found ``/a:/b`` taken as one directory named so)."""
    doc = yaml.safe_load((SITE_CONFIG_DIR / "local.yaml").read_text())
    first, second = tmp_path / "a", tmp_path / "b"
    second.mkdir()
    first.mkdir()
    doc["nodes"] = 2
    (second / "mysite.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("NEREUS_SITE_CONFIGS", f"{first}{os.pathsep}{second}")
    assert load_site("mysite").nodes == 2
    doc["nodes"] = 5
    (first / "mysite.yaml").write_text(yaml.safe_dump(doc))
    assert load_site("mysite").nodes == 5
