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


def test_a_checkpoint_whose_values_load_as_nan_is_a_storage_error(tmp_path):
    """DCP keeps no checksum: 4 KiB of ``0xFF`` written into a saved file (its size unchanged)
    loaded as NaN, and the job failed at its next step with a worker's traceback instead of
    falling back to the checkpoint before (an adversarial trial, 2026-12-07). A load now refuses
    non-finite values as a damaged checkpoint (``StorageError``, which the driver's fallback takes)."""
    import torch

    from emu.state.checkpoint import load_holdings
    from emu.state.unit import EmuShard, slots_for
    from nereusd.plan import Candidate, ModelStage, Role, Stage
    from tests.support.holdings import fill, logical_for
    from tests.support.specs import TINY

    actor = ModelStage(Role.ACTOR, Stage.TRAINING)
    layout = Candidate(1, 1, 1, (0,)).layout

    def holding(seed: int) -> EmuShard:
        h = EmuShard(actor, TINY, False, layout, (0, 0), slots_for(actor), logical=logical_for(seed, actor))
        fill(h, seed)
        return h

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # DCP's "no process group: single process" notice
        save_holdings([holding(1)], tmp_path / "ckpt")
        target = holding(2)
        load_holdings([target], tmp_path / "ckpt")   # intact: loads
        import torch.distributed.checkpoint as dcp

        items = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().storage_data.values()
        largest = max(items, key=lambda info: info.length)   # the middle of a tensor's bytes
        with open(tmp_path / "ckpt" / largest.relative_path, "r+b") as fh:
            fh.seek(largest.offset + largest.length // 2)
            fh.write(b"\xff" * 64)
        with pytest.raises(StorageError, match=r"checkpoint load in .*ckpt failed: .* of actor/training holds "
                                               r"non-finite values \(its files are damaged"):
            load_holdings([holding(2)], tmp_path / "ckpt")
    assert torch.isfinite(target.buffer).all()
