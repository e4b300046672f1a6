"""Traces that drive a simulated run: per-step sequence lengths and the GPU pool over time.

Shipped copies live in ``nereusd/data/traces`` (provenance and licences in its
``SOURCES.md``); a bare name resolves there, anything else is read as a path. Nothing here
edits the data: scaling a 16-node availability trace to the simulated cluster and generating a
length ramp are derivations, and a generated trace says so in its ``label``.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from nereusd.errors import ConfigError, not_utf8
from nereusd.models import MAX_MODEL_DIMENSION

DATA = Path(__file__).resolve().parent / "data" / "traces"
LENGTH_DIR = DATA / "length"
SPOT_DIR = DATA / "spot" / "availability" / "16-node" / "aws-08-27-2023"

#: Short names of the shipped length traces: (file, column). A length trace gives each step's
#: *longest* response (the simulator's convention: what memory and padding follow, and what a live
#: job feeds the controller), so the verl logs give their ``response_length_max`` column (at the
#: run's response cap, 1,024 and 512 tokens, in 316 of 1,119 and 433 of 435 steps). The Deep-GRPO
#: export logs the mean only: its traces are step means taken as the longest, 1.9–4× shorter than
#: the verl runs' longest (their median max/mean).
LENGTH_TRACES = {
    "verl-amd-7b-grpo": ("verl-amd_deepseek-llm-7b-chat_gsm8k_grpo_resp1024.csv", "response_length_max"),
    "verl-0.5b-ppo": ("verl-data_qwen2.5-0.5b-instruct_gsm8k_ppo_resp512.csv", "response_length_max"),
    "deepgrpo-baseline": ("deepgrpo_qwen2.5-0.5b-instruct_gsm8k_grpo_wandb.csv", "response_length_mean"),
    "deepgrpo-tree": ("deepgrpo_qwen2.5-0.5b-instruct_gsm8k_grpo_wandb.csv", "response_length_mean_deepgrpo_run"),
}
DEFAULT_COLUMN = "response_length_max"
"""The column of a user's CSV trace without ``:COLUMN`` (verl's name for the step's longest response)."""
NOISE_COLUMN = "response_length_mean"
"""The column of :data:`NOISE_SOURCE` whose step-to-step changes :func:`generated_ramp` resamples:
the mean's (the longest sits at the response cap in many steps and barely moves)."""
#: Short names of the shipped spot availability traces.
POOL_TRACES = {"us-east-2b": "us-east-2b_v100_1.json", "us-west-2a": "us-west-2a_v100_1.json"}
MAX_GAP_S = 366 * 86400.0
"""Longest ``metadata.gap_seconds`` of a pool trace: a year between samples."""
MAX_INSTANCES = 1_000_000
"""Most instances one sample of a pool trace may count (the counts are scaled to the cluster)."""
GENERATED_RAMP = "generated-ramp"
NOISE_SOURCE = "verl-amd-7b-grpo"


@dataclass(frozen=True)
class LengthTrace:
    """The longest response (tokens) of each RL step; ``generated`` marks a synthetic trace."""

    label: str
    response_lengths: tuple[float, ...]
    generated: bool = False

    def at(self, step: int) -> float:
        """Length of ``step`` (0-based); past the end the trace repeats from its start."""
        return self.response_lengths[step % len(self.response_lengths)]


