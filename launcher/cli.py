"""``nereus-launch``: the command a user runs on a login node (or a workstation for local mode).

Each subcommand lives in its own module under ``launcher/`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the
parsed ``argparse.Namespace`` and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import sys
import tempfile
from pathlib import Path

from nereusd.errors import NereusError

# Subcommand modules, in the order --help lists them. A module that is not present yet is
# skipped so that partial installs still give a working CLI.
SUBCOMMAND_MODULES = (
    "launcher.local",
    "launcher.report",
    "launcher.plan_cmd",
    "launcher.submit",
    "launcher.status_cmd",
    "launcher.simulate_cmd",
    "launcher.pool_cmd",
    "launcher.resume_cmd",
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, where it has one (not ``None``, ``False`` or an
    empty sequence: ``--zero``'s ``()`` means "no ZeRO", which its help says)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default in ((), []):
            return action.help or ""
        return super()._get_help_string(action)


def bounded_int(low: int, high: int):
    """An argparse ``type`` for an integer in ``[low, high]`` whose error says the range (argparse
    prefixes the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low:,} to {high:,}, got {text}")
        return value
    return parse


def bounded_float(low: float, high: float):
    """An argparse ``type`` for a finite number in ``[low, high]`` (NaN and infinities refused)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"expected a number in [{low:g}, {high:g}], got {text}")
        return value
    return parse


def output_directory(path: str | Path, option: str = "--out") -> Path:
    """``path`` as an output directory, created if missing (``simulate --out``, ``report --out``).

    Raises:
        NereusError: naming ``option``, when it exists and is not a directory, or cannot be made or
            written in.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise NereusError(f"{option} {path}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise NereusError(f"{option} {path}: cannot create it ({err.strerror})") from None
    try:   # checked before the work whose results go there (a /proc --out lost a whole simulation)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise NereusError(f"{option} {path}: cannot write files in it ({err.strerror})") from None
    return out


def run_directory(path: str | Path) -> Path:
    """``path`` as an existing run directory, resolved (``resume``, ``report``, ``status``: one
    message for a mistyped path, where they had three).

    Raises:
        NereusError: ``PATH: no such run directory``, or ``PATH: not a run directory (a file)``.
    """
    where = Path(path)
    if not where.is_dir():
        raise NereusError(f"{path}: " + ("not a run directory (a file)" if where.exists() else "no such run directory"))
    return where.resolve()


def _version() -> str:
    """The installed distribution's version (``pyproject.toml``), or a note where none is installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nereus")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nereus-launch",
        description=(
            "Run and manage Nereus RL post-training jobs. 'local' runs a whole job (nereusd, one "
            "agent, one worker per virtual device) on this machine; 'submit' renders the sbatch "
            "template with a site config and submits it to Slurm; 'plan' and 'simulate' show what "
            "the planner and the adaptation policy would do, without GPUs; 'report' plots a run."
        ),
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"nereus-launch {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:   # the subcommands' imports take most of a second: a Ctrl-C there printed a traceback
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("nereus-launch: interrupted", file=sys.stderr)
        return 130
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except NereusError as err:
        print(f"nereus-launch: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nereus-launch: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # the reader left (`status --json | head`): stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())   # the interpreter's final flush would raise again
        return 141   # 128 + SIGPIPE, what a shell reports for a writer the pipe closed on


if __name__ == "__main__":
    sys.exit(main())
