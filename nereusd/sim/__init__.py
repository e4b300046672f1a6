"""Cluster-scale simulator: replays an RL job on length and pool traces under several
adaptation policies, against a hidden ground truth (issue 7).

Modules: :mod:`~nereusd.traces` (length and pool traces), :mod:`~nereusd.sim.truth`
(hidden efficiencies, noise, contention, memory variance, OOM and restart costs),
:mod:`~nereusd.sim.controller` (the controller a live job runs: calibration, monitor, planner,
admission), :mod:`~nereusd.transition.estimate` (transition cost via the transition engine),
:mod:`~nereusd.planner.rescale` (DP-only rescaling), :mod:`~nereusd.sim.policies`,
:mod:`~nereusd.sim.replay` (the discrete-event loop) and :mod:`~nereusd.sim.report` (tables,
JSON, plots).
"""
