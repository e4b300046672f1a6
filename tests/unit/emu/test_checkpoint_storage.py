"""A checkpoint write that the storage refuses is a StorageError naming the path (emu/state/checkpoint.py).

torch's ``CheckpointException`` derives from ``BaseException``: it used to escape the worker's
task handler, kill the worker, and read as a lost device.
"""

from __future__ import annotations

import warnings

import pytest

from emu.state.checkpoint import save_holdings
from nereusd.errors import NereusError, StorageError


def test_a_failed_checkpoint_save_is_a_storage_error_naming_the_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # DCP's "no process group: single process" notice
        with pytest.raises(StorageError, match=r"checkpoint save in .*a-file/ckpt failed: NotADirectoryError.* \(\d+ bytes free there\)"):
            save_holdings([], blocker / "ckpt")
    assert issubclass(StorageError, NereusError)   # the worker reports it as a task failure, not a crash
