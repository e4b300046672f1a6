"""End to end, asynchronous RL (``rollout.max_staleness``) with the real nereusd, agents and workers.

- step ``k`` trains on responses generated with policy version ``max(0, k − s)`` (the weight
  synchronisations before the generation was submitted), so staleness never exceeds ``s``;
- the weight synchronisation is the safe boundary: forced layout switches there — training TP,
  training and generation moving to other devices — train exactly like no switches (same
  samples, rewards, losses within reduction tolerance), with rollouts already generated keeping
  their policy version across the switch.
"""

from __future__ import annotations

import json

import pytest

from nereusd.errors import ConfigError
from nereusd.config.resolve import load_and_resolve
from nereusd.journal import read_jsonl
from tests.support.e2e import assert_trains_alike, run_fixed_and_switched, write_job

pytestmark = pytest.mark.slow

ASYNC = """
name: e2e-async
algorithm: grpo
seed: 11
steps: 7
devices: 3
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 12, max_staleness: 2}
train: {global_batch: 8, micro_batch: 4, kl_coef: 0.05}
plan:
  default: {tp: 1, pp: 1, devices: [1, 2]}
  model_stages:
    actor/generation: {tp: 1, devices: [0]}
adaptation:
  enabled: @ENABLED@
  payback_margin: 0.0
  forced: @FORCED@
"""
FORCED = """
    - {at_step: 2, model_stages: {actor/training: {tp: 2}}}
    - {at_step: 4, model_stages: {actor/generation: {tp: 1, devices: [1]},
                                  actor/training: {tp: 1, devices: [0, 2]}}}"""


def test_async_versions_and_switches_at_weight_sync(tmp_path):
    a, b = run_fixed_and_switched(tmp_path, ASYNC, FORCED)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(7))
    for records in (a, b):
        assert [r["policy_version"] for r in records] == [max(0, k - 2) for k in range(7)]
        assert max(r["staleness"] for r in records) == 2
        assert [r["sample_position"] for r in records] == [2 * k for k in range(7)]
    assert {tuple(r["plan"]["actor/generation"]["devices"]) for r in b} == {(0,), (1,)}
    assert len({json.dumps(r["plan"]["actor/training"]) for r in b}) == 3
    assert_trains_alike(a, b)
    events = read_jsonl(tmp_path / "switched" / "events.jsonl")
    assert sum(e["event"] == "transition" for e in events) == 2


def test_max_staleness_is_validated(tmp_path):
    bad = write_job(tmp_path, "bad", ASYNC.replace("max_staleness: 2", "max_staleness: -1")
                    .replace("@ENABLED@", "false").replace("@FORCED@", "[]"))
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_and_resolve(bad)
    boolean = write_job(tmp_path, "bool", ASYNC.replace("max_staleness: 2", "max_staleness: true")
                        .replace("@ENABLED@", "false").replace("@FORCED@", "[]"))
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_and_resolve(boolean)