@dataclass(frozen=True)
class PoolTrace:
    """Available fraction of the cluster over time.

    ``fractions[i]`` holds from ``i·gap_s`` seconds (``0 ≤ f ≤ 1``); past the end it repeats.
    A constant pool is ``fractions == (1.0,)``.
    """

    label: str
    gap_s: float
    fractions: tuple[float, ...]

    def fraction_at(self, time_s: float) -> float:
        if len(self.fractions) == 1:
            return self.fractions[0]
        return self.fractions[int(time_s // self.gap_s) % len(self.fractions)]

    def devices_at(self, time_s: float, total_devices: int, devices_per_node: int) -> int:
        """Devices available at ``time_s`` on a cluster of ``total_devices``: the fraction,
        rounded to the nearest whole node (spot capacity comes and goes by instance), a half
        upward: ``floor(f · nodes + 1/2)``, not Python's ``round``, which takes a half to the even
        neighbour (2.5 nodes → 2 but 3.5 → 4, and half the instances of a 1-node cluster → 0)."""
        nodes = total_devices // devices_per_node
        return math.floor(self.fraction_at(time_s) * nodes + 0.5) * devices_per_node

    def next_change_s(self, time_s: float) -> float:
        """Start of the next sample after ``time_s`` (``inf`` for a constant pool)."""
        if len(self.fractions) == 1:
            return math.inf
        return (math.floor(time_s / self.gap_s) + 1) * self.gap_s


def _read_column(path: Path, column: str) -> list[float]:
    """The numbers of ``column`` in the CSV ``path``, each a length in tokens from 1 to
    :data:`~nereusd.models.MAX_MODEL_DIMENSION` (the bound of ``generated-ramp`` and of a job's
    lengths; a trace of ``1e12`` was accepted and failed mid-simulation: an adversarial trial).
    Empty cells, and rows too short to reach the column, are skipped: a W&B export has them for
    the steps that did not log the column (``deepgrpo-tree`` shares its file with another run).

    Raises:
        ConfigError: naming the file (and the row): not UTF-8, no such column, an empty column,
            or a value that is not such a number.
    """
    values = []
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:   # a spreadsheet's BOM is not a column name
            reader = csv.DictReader(fh)
            if reader.fieldnames is None:
                raise ConfigError(f"{path.name}: the file is empty (expected a header row naming the columns, "
                                  f"{column!r} among them)")
            if column not in reader.fieldnames:
                raise ConfigError(f"{path.name}: no column {column!r} (columns: {reader.fieldnames}); name one with "
                                  f"FILE.csv:COLUMN (a length trace gives each step's longest response)")
            if reader.fieldnames.count(column) > 1:   # DictReader keeps the last silently
                raise ConfigError(f"{path.name}: the header names column {column!r} "
                                  f"{reader.fieldnames.count(column)} times")
            for row in reader:
                text = row[column]
                if text in ("", None):
                    continue
                try:
                    value = float(text)
                except ValueError:
                    value = math.nan
                if not 1 <= value <= MAX_MODEL_DIMENSION:   # NaN fails too
                    raise ConfigError(f"{path.name}: line {reader.line_num}: {column} {text!r} is not a number of "
                                      f"tokens from 1 to {MAX_MODEL_DIMENSION:,}")
                values.append(value)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path.name}: {not_utf8(err)}; is it a CSV file?") from None
    if not values:
        raise ConfigError(f"{path.name}: column {column!r} is empty")
    return values


def load_length_trace(name: str, steps: int | None = None, seed: int = 0) -> LengthTrace:
    """A length trace by short name (:data:`LENGTH_TRACES`), ``generated-ramp[:start:end]``,
    a shipped file name, or a CSV path with an optional ``:column``.

    Raises:
        ConfigError: for an unknown name, a missing file or column, or an empty column.
    """
    if name.startswith(GENERATED_RAMP):
        parts = name.split(":")
        if parts[0] != GENERATED_RAMP or len(parts) not in (1, 3):
            raise ConfigError(f"length trace {name!r}: expected {GENERATED_RAMP} or {GENERATED_RAMP}:START:END "
                              "(tokens)")
        try:
            start, end = (float(parts[1]), float(parts[2])) if len(parts) == 3 else (500.0, 8000.0)
        except ValueError:
            raise ConfigError(f"length trace {name!r}: START and END must be numbers of tokens") from None
        if not (1 <= start <= MAX_MODEL_DIMENSION and 1 <= end <= MAX_MODEL_DIMENSION):   # NaN fails too
            raise ConfigError(f"length trace {name!r}: START and END must be numbers of tokens from 1 to "
                              f"{MAX_MODEL_DIMENSION:,}")
        return generated_ramp(steps or 1000, start, end, seed=seed)
    if name in LENGTH_TRACES:
        file, column = LENGTH_TRACES[name]
        return LengthTrace(name, tuple(_read_column(LENGTH_DIR / file, column)))
    base, _, column = name.rpartition(":") if ":" in name and not Path(name).exists() else (name, "", "")
    path = Path(base) if Path(base).exists() else LENGTH_DIR / base
    if not path.is_file():
        raise ConfigError(f"length trace {name!r}: not a shipped trace ({sorted(LENGTH_TRACES)}, "
                          f"{GENERATED_RAMP}) nor a file")
    return LengthTrace(path.stem, tuple(_read_column(path, column or DEFAULT_COLUMN)))


def generated_ramp(steps: int, start: float = 500.0, end: float = 8000.0, seed: int = 0,
                   noise_from: str = NOISE_SOURCE) -> LengthTrace:
    """A generated long-CoT ramp, geometric from ``start`` to ``end`` tokens over ``steps``
    (the shape of the Nereus paper's Fig. 4a, for which no public per-step data exists), times
    step-to-step noise resampled (seeded) from the relative changes ``x_t/x_{t−1}`` of the real
    trace ``noise_from``. Labelled ``generated``.
    """
    real = _read_column(LENGTH_DIR / LENGTH_TRACES[noise_from][0], NOISE_COLUMN)
    ratios = [b / a for a, b in zip(real, real[1:]) if a > 0]
    mean_log = sum(math.log(r) for r in ratios) / len(ratios)
    rng = random.Random(seed)
    values = []
    for i in range(steps):
        base = start * (end / start) ** (i / max(1, steps - 1))
        values.append(base * math.exp(math.log(rng.choice(ratios)) - mean_log))
    return LengthTrace(f"generated ramp {start:.0f}->{end:.0f} (noise from {noise_from})", tuple(values),
                       generated=True)


def load_pool_trace(name: str | None) -> PoolTrace:
    """A pool trace by short name (:data:`POOL_TRACES`), file name or path; ``None`` or
    ``constant`` gives the whole cluster at every step. The trace starts at its first sample
    with every instance available (the job launches when its full allocation is granted).

    Raises:
        ConfigError: for an unknown name or a malformed file.
    """
    if name in (None, "", "constant"):
        return PoolTrace("constant", math.inf, (1.0,))
    path = Path(name) if Path(name).exists() else SPOT_DIR / POOL_TRACES.get(name, name)
    if not path.is_file():
        raise ConfigError(f"pool trace {name!r}: not a shipped trace ({sorted(POOL_TRACES)}, constant) nor a file")
    shape = "expected {'metadata': {'gap_seconds': S}, 'data': [instance counts]}"
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path.name}: {not_utf8(err)}; is it a JSON file?") from None
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{path.name}: not valid JSON ({str(err)[:120]}); {shape}") from None
    if not isinstance(data, dict) or not isinstance(data.get("metadata"), dict):
        raise ConfigError(f"{path.name}: {shape}, got a {type(data).__name__}"
                          + ("" if not isinstance(data, dict) else " without a 'metadata' object"))
    if "gap_seconds" not in data["metadata"] or "data" not in data:
        missing = "metadata.gap_seconds" if "gap_seconds" not in data["metadata"] else "data"
        raise ConfigError(f"{path.name}: no {missing}; {shape}")
    gap, raw = data["metadata"]["gap_seconds"], data["data"]
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not (1.0 <= gap <= MAX_GAP_S):
        raise ConfigError(f"{path.name}: metadata.gap_seconds must be a number of seconds from 1 to {MAX_GAP_S:g}, "
                          f"got {str(gap)[:40]!r}")
    if (not isinstance(raw, list) or not raw or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                                    or not 0 <= x <= MAX_INSTANCES or x != int(x) for x in raw)):
        raise ConfigError(f"{path.name}: data must be a non-empty list of instance counts (whole numbers from 0 "
                          f"to {MAX_INSTANCES:,})")
    gap, counts = float(gap), [int(x) for x in raw]
    full = max(counts)
    if full <= 0:
        raise ConfigError(f"{path.name}: no instance is ever available")
    first = counts.index(full)
    counts = counts[first:] + counts[:first]
    shipped = next((k for k, v in POOL_TRACES.items() if v == path.name and path.resolve().parent == SPOT_DIR), None)
    label = (f"{shipped} (16-node spot trace scaled to the cluster)" if shipped else
             f"{path.name} ({full} instances at most, scaled to the cluster)")
    return PoolTrace(label, gap, tuple(c / full for c in counts))
