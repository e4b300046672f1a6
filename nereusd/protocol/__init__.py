"""The control-plane wire protocol: versioned, typed messages (:mod:`~nereusd.protocol.messages`)
and the typed payloads of worker tasks (:mod:`~nereusd.protocol.tasks`). ``from nereusd import
protocol as P`` gives both."""

from nereusd.protocol.messages import *  # noqa: F401,F403
from nereusd.protocol.messages import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, _Message, decode, encode  # noqa: F401
from nereusd.protocol.tasks import *  # noqa: F401,F403
from nereusd.protocol.tasks import TASK_KINDS, task_args  # noqa: F401
