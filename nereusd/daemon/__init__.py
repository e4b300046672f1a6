"""The controller daemon's shell: sockets, the agent registry, the pool, the journal's lifecycle.

- :mod:`~nereusd.daemon.control_plane` — the ZeroMQ ROUTER endpoint, agent registry, heartbeats
  and task dispatch;
- :mod:`~nereusd.daemon.main` — the ``nereusd`` entry point;
- :mod:`~nereusd.daemon.pool` and :mod:`~nereusd.daemon.pool_events` — pool changes (agents
  joining or lost, Slurm's node events, preemption) and the job status;
- :mod:`~nereusd.daemon.live` — executes the controller's decisions on the workers at the safe
  boundary;
- :mod:`~nereusd.daemon.security` (CURVE keys) and :mod:`~nereusd.daemon.rendezvous` (the
  workers' TCPStore).

Nothing in the pure core (cost, planner, control, transition, sim) imports this package.
"""
