"""Malformed job YAMLs give errors that name the file and the dotted key; good ones resolve."""

from pathlib import Path

import re

import pytest

from nereusd.config.job import load_job
from nereusd.errors import ConfigError
from nereusd.config.resolve import resolve_job
from nereusd.plan import ModelStage

TINY = {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_layers": 4, "num_heads": 4,
        "num_kv_heads": 2, "max_position": 160}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def resolve(path: Path, devices: int = 4):
    return resolve_job(load_job(path), source=path.name, base_dir=path.parent, site_devices=devices,
                       site_memory_bytes=2**30, site_name="local", device_kind="cpu")


def tiny_job(extra: str = "") -> str:
    lines = ["models:", "  actor_config:"] + [f"    {k}: {v}" for k, v in TINY.items()]
    return "\n".join(lines) + "\n" + extra


@pytest.mark.parametrize("text, match", [
    ("steps: fast\n", r"job.yaml: steps: Input should be a valid integer.*, got 'fast'"),
    # a close field is suggested (``step: 3`` had said only "unknown key": a new user's trial, 2026-12-07)
    ("rollout:\n  temprature: 1.0\n", r"^job.yaml: rollout.temprature: unknown key \(did you mean 'temperature'\?\)$"),
    ("step: 3\n", r"^job.yaml: step: unknown key \(did you mean 'steps'\?\)$"),
    ("zzz: 3\n", r"^job.yaml: zzz: unknown key$"),
    ("algorithm: dpo\n", r"job.yaml: algorithm: Input should be 'ppo', 'grpo' or 'remax'"),
    ("train:\n  micro_batch: 0\n", r"job.yaml: train.micro_batch: Input should be greater than or equal to 1"),
    ("- a\n- b\n", r"job.yaml: expected a mapping at the top level, got list"),
    ("steps: [1\n", r"job.yaml: not valid YAML at line"),
    ("adaptation:\n  gamma: 0.5\n", r"job.yaml: adaptation.gamma: renamed: use adaptation.payback_margin "
                                      r"\(train.gamma is the RL discount\), got 0.5"),
    # integers and numbers are taken as written, as the site loader takes them: a quoted number,
    # a boolean or 2.0 was quietly converted
    ("train:\n  micro_batch: true\n", r"^job.yaml: train.micro_batch: Input should be a valid integer, got True$"),
    ("train:\n  micro_batch: '16'\n", r"^job.yaml: train.micro_batch: Input should be a valid integer, got '16'$"),
    ("train:\n  micro_batch: 2.0\n", r"^job.yaml: train.micro_batch: Input should be a valid integer, got 2.0$"),
    ("rollout:\n  temperature: yes\n", r"^job.yaml: rollout.temperature: Input should be a valid number, got True$"),
    ("train:\n  actor_lr: '0.5'\n", r"^job.yaml: train.actor_lr: Input should be a valid number, got '0.5'$"),
    ("memory_gib: 1.0e+308\n", r"^job.yaml: memory_gib: Input should be less than or equal to 1000000"),
    ("steps: 1000000000000000000000000000000\n", r"^job.yaml: steps: Input should be less than or equal to 100000000"),
    ("name: a/b\n", r"^job.yaml: name: expected a short name: letters, digits, .*\(no slashes or spaces\), got 'a/b'$"),
    # it names run directories and Slurm jobs (a bad-input search, 2026-12-05)
    ("name: '..'\n", r"^job.yaml: name: expected a short name"),
    ("name: -rf\n", r"^job.yaml: name: expected a short name"),
    ("name: 'a b;$(id)'\n", r"^job.yaml: name: expected a short name"),
    ("seed: -1\n", r"^job.yaml: seed: Input should be greater than or equal to 0"),
    ("seed: 10000000000000000000000000000000000000000\n", r"^job.yaml: seed: Input should be less than 4294967296"),
    ("devices: 1000000000\n", r"^job.yaml: devices: Input should be less than or equal to 65536"),   # was OOM-killed
    # 400-digit batches passed the schema and reached later checks, which printed every digit (2026-12-06)
    ("train:\n  global_batch: 1" + "0" * 400 + "\n", r"^job.yaml: train.global_batch: Input should be less than or "
                                                   r"equal to 1048576"),
    ("rollout:\n  max_new_tokens: 20000000\n", r"^job.yaml: rollout.max_new_tokens: Input should be less than or "
                                                 r"equal to 16777216"),
])
def test_schema_errors_name_file_and_key(tmp_path, text, match):
    path = write(tmp_path, text)
    # the file as the user gave it, whole (every run directory holds a job.yaml)
    with pytest.raises(ConfigError, match=match.replace("^job.yaml", "^" + re.escape(str(path)))):
        load_job(path)


