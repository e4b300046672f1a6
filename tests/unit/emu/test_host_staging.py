"""A holding staged in host memory for a Split or Merge (``emu.state.store``): out of the device's
books while staged, and back on the device, equal, if the Split fails. The staged Split itself
runs on 8 gloo ranks in ``tests/distributed/test_primitives_transitions.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from emu.state.devmem import DeviceMemory
from emu.state.store import (HoldingStore, drop_host, holding_entry, released_on_error, restored_on_error,
                             stage_out)
from nereusd.errors import NereusError
from emu.state.unit import slots_for
from nereusd.plan import Layout, ModelStage, Role, Stage
from tests.support.holdings import fill, logical_for
from tests.support.specs import TINY as SPEC

AT = ModelStage(Role.ACTOR, Stage.TRAINING)
LAYOUT, POSITION = Layout(2, 1), (0, 1)


def _store() -> tuple[HoldingStore, torch.Tensor]:
    store = HoldingStore(DeviceMemory(0, 1 << 30))
    h = store.allocate((AT, SPEC, False, slots_for(AT)), LAYOUT, POSITION, logical_for(3, AT))
    fill(h, 3)
    store.put(h)
    return store, h.buffer.clone()


def test_a_staged_holding_leaves_the_device_books_and_comes_back_if_the_split_fails():
    store, before = _store()
    booked = store.memory.in_use_bytes
    held = store.get(AT, LAYOUT, POSITION)
    host = stage_out(store, held, _op(held.numel_per_slot), 0)
    assert not store.has(AT, LAYOUT, POSITION) and store.memory.in_use_bytes == 0
    assert torch.equal(host.buffer, before) and host.logical == logical_for(3, AT)
    with pytest.raises(RuntimeError, match="peer lost"):
        with restored_on_error(store, host):
            raise RuntimeError("peer lost")
    back = store.get(AT, LAYOUT, POSITION)
    assert torch.equal(back.buffer, before) and back.logical == logical_for(3, AT)
    assert store.memory.entries() == {(str(AT), holding_entry(LAYOUT, POSITION)): booked}


def test_a_split_that_succeeds_keeps_what_it_registered():
    store, _ = _store()
    held = store.get(AT, LAYOUT, POSITION)
    host = stage_out(store, held, _op(held.numel_per_slot), 0)
    with restored_on_error(store, host):
        pass   # the Split registered its new holding; the staged one is not put back
    assert not store.has(AT, LAYOUT, POSITION) and store.memory.in_use_bytes == 0
    drop_host(host)
    assert host.buffer.numel() == 0


def test_a_dag_that_names_another_size_is_refused_before_anything_moves():
    store, before = _store()
    held = store.get(AT, LAYOUT, POSITION)
    with pytest.raises(NereusError, match="stages 1 parameter elements"):
        stage_out(store, held, _op(1), 0)
    assert torch.equal(store.get(AT, LAYOUT, POSITION).buffer, before)


def test_a_failed_op_frees_its_new_holding_at_once():
    """The traceback keeps the frames that hold the new holding; its buffer is dropped so that the
    staged holding put back next finds the device memory free (an adversarial review, 2026-12-06)."""
    store, _ = _store()
    new = store.allocate(store.get(AT, LAYOUT, POSITION), Layout(1, 1), (0, 0), logical_for(3, AT))
    with pytest.raises(RuntimeError):
        with released_on_error(store, new):
            raise RuntimeError("peer lost")
    assert new.buffer.numel() == 0 and (str(AT), holding_entry(Layout(1, 1), (0, 0))) not in store.memory.entries()


def _op(elements: int) -> SimpleNamespace:
    """What ``stage_out`` reads of an op: its id and the elements it stages on device 0."""
    return SimpleNamespace(id="actor/training:split0", staged_elements={0: elements})
