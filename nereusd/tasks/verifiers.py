"""Rule-based verifiers of math answers: GSM8K's ``#### <number>`` and MATH's ``\\boxed{...}``.

- :func:`gsm8k_answer` takes the number after the last ``####`` of a text (the GSM8K answer
  format, Cobbe et al., "Training Verifiers to Solve Math Word Problems", 2021) and normalises it
  (thousands separators, a currency sign, a trailing full stop, ``+`` signs, trailing zeros of a
  decimal); :func:`verify_gsm8k` compares a response's with the ground truth's as exact decimals.
- :func:`verify_math` compares a response with a ground truth the way verl and OpenRLHF do, with
  Hugging Face's ``math-verify``: both are parsed (LaTeX, ``\\boxed{}`` first, or plain
  expressions) and compared symbolically (``1/2`` equals ``\\frac{1}{2}`` equals ``0.5``).

Each verifier returns a reward in ``{0.0, 1.0}``. A response that has no answer in the expected
form earns 0; so does one the checker cannot decide within its time limit (``timeout_s``; the
limit uses ``SIGALRM``, so the check runs only in the main thread, where nereusd's driver runs; in
another thread it is refused, since an answer such as ``(10^9)!`` would never finish). Inputs are
bounded (:data:`MAX_ANSWER_CHARS`) so that a degenerate response cannot stall the driver.
"""

from __future__ import annotations

import logging
import re
import threading
from decimal import Context, Decimal, InvalidOperation

from nereusd.errors import NereusError

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 200
"""Longest answer string compared (a 200-digit number is no GSM8K answer)."""
MAX_RESPONSE_CHARS = 20_000
"""Longest response text handed to the MATH checker (its tail is kept: answers come last)."""

_GSM8K_NUMBER = re.compile(r"[-+]?\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?|[-+]?\$?\s*\.[0-9]+")
_GSM8K_REFERENCE = re.compile(rf"(?:{_GSM8K_NUMBER.pattern})\s*[.%]?")
"""A reference's answer: one number (:data:`_GSM8K_NUMBER`), then at most a full stop or a per
cent sign; ``3/4``, ``1e3``, ``1 234`` or ``12abc`` would be read as their leading number."""


def gsm8k_answer(text: str) -> str | None:
    """The normalised number after the last ``####`` of ``text``, or ``None`` when there is none.

    Normalised: no thousands separators, currency sign, ``+`` or trailing full stop; a decimal
    without trailing zeros (``12.50`` → ``12.5``, ``3.0`` → ``3``); ``-0`` → ``0``. Digits other
    than ASCII (``٤٢``) are not a GSM8K answer.
    """
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    match = _GSM8K_NUMBER.match(tail)
    if match is None:
        return None
    raw = match.group(0).replace(",", "").replace("$", "").replace(" ", "").replace("+", "")
    if len(raw) > MAX_ANSWER_CHARS:
        return None
    try:
        value = Decimal(raw)
    except InvalidOperation:
        return None
    if value == 0:
        return "0"
    # normalize() rounds to its context's precision; MAX_ANSWER_CHARS digits keep it exact
    text_value = format(value.normalize(Context(prec=MAX_ANSWER_CHARS + 2)), "f")
    return text_value


def gsm8k_reference_problem(ground_truth: str) -> str | None:
    """Why :func:`verify_gsm8k` could never match ``ground_truth`` as meant, or ``None``: a
    reference needs ``#### <number>`` or is the bare number itself. Without ``####`` only the
    leading number was read, so ``3 + 7 = 10`` taught the policy that the answer is 3, and
    ``forty-two`` scored every response 0 (an adversarial helper, 2026-12-06)."""
    tail = ground_truth.rsplit("####", 1)[1] if "####" in ground_truth else ground_truth
    if gsm8k_answer(f"#### {tail}") is None or _GSM8K_REFERENCE.fullmatch(tail.strip()) is None:
        return ("has no number alone after its last ####" if "####" in ground_truth
                else "is neither '#### <number>' nor a bare number")
    return None


def verify_gsm8k(response: str, ground_truth: str) -> float:
    """1.0 when the response's ``#### <number>`` equals the ground truth's number, else 0.0.

    ``ground_truth`` is a GSM8K ``answer`` (reasoning then ``#### 42``) or the bare number.
    """
    truth = gsm8k_answer(ground_truth) if "####" in ground_truth else gsm8k_answer(f"#### {ground_truth}")
    got = gsm8k_answer(response)
    if truth is None or got is None:
        return 0.0
    return 1.0 if Decimal(truth) == Decimal(got) else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, braces balanced;
    ``None`` when there is none or it is not closed."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def verify_math(response: str, ground_truth: str, timeout_s: int = 2) -> float:
    """1.0 when ``math-verify`` finds the response's answer equal to the ground truth, else 0.0.

    ``ground_truth`` is a MATH ``solution`` (its last ``\\boxed{}`` is the answer) or the answer
    itself. The response's answer is its last ``\\boxed{}``; a response without one earns 0.
    Each of the two parses and the comparison is cut off after ``timeout_s`` seconds (score 0).

    Raises:
        NereusError: when called off the main thread (the time limit needs ``SIGALRM``).
    """
    from math_verify import parse, verify

    boxed = last_boxed(response[-MAX_RESPONSE_CHARS:])
    if boxed is None or len(boxed) > MAX_ANSWER_CHARS:
        return 0.0
    truth = last_boxed(ground_truth)
    truth = ground_truth if truth is None else truth
    if len(truth) > MAX_ANSWER_CHARS:
        return 0.0
    # math-verify's limit is SIGALRM, which only the main thread may set. Without it a short answer
    # such as (10^9)! never finishes, so a check elsewhere is refused rather than left unbounded.
    if threading.current_thread() is not threading.main_thread():
        raise NereusError("verify_math: math-verify bounds each check with SIGALRM, so it must run in the main "
                          "thread (nereusd's driver does)")
    limit = timeout_s
    try:
        gold = parse(f"\\boxed{{{truth}}}", parsing_timeout=limit)
        pred = parse(f"\\boxed{{{boxed}}}", parsing_timeout=limit)
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0
    except Exception as err:  # noqa: BLE001 - a response the checker chokes on earns 0, and the job goes on
        log.debug("math-verify could not compare %r with %r: %s", boxed, truth, err)
        return 0.0


def boxed_reference_problem(ground_truth: str) -> str | None:
    """Why :func:`verify_math` could never match ``ground_truth``, or ``None``: the answer it
    compares (the last ``\\boxed{}``, else the whole reference) must be at most
    :data:`MAX_ANSWER_CHARS` long; a longer one scored every response 0."""
    truth = last_boxed(ground_truth)
    if truth is None and len(ground_truth) > MAX_ANSWER_CHARS:
        return f"has no \\boxed{{}} and is longer than {MAX_ANSWER_CHARS} characters"
    if truth is not None and len(truth) > MAX_ANSWER_CHARS:
        return f"has a last \\boxed{{}} longer than {MAX_ANSWER_CHARS} characters"
    return None


VERIFIERS = {"gsm8k": verify_gsm8k, "boxed": verify_math}
REFERENCE_PROBLEMS = {"gsm8k": gsm8k_reference_problem, "boxed": boxed_reference_problem}
"""Per format, why a dataset's reference could never be matched (checked at load, naming the row)."""
"""Answer formats a dataset can declare, and their verifier."""