def test_exponent_literals_yaml_reads_as_strings_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads ``1e-5`` and ``inf`` as strings; the usual way to write a learning
    rate must stay a number (strict floats refused it, and a job could not be resumed)."""
    job = load_job(write(tmp_path, "train: {actor_lr: 1e-5, kl_coef: 1E-3}\nadaptation: {payback_margin: inf}\n"))
    assert (job.train.actor_lr, job.train.kl_coef, job.adaptation.payback_margin) == (1e-5, 1e-3, float("inf"))


@pytest.mark.parametrize("content, match", [
    (b"\xff\xfe\x00garbage", r"job.yaml: not UTF-8 text \(invalid start byte at byte 0\)"),
    (b"steps: 3\nsteps: 5\n", r"job.yaml: not valid YAML at line 2, column 1: duplicate key 'steps' \(first at line 1\)"),
    (b"train:\n  actor_lr: 1.0e-4\n  actor_lr: 3.0e-4\n", r"duplicate key 'actor_lr' \(first at line 2\)"),
    (b"train: {actor_lr: .inf}\n", r"job.yaml: train.actor_lr: Input should be a finite number, got inf"),
    (b"train: {kl_coef: .nan}\n", r"job.yaml: train.kl_coef: Input should be a finite number"),
    (b"steps: 10\nrollout: {max_staleness: 10}\n", r"^job.yaml: rollout.max_staleness: 10 is not below steps=10"),
])
def test_job_file_gaps_are_refused_naming_the_file(tmp_path, content, match, monkeypatch):
    monkeypatch.chdir(tmp_path)   # errors name the file as given: here "job.yaml"
    Path("job.yaml").write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        load_job("job.yaml")


def test_a_huge_job_file_is_refused_at_once_and_errors_are_capped(tmp_path):
    from nereusd.config.yamlfile import MAX_YAML_BYTES

    path = tmp_path / "job.yaml"
    path.write_text("#" * (MAX_YAML_BYTES + 1))
    with pytest.raises(ConfigError, match=r"job.yaml: \d+ bytes is larger than a configuration file may be"):
        load_job(path)
    path.write_text("".join(f"key{i}: 1\n" for i in range(100)))
    with pytest.raises(ConfigError) as err:
        load_job(path)
    lines = str(err.value).splitlines()
    assert len(lines) == 21 and lines[-1] == f"{path}: … and 80 more problems"
    path.write_text("steps: " + "x" * 5000 + "\n")   # a huge value is cut in the message
    with pytest.raises(ConfigError, match=r"steps: .*xxx… \(5002 characters\)$"):
        load_job(path)
    path.write_text("a: &x {tp: 1}\nplan:\n  default:\n    <<: *x\n    tp: 2\n")   # a merge key may be overridden
    with pytest.raises(ConfigError, match="a: unknown key"):
        load_job(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.yaml: no such file"):
        load_job(tmp_path / "nope.yaml")


@pytest.mark.parametrize("extra, match", [
    ("plan:\n  default: {tp: 3}\n", r"plan.default: 4 devices are not a multiple of tp·pp = 3·1"),
    ("plan:\n  model_stages:\n    actor/training: {tp: 1, pp: 1, dp: 3}\n",
     r"plan.model_stages.actor/training: tp·pp·dp = 1·1·3 = 3 but 4 devices given"),
    ("plan:\n  model_stages:\n    actor/training: {pp: 3, dp: 1, devices: [0, 1, 2]}\n",
     r"plan.model_stages.actor/training: layout tp1·pp3: pp=3 does not divide model num_layers=4"),
    ("plan:\n  model_stages:\n    critic/training: {tp: 1}\n",
     r"plan.model_stages.critic/training: not a model-stage of grpo"),
    ("plan:\n  model_stages:\n    actor/training: {devices: [0, 7]}\n",
     r"plan.model_stages.actor/training.devices: \[7\] outside the job's devices 0..3"),
    ("plan:\n  model_stages:\n    actor/training: {tp: 2, pp: 1, devices: []}\n",   # was a ZeroDivisionError
     r"plan.model_stages.actor/training.devices: empty list"),
    ("plan:\n  model_stages:\n    actor/generation: {pp: 2}\n",
     r"plan.model_stages.actor/generation.pp: generation folds PP into DP, pp must be 1, got 2"),
    ("train:\n  global_batch: 64\nplan:\n  default: {micro_batch: 12}\n",
     r"plan.default.micro_batch: 12 does not divide a replica's share of train.global_batch=64 at dp=4 "
     r"\(16 sequences\)"),
    ("train:\n  global_batch: 64\nplan:\n  model_stages:\n    actor/training: {dp: 3, devices: [0, 1, 2]}\n",
     r"plan.model_stages.actor/training: train.global_batch=64 is not a multiple of dp=3"),
    ("devices: 8\n", r"job.yaml: devices: 8 requested but site 'local' has 4"),
    # below what a worker books before any weight: it failed building, in use over capacity
    ("memory_gib: 0.0001\n", r"job.yaml: memory_gib: 107,374 bytes per device do not exceed the 16 MiB workspace "
                             r"every cpu device books"),
    ("rollout:\n  group_size: 1\ntrain: {global_batch: 8}\n", r"rollout.group_size: GRPO needs groups of at least 2"),
    ("rollout:\n  max_new_tokens: 200\n", r"job.yaml: rollout.max_new_tokens: 200 plus the longest prompt \(\d+ "
                                          r"tokens\) exceeds the \w+ model's max_position=160"),
    ("train:\n  max_tokens_per_micro_batch: 8\n", r"job.yaml: train.max_tokens_per_micro_batch: 8 tokens cannot "
                                                  r"hold the longest sequence \(prompt \d+ \+ rollout.max_new_tokens"),
])
def test_plan_errors_name_file_and_key(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        resolve(write(tmp_path, tiny_job(extra)))


@pytest.mark.parametrize("key, value, match", [
    # an adversarial trial (2026-12-07): a NaN RoPE base trained on NaN losses, 'yes' passed as a
    # flag, and an unknown key read "ModelSpec.__init__() got an unexpected keyword argument"
    ("rope_theta", ".nan", r"models.actor_config: model.rope_theta: expected a finite number above 0, got nan"),
    ("rms_norm_eps", ".inf", r"model.rms_norm_eps: expected a finite number above 0, got inf"),
    ("rope_theta", "-1.0", r"model.rope_theta: expected a finite number above 0, got -1.0"),
    ("tie_word_embeddings", "'yes'", r"model.tie_word_embeddings: expected true or false, got 'yes'"),
    ("foo", "1", r"^job.yaml: models.actor_config: unknown key\(s\) 'foo' \(the keys are vocab_size, "),
])
def test_an_actor_config_is_checked_as_a_config_json_is(tmp_path, key, value, match):
    with pytest.raises(ConfigError, match=match):
        resolve(write(tmp_path, tiny_job().replace("  actor_config:\n", f"  actor_config:\n    {key}: {value}\n")))


def test_a_config_json_that_is_a_directory_is_named(tmp_path):
    from nereusd.models import resolve_model

    (tmp_path / "model" / "config.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"config.json: cannot read it: Is a directory"):
        resolve_model(str(tmp_path / "model"))
    path = write(tmp_path, "models:\n  actor: model\n")
    with pytest.raises(ConfigError, match=r"'model' is not a model directory \(.*config.json is not a file\)"):
        resolve(path)


def test_model_directory_must_exist(tmp_path):
    path = write(tmp_path, "models:\n  actor: missing-model\n")
    with pytest.raises(ConfigError, match=r"job.yaml: models.actor: 'missing-model' is not a model directory") as err:
        resolve(path)
    assert "hf download" not in str(err.value)
    # a Hugging Face id read as a directory: the error says it is not downloaded (a new user's trial)
    path = write(tmp_path, "models:\n  actor: Qwen/Qwen2.5-0.5B-Instruct\n")
    with pytest.raises(ConfigError, match=r"'Qwen/Qwen2.5-0.5B-Instruct' is not a model directory .*if it is a "
                                          r"Hugging Face id: Nereus downloads nothing, fetch it first \(`hf download "
                                          r"Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`\)"):
        resolve(path)


def test_colocated_default_and_disjoint_override(tmp_path):
    extra = ("algorithm: ppo\nrollout: {group_size: 2}\ntrain: {global_batch: 16, micro_batch: 4}\n"
             "plan:\n  default: {tp: 2, pp: 2}\n  model_stages:\n"
             "    critic/training: {tp: 1, pp: 1, devices: [2, 3]}\n")
    job = resolve(write(tmp_path, tiny_job(extra)))
    actor_train = job.plan[ModelStage.parse("actor/training")]
    assert (actor_train.tp, actor_train.pp, actor_train.dp) == (2, 2, 1)
    gen = job.plan[ModelStage.parse("actor/generation")]
    assert (gen.tp, gen.pp, gen.dp) == (2, 1, 2)  # PP folded into DP for generation
    critic = job.plan[ModelStage.parse("critic/training")]
    assert (critic.tp, critic.dp, critic.devices) == (1, 2, (2, 3))
    assert job.grad_accum[ModelStage.parse("critic/training")] == 16 // (2 * 4)
    assert job.grad_accum[ModelStage.parse("actor/training")] == 16 // (1 * 4)
    assert [str(m) for m in job.plan] == [
        "actor/generation", "actor/inference", "critic/inference", "reference/inference",
        "actor/training", "critic/training"]


@pytest.mark.parametrize("configured, trained", [(12, 8), (3, 2), (128, 16), (16, 16)])
def test_train_micro_batch_is_an_upper_bound_lowered_to_a_divisor_of_the_share(tmp_path, configured, trained):
    """``train.micro_batch`` is at most what a replica runs: where the plan names no micro-batch,
    training takes the largest divisor of the replica's share (64 sequences over dp 4: 16) up to
    it, as the planner does; 12, 3 and 128 were refused, naming ``plan.default`` the user never
    wrote."""
    job = resolve(write(tmp_path, tiny_job(f"train: {{global_batch: 64, micro_batch: {configured}}}\n")))
    training = job.plan[ModelStage.parse("actor/training")]
    assert (training.dp, training.micro_batch) == (4, trained)
    assert job.grad_accum[ModelStage.parse("actor/training")] * training.dp * training.micro_batch == 64


def test_without_a_plan_an_adaptive_job_falls_back_to_devices_that_split_the_batch(tmp_path):
    # 3 devices cannot split a global batch of 8: a YAML plan saying so is an error, but with
    # no plan (the planner chooses the launch plan) the fallback uses the first 2 devices
    text = "devices: 3\nrollout: {prompts_per_step: 2, group_size: 4}\ntrain: {global_batch: 8, micro_batch: 4}\n"
    with pytest.raises(ConfigError, match="plan.default: train.global_batch=8 is not a multiple of dp=3"):
        resolve(write(tmp_path, tiny_job(text + "plan: {default: {tp: 1, pp: 1}}\n")))
    with pytest.raises(ConfigError, match="plan.default: train.global_batch=8 is not a multiple of dp=3"):
        resolve(write(tmp_path, tiny_job(text + "adaptation: {enabled: false}\n")))
    job = resolve(write(tmp_path, tiny_job(text)))
    training = job.plan[ModelStage.parse("actor/training")]
    assert training.devices == (0, 1) and training.dp == 2
    assert job.plan[ModelStage.parse("actor/generation")].devices == (0, 1, 2)


@pytest.mark.parametrize("schedule, match", [
    ("[{at_step: 6, remove: 1}]", r"pool.schedule\[0\].at_step: 6 is never reached"),
    ("[{at_step: 2, remove: 4}]", r"pool.schedule\[0\].remove: 4 would leave the job no device"),
    ("[{at_step: 1, remove: 1}, {at_step: 2, remove: 9}]", r"pool.schedule\[1\].remove: 9"),
])
def test_pool_schedule_is_checked_against_the_job(tmp_path, schedule, match):
    text = f"steps: 6\npool: {{schedule: {schedule}}}\n"
    with pytest.raises(ConfigError, match=match):
        resolve(write(tmp_path, tiny_job(text)))
    resolve(write(tmp_path, tiny_job("steps: 6\npool: {schedule: [{at_step: 5, remove: 3}, {at_step: 5, add: 2}]}\n")))


def test_corrupt_or_mismatched_weights_are_refused_before_launch(tmp_path):
    """The safetensors headers are read (nothing loaded) and checked against config.json."""
    import shutil

    from tests.support import REPO

    model = tmp_path / "m"
    shutil.copytree(REPO / "examples" / "models" / "counting-warmstart", model)
    job = write(tmp_path, "models: {actor: m}\n")
    resolve(job)   # the shipped warm start is fine
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[:1000])
    with pytest.raises(ConfigError, match=r"job.yaml: models.actor: .*model.safetensors: not a readable "
                                          r"safetensors file"):
        resolve(job)
    from safetensors.numpy import load_file, save_file

    (model / "model.safetensors").write_bytes(weights)
    state = load_file(str(model / "model.safetensors"))
    del state["model.norm.weight"]
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:, :8]
    save_file(state, str(model / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"models.actor: .*missing 1 tensors: model.norm.weight; 1 tensors of "
                                          r"the wrong shape: model.embed_tokens.weight"):
        resolve(job)


def test_infinite_payback_margin_stays_allowed_and_merged_anchors_may_be_reused(tmp_path):
    """``payback_margin: .inf`` admits any positive gain (the greedy policy); an anchor used as a
    merge source and aliased again is not a duplicate key."""
    path = tmp_path / "job.yaml"
    path.write_text("adaptation: {payback_margin: .inf}\n")
    assert load_job(path).adaptation.payback_margin == float("inf")
    path.write_text("adaptation: {payback_margin: .nan}\n")
    with pytest.raises(ConfigError, match="adaptation.payback_margin"):
        load_job(path)
    path.write_text("plan:\n  model_stages:\n    actor/inference:\n      <<: &tp2 {<<: {tp: 1, pp: 1}, tp: 2}\n"
                    "    reference/inference: *tp2\n")
    stages = load_job(path).plan.model_stages
    assert stages["actor/inference"].tp == stages["reference/inference"].tp == 2


def test_a_partial_value_head_is_refused_before_launch():
    """A value head is whole or absent: a critic directory with ``value_head.weight`` but no bias
    failed only in the workers (``load_full_state: missing 'value_head.bias'``)."""
    from nereusd.shards import canonical_shapes, check_checkpoint_shapes
    from nereusd.models import ModelSpec

    spec = ModelSpec(**TINY)
    full = dict(canonical_shapes(spec, value_head=True))
    check_checkpoint_shapes(spec, full, value_head=True, source="critic")
    trunk = {k: v for k, v in full.items() if not k.startswith("value_head.")}
    check_checkpoint_shapes(spec, trunk, value_head=True, source="critic")   # drawn at start-up
    partial = {k: v for k, v in full.items() if k != "value_head.bias"}
    with pytest.raises(ConfigError, match=r"critic: the weights do not match config.json: missing 1 tensors: "
                                          r"value_head.bias"):
        check_checkpoint_shapes(spec, partial, value_head=True, source="critic")


def test_a_billion_laughs_or_a_deep_nesting_is_refused_at_once(tmp_path):
    """2 KB of nested aliases expand to 9^9 values: validation and its error message walked them
    for minutes (a bad-input search, 2026-12-05); 5,000 nested brackets raised a RecursionError."""
    import time

    path = tmp_path / "job.yaml"
    levels = ["a0: &a0 [" + ", ".join(["x"] * 9) + "]"]
    levels += [f"a{k}: &a{k} [" + ", ".join([f"*a{k - 1}"] * 9) + "]" for k in range(1, 9)]
    path.write_text("name: bomb\nbomb:\n" + "".join(f"  {line}\n" for line in levels))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"job.yaml: expands to [\d,]+ values through its aliases"):
        load_job(path)
    assert time.perf_counter() - start < 5   # linear in the file (each shared list counted once)
    path.write_text("steps: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested deeper than a configuration may be"):
        load_job(path)
    path.write_text("steps: [[1, 2], {a: [3]}]\nsteps_x: 1\n")   # ordinary nesting: the schema's errors
    with pytest.raises(ConfigError, match=r"steps: .*got \[\[1, 2\], \{'a': \[3\]\}\]"):
        load_job(path)


def test_an_integer_past_pythons_digit_limit_is_a_one_line_error(tmp_path):
    """``seed: 1000…0`` (5,000 digits) raised PyYAML's ValueError from ``int()`` (a bad-input
    search, 2026-12-05)."""
    path = tmp_path / "job.yaml"
    path.write_text("seed: 1" + "0" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"job.yaml: not a valid configuration value: Exceeds the limit"):
        load_job(path)


@pytest.mark.parametrize("stages, match", [
    ("[{at_step: 1, max_new_tokens: 8}]", r"^job.yaml: rollout.max_new_tokens_schedule\[0\].at_step: the first stage "
                                          r"starts at step 0, got 1$"),
    ("[{at_step: 0, max_new_tokens: 8}, {at_step: 0, max_new_tokens: 16}]",
     r"^job.yaml: rollout.max_new_tokens_schedule\[1\].at_step: 0 is not after the previous stage's 0$"),
    ("[{at_step: 0, max_new_tokens: 16}, {at_step: 5, max_new_tokens: 8}]",
     r"^job.yaml: rollout.max_new_tokens_schedule\[1\].max_new_tokens: 8 is below the previous stage's 16"),
    ("[{at_step: 0, max_new_tokens: 8}, {at_step: 5, max_new_tokens: 40}, {at_step: 9, max_new_tokens: 64}]",
     r"^job.yaml: rollout.max_new_tokens_schedule\[1\].max_new_tokens: 40 exceeds rollout.max_new_tokens 32"),
    ("[{at_step: 0, max_new_tokens: 0}]", r"^job.yaml: rollout.max_new_tokens_schedule\[0\].max_new_tokens: Input "
                                          r"should be greater than or equal to 1, got 0$"),
    ("[{at_step: 0}]", r"^job.yaml: rollout.max_new_tokens_schedule\[0\].max_new_tokens: required key is missing$"),
    ("[{at_step: 0, max_new_tokens: 8}, {at_step: 20, max_new_tokens: 16}]",   # steps: 20 (the default)
     r"^job.yaml: rollout.max_new_tokens_schedule\[1\].at_step: 20 is not below steps=20: no step would run in"),
])
def test_a_length_curriculum_only_raises_the_cap_up_to_max_new_tokens(tmp_path, stages, match, monkeypatch):
    monkeypatch.chdir(tmp_path)   # errors name the file as given: here "job.yaml"
    Path("job.yaml").write_text(f"rollout:\n  max_new_tokens: 32\n  max_new_tokens_schedule: {stages}\n")
    with pytest.raises(ConfigError, match=match):
        load_job("job.yaml")


def test_each_step_is_capped_by_its_stage_and_the_launch_plans_for_step_0(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("steps: 30\nrollout:\n  max_new_tokens: 32\n  max_new_tokens_schedule:\n"
                    "    - {at_step: 0, max_new_tokens: 8}\n    - {at_step: 10, max_new_tokens: 16}\n"
                    "    - {at_step: 20, max_new_tokens: 16}\n")
    job = load_job(path)
    assert [job.rollout.max_new_tokens_at(s) for s in (0, 9, 10, 19, 20, 1000)] == [8, 8, 16, 16, 16, 16]
    assert job.launch_response_length() == 8
    assert job.launch_response_length(12) == 16   # a resume that plans afresh at step 12's stage
    path.write_text("rollout:\n  max_new_tokens: 32\n")
    plain = load_job(path)
    assert plain.rollout.max_new_tokens_at(7) == 32 and plain.launch_response_length() == 32
    path.write_text("rollout:\n  max_new_tokens: 32\n  max_new_tokens_schedule: [{at_step: 0, max_new_tokens: 8}]\n"
                    "adaptation: {launch_response_length: 12}\n")
    assert load_job(path).launch_response_length() == 12
    path.write_text("rollout:\n  max_new_tokens: 32\nadaptation: {launch_response_length: 33}\n")
    with pytest.raises(ConfigError, match=r"adaptation.launch_response_length: 33 exceeds rollout.max_new_tokens=32"):
        load_job(path)


def test_a_site_that_does_not_exist_is_the_job_files_error(tmp_path):
    """``site: nosuch`` said ``site 'nosuch': not found …`` without the job file or the key (an
    adversarial trial)."""
    from nereusd.config.resolve import load_and_resolve

    path = write(tmp_path, tiny_job("site: nosuch\n"))
    with pytest.raises(ConfigError, match=r"job.yaml: site: site 'nosuch': not found in .* \(known: \["):
        load_and_resolve(path)


def test_a_site_path_is_read_beside_the_job_file(tmp_path, monkeypatch):
    """``site: mysite.yaml`` is the file beside the job, as ``models`` paths are, from any working
    directory (it was read from the working directory: an adversarial trial, 2026-12-07); a path
    only found from the working directory still is."""
    from tests.support import REPO

    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "mysite.yaml").write_text((REPO / "site_configs" / "local.yaml").read_text())
    job = tmp_path / "jobs" / "job.yaml"
    job.write_text(tiny_job("site: mysite.yaml\n"))
    monkeypatch.chdir(tmp_path)
    assert load_job(job).site == str(tmp_path / "jobs" / "mysite.yaml")
    job.write_text(tiny_job("site: jobs/mysite.yaml\n"))   # not beside it: from the working directory
    assert load_job(job).site == "jobs/mysite.yaml"
