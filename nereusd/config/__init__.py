"""Job and site configuration: strict schemas, their loaders and what is resolved from them.

- :mod:`~nereusd.config.job` — the job YAML schema (frozen pydantic models) and its loader;
- :mod:`~nereusd.config.resolve` — a job resolved against its site and models (``ResolvedJob``);
- :mod:`~nereusd.config.site` and :mod:`~nereusd.config.site_slurm` — the site YAML;
- :mod:`~nereusd.config.pool_schedule` — a local job's pool changes by step, time or trace.
"""
