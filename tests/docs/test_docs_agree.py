"""README, docs and CI agree with each other and with the code.

While README.md and docs/ are still placeholders these tests skip (visibly, with -ra);
``CELERY_LEASE_DOCS_STRICT=1`` (the tox ``docs`` env) turns those skips into failures.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from celery_lease.config import DEPRECATED, SETTINGS, LeaseConfig
from celery_lease.store.migrations import DROPPED_INDEXES
from celery_lease.store.schema import SCHEMA_VERSION, build

from ..helpers import REPO_ROOT

pytestmark = pytest.mark.docs

STRICT = os.environ.get("CELERY_LEASE_DOCS_STRICT") == "1"


def _written(text: str, what: str, minimum: int = 400) -> str:
    if len(text.strip()) < minimum:
        if STRICT:
            pytest.fail(f"{what} is not written yet")
        pytest.skip(f"{what} is not written yet")
    return text


def ci_test_command() -> str:
    script = (REPO_ROOT / ".ci" / "run").read_text()
    match = re.search(r'^TEST_CMD="([^"]+)"$', script, re.MULTILINE)
    assert match, '.ci/run must define TEST_CMD="..." on a line of its own'
    return match.group(1)


def docs_text() -> str:
    docs = REPO_ROOT / "docs"
    pages = sorted(docs.rglob("*.md")) if docs.is_dir() else []
    return "\n".join(p.read_text() for p in pages)


def test_ci_runs_its_test_command():
    command = ci_test_command()
    assert command == "python -m pytest"
    assert re.search(r"^\$TEST_CMD$", (REPO_ROOT / ".ci" / "run").read_text(), re.MULTILINE)


def test_readme_states_the_ci_test_command():
    readme = _written((REPO_ROOT / "README.md").read_text(), "README.md")
    assert ci_test_command() in readme


def settings_rows() -> dict[str, list[str]]:
    """The rows of the settings tables of docs/settings.md (its task options excepted):
    setting name -> the Default cell of each row naming it."""
    text = (REPO_ROOT / "docs" / "settings.md").read_text()
    text = re.sub(r"^## Task options$.*?(?=^## |\Z)", "", text, flags=re.MULTILINE | re.DOTALL)
    rows: dict[str, list[str]] = {}
    for name, default in re.findall(r"^\| `(lease_\w+)` \| ([^|]*) \|", text, re.MULTILINE):
        rows.setdefault(name, []).append(default.strip())
    return rows


def test_every_setting_is_documented():
    # one row per setting in docs/settings.md, with the default the code has
    _written(docs_text(), "docs/")
    defaults = {f.name: f.default for f in dataclasses.fields(LeaseConfig)}
    rows = settings_rows()
    wrong = [f"{key}: no row in docs/settings.md" for key in SETTINGS if key not in rows]
    for key, cells in rows.items():
        if key not in SETTINGS:
            wrong.append(f"{key}: documented, but there is no such setting")
            continue
        default = defaults[key.removeprefix("lease_")]
        expected = f"`{default if isinstance(default, str) else repr(default)}`"
        if cells != [cells[0]] or not cells[0].startswith(expected):
            wrong.append(f"{key}: documented default {cells}, the code's is {expected}")
    assert wrong == []


def test_tox_envs_cover_the_documented_set():
    tox = (REPO_ROOT / "tox.ini").read_text()
    envs = set(re.findall(r"^\[testenv:([a-z]+)\]$", tox, re.MULTILINE))
    assert envs == {"sqlite", "postgres", "crash", "lint", "type", "docs"}


def test_readme_links_resolve():
    readme = _written((REPO_ROOT / "README.md").read_text(), "README.md")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t and not t.startswith("mailto:")]
    missing = [t for t in local if not (REPO_ROOT / Path(t)).exists()]
    assert missing == []


# -- what the docs name exists ------------------------------------------------------------


def doc_pages() -> dict[str, str]:
    """Every page a user reads: README.md and docs/*.md, by path from the repository."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    return {str(p.relative_to(REPO_ROOT)): p.read_text() for p in pages if p.is_file()}


_FENCE = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n(.*?)^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)


def code_lines(text: str) -> list[str]:
    """The code of a page: each line of its fenced blocks (a shell line continued with a
    backslash joined to the next) and each inline code span (one line, even when the
    span wraps)."""
    lines: list[str] = []
    for block in _FENCE.finditer(text):
        lines += re.sub(r"\\\n[ \t]*", " ", block.group(2)).splitlines()
    for double, single in re.findall(r"``(.+?)``|`([^`\n]+(?:\n[^`\n]+)?)`", _FENCE.sub("", text)):
        lines.append(" ".join((double or single).split()))
    return lines


#: ``celery [global options] lease``: what follows is a lease command line.
_CELERY_LEASE = re.compile(r"\bcelery((?:\s+-{1,2}[\w-]+(?:[= ][^\s-]\S*)?)*)\s+lease\b")
#: a span that is only ``lease CMD`` with options and placeholders (``lease show ID``)
_BARE = re.compile(r"^(?:\$ )?lease(?= [a-z][a-z-]*(?:\s+(?:-{1,2}[\w-]+|[A-Z][A-Z_.]*|\.\.\.))*$)")
#: where a command line ends: another command, a comment, a pipe into a program
_END = re.compile(r"\bcelery\b|\s#|&&|;|\|\s*(?=[a-z])|\$\(")
_OPTION = re.compile(r"(?<![\w-])(-{1,2}[A-Za-z][\w-]*)")


def cli_invocations() -> list[tuple[str, str, str]]:
    """(page, the line, what follows ``lease``) for each lease command line in the docs."""
    found: list[tuple[str, str, str]] = []
    for page, text in doc_pages().items():
        for line in code_lines(text):
            starts = [m.end() for m in _CELERY_LEASE.finditer(line)]
            bare = _BARE.match(line)
            if bare:
                starts.append(bare.end())
            for start in starts:
                rest = line[start:]
                end = _END.search(rest)
                found.append((page, line, rest[: end.start()] if end else rest))
    return found


def cli_problems(rest: str) -> list[str]:
    """What is wrong with ``celery lease`` + ``rest`` for the real click command."""
    import click

    from celery_lease.cli import lease

    # a quoted value is a value (a reason, a JSON result), never an option
    words = re.sub(r"\"[^\"]*\"|'[^']*'", " ", rest).split()
    command: click.Command = lease
    path = ["lease"]
    while isinstance(command, click.Group) and words and words[0] in command.commands:
        command = command.commands[words[0]]
        path.append(words.pop(0))
    if isinstance(command, click.Group) and words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
        return [f"no command {' '.join([*path, words[0]])!r}"]
    params = command.get_params(click.Context(command))
    known = {o for p in params for o in p.opts + p.secondary_opts}
    named = _OPTION.findall(" ".join(words))
    return [f"{' '.join(path)} has no option {o}" for o in named if o not in known]


def test_every_cli_invocation_in_the_docs_exists():
    invocations = cli_invocations()
    assert len(invocations) > 50, "the docs' command lines were not found"
    wrong = [
        f"{page}: {problem}: {line}"
        for page, line, rest in invocations
        for problem in cli_problems(rest)
    ]
    assert wrong == []


def test_the_cli_checks_catch_a_wrong_command_line():
    assert cli_problems(" retry --name a --state WAIT_MANUAL --dry-run") == []
    assert cli_problems(" list [-s S] [--ids] [--json]") == []
    assert cli_problems(" retyr ID") == ["no command 'lease retyr'"]
    assert cli_problems(" reap --loops") == ["lease reap has no option --loops"]
    assert cli_problems(' fail ID --reason "see --force"') == []
    assert cli_problems(" show ID -q") == ["lease show has no option -q"]


def test_the_cli_reference_names_every_command_and_option():
    # the synopsis at the top of reference-cli.md: one line per command, FILTERS once
    import click

    from celery_lease.cli import lease

    text = (REPO_ROOT / "docs" / "reference-cli.md").read_text()
    synopsis = _FENCE.search(text)
    assert synopsis is not None
    lines: dict[str, str] = {}
    filters = ""
    for line in synopsis.group(2).splitlines():
        if m := re.match(r"celery -A proj lease (\w+)(.*)", line):
            lines[m.group(1)] = m.group(2)
        elif line.strip().startswith("FILTERS:") or (filters and line.startswith("    ")):
            filters += line
    missing = []
    for name, command in lease.commands.items():
        if name not in lines:
            missing.append(f"lease {name}")
            continue
        shown = lines[name] + (filters if "FILTERS" in lines[name] else "")
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            if not any(re.search(rf"(?<![\w-]){o}(?![\w-])", shown) for o in param.opts):
                missing.append(f"lease {name} {param.opts[-1]}")
    assert missing == []
    assert set(lines) <= set(lease.commands)


#: ``lease_*`` names in the docs that are neither settings nor names the code defines:
#: names the docs' own examples choose (each must still be used, or leave this list).
EXAMPLE_NAMES = {
    "lease_format_task": "docs/flower.md: an import alias of format_task",
    "lease_worker_image": "docs/testing.md: a pytest-docker-tools fixture of the recipe",
}


def code_lease_names() -> set[str]:
    """``lease_*`` names the code defines that are not settings: the tables and indexes
    (and the names PostgreSQL gives their keys and aliases in a plan), the testing
    plugin's fixtures and ini options, the event and log fields, and the attributes of
    the public classes."""
    import celery_lease
    from celery_lease import contrib, notify
    from celery_lease.testing import plugin

    names: set[str] = set()
    for table in build().metadata.sorted_tables:
        names |= {table.name, f"{table.name}_pkey", f"{table.name}_1", f"{table.name}_2"}
        names |= {str(index.name) for index in table.indexes}
    # indexes a migration dropped: recorded plans of earlier versions name them
    names |= {f"lease_{name}" for name in DROPPED_INDEXES}
    source = Path(plugin.__file__).read_text()
    names |= set(re.findall(r"^def (lease_\w+)\(", source, re.MULTILINE))
    names |= set(re.findall(r"addini\(\s*\"(lease_\w+)\"", source))
    for module in (notify, Path(contrib.__file__).parent / "flower.py"):
        path = module if isinstance(module, Path) else Path(str(module.__file__))
        names |= set(re.findall(r"\"(lease_\w+)\"", path.read_text()))
    for name in celery_lease.__all__:
        names |= {a for a in dir(getattr(celery_lease, name)) if a.startswith("lease_")}
    names |= set(DEPRECATED)  # the settings that went away, which still warn
    return names


def test_every_lease_name_in_the_docs_is_a_setting_or_a_name_of_the_code():
    text = "\n".join(doc_pages().values())
    used = set(re.findall(r"(?<!\w)lease_\w+", text))
    unknown = sorted(used - set(SETTINGS) - code_lease_names() - set(EXAMPLE_NAMES))
    assert unknown == [], "not a setting, nor a name the code defines"
    assert set(EXAMPLE_NAMES) <= used


def test_the_documented_schema_version_is_the_codes():
    # what `lease migrate` prints and a worker without tables says (howto-postgresql.md)
    found = [
        (page, int(v))
        for page, text in doc_pages().items()
        for v in re.findall(r"(?:from nothing to |up to date \(|needs )version (\d+)", text)
    ]
    assert len(found) >= 3
    assert [(page, v) for page, v in found if v != SCHEMA_VERSION] == []


def test_every_celery_lease_variable_in_the_docs_is_a_setting_or_read_by_the_code():
    # CELERY_LEASE_TTL: a setting in Django's CELERY_ namespace; CELERY_LEASE_DATABASE_URL
    # also an environment variable: every other one must be read somewhere in the code
    text = "\n".join(doc_pages().values())
    used = set(re.findall(r"\bCELERY_LEASE_[A-Z0-9_]+\b", text))
    django = {f"CELERY_{key.upper()}" for key in SETTINGS}
    sources = [
        p
        for folder in ("celery_lease", "tests", "benchmarks", "scripts")
        for p in (REPO_ROOT / folder).rglob("*.py")
    ]
    read = set()
    for path in sources:
        read |= set(re.findall(r"[\"'](CELERY_LEASE_[A-Z0-9_]+)[\"']", path.read_text()))
    assert sorted(used - django - read) == []


def test_every_test_the_docs_name_exists():
    # "tests/crash/test_x.py::test_y" or, in the reliability tables, "test_x.py::test_y"
    named = {
        (page, path, name)
        for page, text in doc_pages().items()
        for path, name in re.findall(r"([\w/]*test_\w+\.py)::(test_\w+)", text)
    }
    assert len(named) > 30
    files = [*(REPO_ROOT / "tests").rglob("test_*.py"), *(REPO_ROOT / "examples").rglob("*.py")]
    missing = []
    for page, path, name in sorted(named):
        found = [f for f in files if str(f.relative_to(REPO_ROOT)).endswith(path)]
        if not any(re.search(rf"^def {name}\(", f.read_text(), re.MULTILINE) for f in found):
            missing.append(f"{page}: {path}::{name}")
    assert missing == []
