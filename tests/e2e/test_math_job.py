"""End to end: the math example's model and data (``examples/``) under `nereus-launch local`: chat
template, the GSM8K verifier, held-out evaluation, token-budget micro-batches, and the plot."""

from __future__ import annotations

import re

import pytest

from nereusd.journal import read_jsonl
from tests.e2e.test_local import check_run, launch
from tests.support import REPO

pytestmark = pytest.mark.slow


def test_gsm8k_example_runs_with_evaluation_and_token_budget_micro_batches(tmp_path):
    examples = REPO / "examples"
    proc, run_dir = launch(tmp_path, f"""
name: e2e-math
algorithm: grpo
steps: 2
devices: 2
models: {{actor: "{examples / 'models' / 'gsm8k-tiny'}"}}
task:
  name: math
  options: {{dataset: "{examples / 'data' / 'gsm8k-generated.jsonl'}", eval_size: 100, max_prompt_length: 96}}
rollout: {{prompts_per_step: 4, group_size: 4, max_new_tokens: 40}}
train: {{global_batch: 16, micro_batch: 4, max_tokens_per_micro_batch: 256, kl_coef: 0.0, actor_lr: 3.0e-5}}
evaluation: {{every_steps: 1, max_prompts: 16}}
""")
    records = check_run(proc, run_dir, steps=2, devices=2)
    assert all(0.0 <= r["eval/pass@1"] <= 1.0 for r in records)
    assert all(r["reward_mean"] > 0 for r in records)   # the warm start answers some problems
    evals = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "evaluation"]
    assert [e["step"] for e in evals] == [-1, 0, 1] and all(e["prompts"] == 16 for e in evals)
    assert evals[0]["pass_at_1"] > 0   # greedy held-out pass@1 of the warm start is above zero
    worker_logs = "".join(p.read_text() for p in (run_dir / "logs").rglob("*.log"))
    assert "actor/training: " in worker_logs and "micro-batches of <= 256 tokens (packed)" in worker_logs
    assert re.search(r"actor/generation: .*micro-batches of \d+ sequences", worker_logs)   # generation: by count
    from launcher.report import write_plots

    assert run_dir / "plots" / "eval_pass_at_1.png" in write_plots(run_dir, run_dir / "plots")
