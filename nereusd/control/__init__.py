"""The adaptation controller: measurements in, admitted transitions out (paper §4).

- :mod:`~nereusd.control.monitor` — drift signals, triggers and ``H_x``;
- :mod:`~nereusd.control.admission` — feasibility, payback and the urgent path;
- :mod:`~nereusd.control.controller` — the one controller that live jobs and the simulator run.

Pure: no torch, no sockets, no clock.
"""
