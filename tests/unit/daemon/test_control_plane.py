"""Task dispatch of the control plane with a registered peer speaking the agent protocol."""

from __future__ import annotations

import pytest

from nereusd import protocol as P
from nereusd.daemon.control_plane import ControlPlane
from nereusd.errors import WorkerError
from tests.support.agents import fake_agent


def test_a_task_with_a_device_without_agent_is_sent_to_no_device():
    """Devices 0 and 1 have an agent, device 5 none: the task must not reach 0 and 1 either —
    a half-sent collective task leaves its receivers blocked."""
    control = ControlPlane()
    agent = fake_agent(control, "n0", 2)
    try:
        report = P.MemoryReportArgs()
        with pytest.raises(WorkerError, match=r"devices \[5\] have no live agent; nothing was sent"):
            control.submit({0: report, 1: report, 5: report})
        task = control.submit({0: report})
        first = P.decode(agent.recv())   # per-connection order: the first task sent comes first
        assert isinstance(first, P.ToWorker) and first.task.task_id == task and first.device == 0
    finally:
        agent.close()
        control.close()
