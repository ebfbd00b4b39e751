"""The package map in docs/design-notes.md names every module of the package."""

from __future__ import annotations

import re

from ..helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "celery_lease"


def _map() -> str:
    text = (REPO_ROOT / "docs" / "design-notes.md").read_text()
    start = text.index("## Map of the package")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _modules() -> list[str]:
    """Top-level modules and store modules by file name; the worker's and the producer's
    by path; other packages by folder."""
    names = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    names += [p.name for p in (PACKAGE / "store").glob("*.py") if p.name != "__init__.py"]
    names += [f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    names += [
        f"contrib/{p.name}" for p in (PACKAGE / "contrib").glob("*.py") if p.name != "__init__.py"
    ]
    # the worker and the producer by path: where a module sits says where it runs
    for package in ("worker", "producer"):
        names += [
            p.relative_to(PACKAGE).as_posix()
            for p in (PACKAGE / package).rglob("*.py")
            if p.name != "__init__.py"
        ]
    return sorted(set(names) - {"store/", "contrib/"} | {"contrib/django/"})


def test_the_map_names_every_module():
    text = _map()
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", text))
    missing = [m for m in _modules() if m not in named and f"`{m}`" not in text]
    assert missing == []
