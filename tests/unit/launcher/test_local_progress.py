"""The progress bar of ``nereus-launch local`` (:class:`launcher.local._Progress`)."""

from __future__ import annotations

import json

from launcher.local import _Progress


def test_the_progress_bar_shows_each_steps_response_cap(tmp_path):
    """Under a length curriculum the mean length alone does not say whether responses are being
    cut: the bar shows it against the step's cap (``max_new_tokens`` of its metrics line); a line
    without one (written before the field existed) shows the mean alone."""
    line = {"step": 0, "reward_mean": 0.5, "response_length_mean": 5.5, "step_latency_s": 1.0, "plan": {}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    (tmp_path / "events.jsonl").write_text("")
    bar = _Progress(total=4, quiet=True)
    bar.update(tmp_path)
    assert "len 5.5 step 1.0s" in bar.bar.postfix, bar.bar.postfix
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps(line | {"step": 1, "max_new_tokens": 24}) + "\n")
    bar.update(tmp_path)
    assert "len 5.5/24 step 1.0s" in bar.bar.postfix, bar.bar.postfix
    bar.close()
