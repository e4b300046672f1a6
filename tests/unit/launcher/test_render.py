"""Rendering the batch script: golden file per shipped site (main and grow), `bash -n` on each,
quoting of hostile values, no site literal in the template.

Regenerate the golden files after an intended change with ``NEREUS_UPDATE_GOLDEN=1 pytest tests/unit/launcher/test_render.py``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from launcher.render import RenderRequest, directives, load_template, render
from nereusd.errors import ConfigError
from nereusd.config.site import SITE_CONFIG_DIR, load_site

GOLDEN = Path(__file__).parent / "golden"
SITES = sorted(p.stem for p in SITE_CONFIG_DIR.glob("*.yaml"))
REQ = RenderRequest(job_path="/shared/jobs/job.yaml", run_dir="/shared/runs/job-1", job_name="counting-grpo",
                    nodes=2, python="/opt/nereus/bin/python", cpu_memory_bytes=536870912)


@pytest.mark.parametrize("mode", ["main", "grow", "resume"])
@pytest.mark.parametrize("name", SITES)
def test_golden_and_bash_syntax(name, mode, tmp_path):
    text = render(load_template(), load_site(name), dataclasses.replace(REQ, mode=mode))
    golden = GOLDEN / f"{name}.{mode}.sbatch"
    if os.environ.get("NEREUS_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"rendered script differs from {golden}"
    script = tmp_path / "s.sbatch"
    script.write_text(text)
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = text.splitlines()
    sbatch = [line for line in lines if line.startswith("#SBATCH ")]
    assert sbatch == sorted(sbatch) and "#SBATCH --no-kill" in sbatch
    assert lines.index(sbatch[-1]) < lines.index("set -euo pipefail")  # directives before any command
    assert ("#SBATCH --signal=B:USR2@" in text) == (mode != "grow")


def test_shipped_site_specifics():
    frontier = render(load_template(), load_site("frontier-mi250x"), REQ)
    assert "#SBATCH --gpus-per-node=8" in frontier and "export FI_PROVIDER=cxi" in frontier
    assert "export NEREUS_MODULES='PrgEnv-gnu/8.5.0 rocm/6.0.0 craype-accel-amd-gfx90a'" in frontier
    h200 = render(load_template(), load_site("h200-ib"), REQ)
    assert "#SBATCH --gpus-per-node=h200:8" in h200 and "#SBATCH --exclusive" in h200
    assert "export NCCL_SOCKET_IFNAME='^lo,docker0'" in h200 and "NEREUS_CONTAINER_RUNTIME=pyxis" in h200
    a100 = render(load_template(), load_site("a100-ib"), dataclasses.replace(REQ, account="proj 1; rm -rf /"))
    assert "#SBATCH --gres=gpu:4" in a100 and "export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3" in a100
    assert "#SBATCH --account='proj 1; rm -rf /'" in a100  # a hostile value stays one quoted word


def test_template_has_no_site_literal():
    code = "\n".join(line for line in load_template().splitlines() if not line.lstrip().startswith("#"))
    for name in SITES:
        site = load_site(name)
        literals = [site.slurm.partition, site.slurm.account, site.slurm.qos, *site.slurm.modules,
                    *site.env.keys(), *site.env.values()]
        for value in (v for v in literals if len(v) > 2):
            pattern = rf"(?<![\w.-]){re.escape(value)}(?![\w.-])"
            assert not re.search(pattern, code), f"{name}: {value!r} appears in sbatch/nereus.sbatch"


def test_paths_with_spaces_are_quoted(tmp_path):
    req = dataclasses.replace(REQ, run_dir="/shared/my runs/$HOME`x`", job_path="/a b/job's.yaml")
    text = render(load_template(), load_site("local"), req)
    assert "export NEREUS_RUN_DIR='/shared/my runs/$HOME`x`'" in text
    assert """export NEREUS_JOB='/a b/job'"'"'s.yaml'""" in text
    script = tmp_path / "s.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_render_refuses():
    site = load_site("local")
    with pytest.raises(ConfigError, match=r"no slurm: section"):
        directives(dataclasses.replace(site, slurm=None), REQ)
    with pytest.raises(ConfigError, match=r"--nodes: expected a positive integer, got 0"):
        directives(site, dataclasses.replace(REQ, nodes=0))
    with pytest.raises(ConfigError, match=r"expected exactly one '#@NEREUS_DIRECTIVES@' line, found 0"):
        render("#!/bin/bash\n", site, REQ)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_cli_render_prints_script(tmp_path, capsys):
    from launcher.cli import main

    job = tmp_path / "job.yaml"
    job.write_text("name: t\nsteps: 1\ndevices: 2\nmodels: {actor_config: {vocab_size: 16, hidden_size: 64, "
                   "intermediate_size: 128, num_layers: 2, num_heads: 4, num_kv_heads: 2, max_position: 96}}\n"
                   "rollout: {prompts_per_step: 2, group_size: 2, max_new_tokens: 8}\n"
                   "train: {global_batch: 4, micro_batch: 2}\n")
    assert main(["render", str(job), "--site", "local", "--nodes", "3", "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=3" in out and f"export NEREUS_JOB={job}" in out
    assert main(["render", str(job), "--site", "h200-ib"]) == 0  # 2 devices fit on one H200 node
    assert "#SBATCH --nodes=1" in capsys.readouterr().out
    assert main(["render", str(job), "--site", "local", "--time", "soon"]) == 2
    assert "--time: expected MM" in capsys.readouterr().err
    # --nodes 0 rendered the default node count; an --account was written into #SBATCH unchecked
    # (an adversarial helper, 2026-12-05)
    for argv, says in ((["--nodes", "0"], "--nodes: expected 1..16,384 nodes"),
                       (["--nodes", "1000000"], "--nodes: expected 1..16,384 nodes"),
                       (["--account", "a;$(id)"], "--account: expected letters, digits and ._+- only")):
        assert main(["render", str(job), "--site", "local", *argv]) == 2
        assert says in capsys.readouterr().err


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """``nereus-launch … | head`` closes the pipe before the output ends: the command stops
    quietly with 141 (128 + SIGPIPE) instead of printing a BrokenPipeError traceback."""
    import sys

    job = tmp_path / "job.yaml"
    job.write_text("name: t\nsteps: 1\ndevices: 2\nmodels: {actor_config: {vocab_size: 16, hidden_size: 64, "
                   "intermediate_size: 128, num_layers: 2, num_heads: 4, num_kv_heads: 2, max_position: 96}}\n"
                   "rollout: {prompts_per_step: 2, group_size: 2, max_new_tokens: 8}\n"
                   "train: {global_batch: 4, micro_batch: 2}\n")
    read, write = os.pipe()
    os.close(read)   # the reader is gone before a byte is written
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "render", str(job), "--site", "local"],
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[3])
    os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr


def test_render_warns_when_the_jobs_memory_overrides_another_sites(tmp_path, capsys):
    """A job written for the local site with ``memory_gib`` rendered for a GPU site: its memory
    caps every GPU (the README's example did this without a word; a new user's trial). Below
    the GPU's 1.5 GiB workspace it is refused."""
    from launcher.cli import main

    job = tmp_path / "job.yaml"
    base = ("name: t\nsteps: 1\ndevices: 2\nsite: local\nmodels: {actor_config: {vocab_size: 16, hidden_size: 64, "
            "intermediate_size: 128, num_layers: 2, num_heads: 4, num_kv_heads: 2, max_position: 96}}\n"
            "rollout: {prompts_per_step: 2, group_size: 2, max_new_tokens: 8}\ntrain: {global_batch: 4, micro_batch: 2}\n")
    job.write_text(base + "memory_gib: 4\n")
    assert main(["render", str(job), "--site", "h200-ib"]) == 0
    err = capsys.readouterr().err
    assert "warning: job.yaml: memory_gib 4 GiB (written for site 'local') overrides site h200-ib's 140 GiB" in err
    job.write_text(base + "memory_gib: 0.05\n")
    assert main(["render", str(job), "--site", "h200-ib"]) == 2
    assert "do not exceed the 1536 MiB workspace every cuda device books" in capsys.readouterr().err
    job.write_text(base)
    assert main(["render", str(job), "--site", "h200-ib"]) == 0 and "warning" not in capsys.readouterr().err
