"""The cost and memory model: predicted seconds and bytes of plans, learned efficiencies.

- :mod:`~nereusd.cost.formulas` — every communication and update term, written once;
- :mod:`~nereusd.cost.model` — ``CostModel``: seconds of a model-stage candidate and a step;
- :mod:`~nereusd.cost.vector` — the same formulas over arrays of DP degrees (planner fast path);
- :mod:`~nereusd.cost.memory` — peak bytes per device of a candidate;
- :mod:`~nereusd.cost.calibration` — one efficiency per operation class, from measurements.

Pure: no torch, no sockets.
"""
