"""Cluster-scale simulator: replays an RL job on length and pool traces under several
adaptation policies, against a hidden ground truth.

The controller is the one live jobs run (:class:`nereusd.control.controller.Controller`); the
policies differ only in the :class:`~nereusd.control.controller.ControlPolicy` they pass
(:mod:`~nereusd.sim.policies`). Here: :mod:`~nereusd.sim.truth` (hidden efficiencies, noise,
contention, memory variance, OOM and restart costs), :mod:`~nereusd.sim.replay` (the
discrete-event loop that feeds the controller what a live job's shell feeds it),
:mod:`~nereusd.sim.results` (what a run records), :mod:`~nereusd.sim.oracle` (the best plan per
step under the truth), :mod:`~nereusd.sim.scenario` (a simulation from plain settings) and :mod:`~nereusd.sim.report`
(tables, JSON, plots). Traces come from the core (:mod:`nereusd.traces`). Nothing outside this
package and the launcher imports it.
"""
