"""What runs in a pool process never imports what runs in the worker's main process.

``celery_lease/worker/`` says by its layout where each part runs: ``main/`` in the
worker's main process, ``pool/`` in a pool process, ``protocol.py`` what they hand each
other. Read from the code's own imports (also those made inside a function), followed
through every module of the package a pool-process module reaches.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ..helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "celery_lease"
MAIN = "celery_lease.worker.main"
POOL = "celery_lease.worker.pool"
PROTOCOL = "celery_lease.worker.protocol"


def _name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, wherever in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # a package the importer sits in is loaded already: not an import of it
            if target in known and not name.startswith(target + "."):
                found.add(target)
    return found


def _reached(start: str, graph: dict[str, set[str]]) -> dict[str, str]:
    """Every module ``start`` reaches, with the module that imports it on the way."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        current = todo.pop()
        for target in graph[current]:
            if target not in via and target != start:
                via[target] = current
                todo.append(target)
    return via


def _path(start: str, end: str, via: dict[str, str]) -> list[str]:
    chain = [end]
    while chain[-1] != start:
        chain.append(via[chain[-1]])
    return chain[::-1]


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _main_process(name: str) -> bool:
    return name == MAIN or name.startswith(MAIN + ".")


def test_the_worker_has_a_main_side_a_pool_side_and_one_protocol():
    known = _modules()
    assert PROTOCOL in known
    assert any(_main_process(name) and name != MAIN for name in known)
    assert any(name.startswith(POOL + ".") for name in known)


def test_no_pool_process_module_reaches_a_main_process_module():
    graph = _graph()
    starts = [name for name in graph if name.startswith(POOL + ".") or name == PROTOCOL]
    crossings = []
    for start in starts:
        via = _reached(start, graph)
        crossings += [" -> ".join(_path(start, end, via)) for end in via if _main_process(end)]
    assert crossings == []


def test_the_protocol_imports_neither_side():
    graph = _graph()
    sides = [name for name in graph[PROTOCOL] if _main_process(name) or name.startswith(POOL)]
    assert sides == []
