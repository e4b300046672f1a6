"""Read and write Hugging Face-format model directories as canonical full tensors.

A directory holds ``config.json`` (:meth:`ModelSpec.to_hf_config`) and ``model.safetensors``
(the ``safetensors`` library's format) with HF Llama parameter names — the canonical state the
engine loads from and gathers to (:mod:`emu.engine.model`). Sharded checkpoints
(``model.safetensors.index.json`` with several files) are read as well.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nereusd.hf_files import WEIGHTS_NAME, safetensors_files
from nereusd.models import ModelSpec

log = logging.getLogger(__name__)


def save_pretrained(path: str | Path, spec: ModelSpec, state: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into directory ``path`` (created).

    Args:
        state: canonical full tensors (HF names); stored contiguous, as given (fp32 here).

    Returns:
        The directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(spec.to_hf_config(), indent=2, sort_keys=True) + "\n")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    log.info("saved %d tensors to %s", len(tensors), out)
    return out


def load_pretrained(path: str | Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Read a model directory: its :class:`ModelSpec` and canonical full tensors (CPU).

    Raises:
        ConfigError: if ``config.json`` is missing or bad, or no safetensors weights exist.
    """
    src = Path(path)
    spec = ModelSpec.from_pretrained_dir(src)
    return spec, load_state(src)


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Canonical full tensors of the directory's ``model.safetensors`` (or its index's shards).

    Raises:
        ConfigError: as :func:`nereusd.hf_files.safetensors_files`.
    """
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        state.update(load_file(str(file)))
    return state
