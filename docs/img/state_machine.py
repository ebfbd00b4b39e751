"""Draw the state machine of celery_lease.states.TRANSITIONS (docs/img/state-machine.png).

Run from the repository root: ``python docs/img/state_machine.py`` (needs Graphviz's
``dot``: ``apt-get install graphviz``). Writes ``state-machine.dot`` and, when ``dot`` is
installed, ``state-machine.png`` next to this file. Every transition of the table is
drawn; a transition without a short label here is an error, so the picture cannot
silently fall behind the code.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from celery_lease.states import TERMINAL, TRANSITIONS, State

HERE = Path(__file__).resolve().parent

S = State
#: (from, to) -> (label, drawn by an operator?)
LABELS: dict[tuple[State | None, State], tuple[str, bool]] = {
    (None, S.PENDING): ("apply_async: row written,\nthen published", False),
    (S.PENDING, S.RUNNING): ("claim\n(attempt += 1)", False),
    (S.RUNNING, S.SUCCEEDED): ("returned", False),
    (S.RUNNING, S.FAILED): ("raised", False),
    (S.RUNNING, S.RETRY_WAIT): ("self.retry()\nautoretry_for", False),
    (S.RUNNING, S.CANCELLED): ("cancel seen at\na step boundary", False),
    (S.RUNNING, S.TIMEOUT): ("lease expired", False),
    (S.RUNNING, S.WAIT_MANUAL): (
        "over max_runtime;\nretries exhausted\n(on_exhausted=manual)",
        False,
    ),
    (S.TIMEOUT, S.RETRY_WAIT): ("safe to retry", False),
    (S.TIMEOUT, S.WAIT_MANUAL): (
        "step outcome unknown,\npoison, too old,\non_timeout=manual",
        False,
    ),
    (S.RETRY_WAIT, S.PENDING): ("due: re-published", False),
    (S.WAIT_MANUAL, S.SUCCEEDED): ("resolve\n(or owner finishes)", True),
    (S.WAIT_MANUAL, S.FAILED): ("fail\n(or owner fails)", True),
    (S.WAIT_MANUAL, S.PENDING): ("retry", True),
    (S.FAILED, S.PENDING): ("retry", True),
    (S.TIMEOUT, S.PENDING): ("retry", True),
    (S.PENDING, S.CANCELLED): ("cancel", True),
    (S.RETRY_WAIT, S.CANCELLED): ("cancel", True),
    (S.TIMEOUT, S.CANCELLED): ("cancel (or cancel\nrequested earlier)", True),
    (S.WAIT_MANUAL, S.CANCELLED): ("cancel", True),
    (S.FAILED, S.CANCELLED): ("cancel", True),
}


def dot_source() -> str:
    missing = sorted(set(TRANSITIONS) - set(LABELS), key=str)
    extra = sorted(set(LABELS) - set(TRANSITIONS), key=str)
    if missing or extra:
        raise SystemExit(f"labels out of date: missing {missing}, not in the table {extra}")
    lines = [
        "digraph lease {",
        '  graph [rankdir=TB, fontname="Helvetica", nodesep=0.5, ranksep=0.55, pad=0.2];',
        '  node [shape=box, style="rounded,filled", fillcolor="#eef3fb", fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=10];',
        '  start [shape=point, width=0.15, label=""];',
        '  WAIT_MANUAL [fillcolor="#fde9c8"];',
        '  TIMEOUT [fillcolor="#fbd9d3"];',
    ]
    for state in sorted(TERMINAL, key=lambda s: s.value):
        lines.append(f'  {state.value} [peripheries=2, fillcolor="#dff0d8"];')
    lines.append('  FAILED [fillcolor="#f4e1e1"];')
    lines.append("  { rank=same; SUCCEEDED; FAILED; CANCELLED; }")
    for (frm, to), (label, operator) in LABELS.items():
        src = "start" if frm is None else frm.value
        style = ', style=dashed, color="#7a4fb0", fontcolor="#7a4fb0"' if operator else ""
        text = label.replace("\n", "\\n")
        lines.append(f'  {src} -> {to.value} [label="{text}"{style}];')
    lines.append(
        '  legend [shape=plaintext, fillcolor=white, style="", fontsize=10, '
        'label="solid: worker, reaper or the task itself\\n'
        'dashed: an operator (admin API, CLI)\\ndouble border: terminal"];'
    )
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    dot_path = HERE / "state-machine.dot"
    dot_path.write_text(dot_source())
    print(f"wrote {dot_path}")
    if shutil.which("dot") is None:
        print("Graphviz `dot` not found: PNG not rendered", file=sys.stderr)
        return 1
    png = HERE / "state-machine.png"
    subprocess.run(["dot", "-Tpng", "-Gdpi=110", str(dot_path), "-o", str(png)], check=True)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
