"""Run the store's model-based test (``tests/property/store_model.py``) for a given time.

Usage::

    python scripts/model_check.py --minutes 60                      # SQLite
    python scripts/model_check.py --minutes 60 --postgres URL       # PostgreSQL
    python scripts/model_check.py --minutes 60 --seed 1234          # a given seed

Examples run in rounds of ``--examples`` (each a fresh database and up to ``--steps``
rules), each round with its own seed, ``seed + round``; the first seed is printed at
the start. A failure stops the run: Hypothesis shrinks it and prints the shortest
sequence of rules that reproduces it, and the script prints the round's seed, which
replays it (``--seed S --rounds 1``). Exit status 0 when nothing was found, 1 when
something was.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.property.model_database import Database
from tests.property.store_model import machine_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="how long to run")
    parser.add_argument("--postgres", metavar="URL", help="a PostgreSQL database to use")
    parser.add_argument("--seed", type=int, help="the first round's seed (default: random)")
    parser.add_argument("--rounds", type=int, help="stop after this many rounds")
    parser.add_argument("--examples", type=int, default=20, help="examples per round")
    parser.add_argument("--steps", type=int, default=80, help="rules per example, at most")
    args = parser.parse_args(argv)
    first = args.seed if args.seed is not None else random.randrange(2**32)
    backend = "postgresql" if args.postgres else "sqlite"
    print(f"model check on {backend}: seed {first}, {args.minutes:g} min", flush=True)
    end = time.monotonic() + args.minutes * 60
    examples = 0
    with tempfile.TemporaryDirectory(prefix="model-check-") as folder:
        database = Database(args.postgres, Path(folder))
        try:
            round_ = 0
            while time.monotonic() < end and (args.rounds is None or round_ < args.rounds):
                current = first + round_
                machine = seed(current)(machine_for(database))
                try:
                    run_state_machine_as_test(
                        machine,
                        settings=settings(
                            max_examples=args.examples,
                            stateful_step_count=args.steps,
                            deadline=None,
                            database=None,
                            suppress_health_check=list(HealthCheck),
                        ),
                    )
                except Exception:
                    print(
                        f"FOUND in round {round_ + 1} (seed {current}), after {examples} "
                        f"examples: replay with --seed {current} --rounds 1",
                        flush=True,
                    )
                    raise
                examples += args.examples
                round_ += 1
                print(f"round {round_} (seed {current}): {args.examples} examples, ok", flush=True)
        finally:
            database.close()
    print(f"nothing found: {examples} examples in {round_} rounds, seed {first}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        import traceback

        traceback.print_exc()
        sys.exit(1)
