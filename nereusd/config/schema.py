"""The building blocks of the job schema's sections (:mod:`nereusd.config.job`): a strict
pydantic model and the float type a job YAML writes."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictFloat

_FLOAT_LITERAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+|[+-]?\.?inf(inity)?", re.IGNORECASE)


def _yaml_float(value: Any) -> Any:
    """PyYAML follows YAML 1.1, which reads ``1e-5`` (an exponent without a dot) and ``inf`` as
    strings: take such a string as the number it spells. Any other string, and a boolean, stays
    what it is, for the strict check to refuse."""
    if isinstance(value, str) and _FLOAT_LITERAL.fullmatch(value.strip()):
        text = value.strip().lower().replace(".inf", "inf")
        return float(text)
    return value


Number = Annotated[StrictFloat, BeforeValidator(_yaml_float)]
"""A float field of the job: an int or a float as written (``true`` and ``"0.5"`` are refused, as
the site loader refuses them), or an exponent literal YAML 1.1 leaves as a string (``1e-5``)."""


class Strict(BaseModel):
    """A job section: unknown keys, mutation, NaN and infinity are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False, allow_inf_nan=False)
