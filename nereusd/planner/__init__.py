"""The planner: from a plan problem to the fastest plan that fits (paper §5; DESIGN.md "Planner").

- :mod:`~nereusd.planner.space` — plan problems, search knobs, costed options, plan evaluation;
- :mod:`~nereusd.planner.search` — frontiers and the dynamic programme over them (``Planner``);
- :mod:`~nereusd.planner.placement` — candidates to concrete devices, near the current plan;
- :mod:`~nereusd.planner.rescale` — DP-only rescaling of a plan to a new pool.

Pure: no torch, no sockets.
"""
