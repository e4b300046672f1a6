"""A short fuzz run over nereusd's decoder and handlers (tests/support/protocol_fuzz.py);
``scripts/fuzz_protocol.py`` runs 100,000 cases. A frame that raises out of the handlers, or
an agent registered above the per-agent bound, fails the test with the frame that did it."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from tests.support.protocol_fuzz import frames, make_target


def test_no_frame_breaks_the_control_plane(tmp_path):
    target = make_target(tmp_path)

    @settings(max_examples=1500, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(frames())
    def case(frame):
        target.feed(frame)

    try:
        case()
        assert target.control.refused_messages > 500   # most frames are refused, none raised
    finally:
        target.close()


def test_a_handler_bug_is_refused_not_raised(tmp_path):
    # the guard around every handler: an exception that is not a ProtocolError (here from the
    # pool controller) becomes an ErrorReply and a journalled refusal
    from nereusd import protocol as P

    target = make_target(tmp_path)

    def broken(_count):
        raise KeyError("bug")

    target.control.on_pool_request = broken
    try:
        before = target.control.refused_messages
        target.feed([b"peer", P.encode(P.PoolRequest(remove=1))])
        assert target.control.refused_messages == before + 1
    finally:
        target.close()
