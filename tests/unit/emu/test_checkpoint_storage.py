"""A checkpoint write that the storage refuses is a StorageError naming the path (emu/state/checkpoint.py).

torch's ``CheckpointException`` derives from ``BaseException``: it used to escape the worker's
task handler, kill the worker, and read as a lost device.
"""

from __future__ import annotations

import warnings

import pytest

from emu.state.checkpoint import save_holdings, verify_checkpoint
from nereusd.errors import NereusError, StorageError


def test_a_failed_checkpoint_save_is_a_storage_error_naming_the_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # DCP's "no process group: single process" notice
        with pytest.raises(StorageError, match=r"checkpoint save in .*a-file/ckpt failed: NotADirectoryError.* \(\d+ bytes free there\)"):
            save_holdings([], blocker / "ckpt")
    assert issubclass(StorageError, NereusError)   # the worker reports it as a task failure, not a crash


def _saved(path):
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10)}, checkpoint_id=str(path),
                 no_dist=True)
    return path


def test_verify_accepts_a_complete_checkpoint(tmp_path):
    assert verify_checkpoint(_saved(tmp_path / "ok")) >= 1010 * 4


def test_verify_refuses_a_truncated_or_missing_file(tmp_path):
    path = _saved(tmp_path / "torn")
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(StorageError, match=r"torn is incomplete: .*\.distcp has 100 bytes"):
        verify_checkpoint(path)
    data.unlink()
    with pytest.raises(StorageError, match=r"incomplete: .*\.distcp: No such file"):
        verify_checkpoint(path)
    (path / ".metadata").unlink()
    with pytest.raises(StorageError, match=r"checkpoint verification in .*torn failed"):
        verify_checkpoint(path)
