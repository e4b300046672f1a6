"""Shared helpers of the test suite (fixtures that use them are in ``tests/conftest.py``)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root."""
