"""Fuzz nereusd's control plane: ``--cases`` frames (default 100,000) from
``tests/support/protocol_fuzz.py`` — random bytes, JSON of every shape, valid messages with a
field replaced, deep nesting — through the real decoder and handlers of a control plane in
mid-job. Stops at the first frame that raises out of the handlers or breaks a registry bound,
and prints it (hypothesis shrinks it first).

    python scripts/fuzz_protocol.py --cases 100000

Last line: ``fuzz: <n> cases; refused <r>; crashes <c>; <s> s``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from tests.support.protocol_fuzz import frames, make_target  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100_000, help="frames to try (default 100000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error(f"--cases: expected at least 1, got {args.cases}")
    start = time.monotonic()
    count = 0
    with tempfile.TemporaryDirectory(prefix="nereus-fuzz-") as tmp:
        target = make_target(Path(tmp))

        @settings(max_examples=args.cases, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(frames())
        def case(frame):
            nonlocal count
            count += 1
            if count % 10_000 == 0:
                print(f"fuzz: {count} cases, {target.control.refused_messages} refused, "
                      f"{time.monotonic() - start:.0f} s", flush=True)
            target.feed(frame)

        crashes = 0
        try:
            seed(args.seed)(case)()
        except Exception as err:  # noqa: BLE001 - report the frame that broke it, then fail
            crashes = 1
            print(f"fuzz: a frame broke the control plane: {type(err).__name__}: {err}", file=sys.stderr)
        refused = target.control.refused_messages
        target.close()
    print(f"fuzz: {count} cases; refused {refused}; crashes {crashes}; {time.monotonic() - start:.0f} s")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
