"""Database URLs as they may be shown: every secret a SQLAlchemy or libpq URL can carry
is masked, in one place.

A URL reaches logs, error messages and the CLI in many ways (the worker's start-up
line, every ``StoreError``, ``celery lease migrate``, the Django admin's messages). A
secret can sit in several places of it, all valid for libpq and passed on by
SQLAlchemy:

* the password of the netloc: ``postgresql://user:secret@host/db``;
* a query parameter: ``?password=secret``, ``?sslpassword=secret`` (the client key's
  passphrase), or any parameter whose name says password, secret or token;
* a connection string inside a parameter or the database name, which libpq expands:
  ``?dbname=host%3Ddb%20password%3Dsecret`` or ``?dbname=postgresql://u:secret@h/db``.

``passfile``, ``sslkey`` and ``sslcert`` name files; their paths are not secret and
stay visible (they are what one needs to debug a connection).
"""

from __future__ import annotations

import re
from urllib.parse import quote, quote_plus

from sqlalchemy import exc
from sqlalchemy.engine import URL, make_url

#: What a secret is replaced with (SQLAlchemy's own ``hide_password`` mask).
MASK = "***"

_SECRET_NAME = r"(?:\w*(?:password|passwd|secret|token)\w*|pwd)"
_SECRET_KEY = re.compile(rf"^{_SECRET_NAME}$", re.IGNORECASE)

#: ``scheme://user:password@`` anywhere in a text.
_NETLOC = re.compile(r"(\b[a-z][\w+.-]*://[^\s:/@'\"]*:)([^\s@]*)(@)", re.IGNORECASE)
#: ``password=value`` in a query (``?``, ``&``, ``;``) or a libpq conninfo (spaces), with
#: a value plain, single-quoted (conninfo) or double-quoted.
_KEYWORD = re.compile(
    rf"((?:^|[?&;\s'\"(,])\s*{_SECRET_NAME}\s*=\s*)('(?:\\.|[^'\\])*'|\"[^\"]*\"|[^\s&;'\",)]+)",
    re.IGNORECASE,
)


#: Known secret values shorter than this are not searched for in free text (the patterns
#: still mask them wherever they appear as a password or a ``password=`` value).
_SHORTEST_REPLACED = 4


def is_secret_key(name: str) -> bool:
    """Whether a URL query parameter or libpq keyword named ``name`` holds a secret."""
    return bool(_SECRET_KEY.match(name))


def _embedded(value: str) -> bool:
    """Whether a parameter's value is itself a connection string libpq would expand."""
    return "=" in value or "://" in value


def _parse(url: URL | str) -> URL | None:
    """``url`` parsed, or ``None`` if it is no URL (SQLAlchemy raises ``ValueError`` for a
    port that is no number, ``ArgumentError`` for the rest)."""
    if isinstance(url, URL):
        return url
    try:
        return make_url(url)
    except (exc.ArgumentError, ValueError):
        return None


def _secrets(url: URL) -> list[str]:
    """The secret values ``url`` carries, longest first (for replacing in free text)."""
    found: list[str] = []
    if url.password:
        found.append(str(url.password))
    values = [url.database or ""]
    for key, value in url.query.items():
        items = (value,) if isinstance(value, str) else tuple(value)
        if is_secret_key(key):
            found.extend(v for v in items if v)
        else:
            values.extend(items)
    for value in values:
        if not _embedded(value):
            continue
        for match in _KEYWORD.finditer(value):
            found.append(match.group(2).strip("'\""))
        nested = _parse(value)
        if nested is not None:
            found.extend(_secrets(nested))
    return sorted({s for s in found if s}, key=len, reverse=True)


def redact(text: str, *urls: URL | str | None) -> str:
    """``text`` with every secret masked: the values carried by ``urls`` (as given and
    URL-quoted), and anything that reads as a URL password or a ``password=`` keyword.

    This is for text that may quote a URL or a driver's view of it: a parse error, a
    driver's message. An unparseable URL string is masked by the patterns alone.
    """
    for url in urls:
        parsed = None if url is None else _parse(url)
        if parsed is None:
            continue
        for secret in _secrets(parsed):
            if len(secret) < _SHORTEST_REPLACED:
                continue  # masking every "ab" of a message would garble it
            for form in {secret, quote(secret, safe=""), quote_plus(secret), quote(secret)}:
                text = text.replace(form, MASK)
    text = _NETLOC.sub(lambda m: m.group(1) + MASK + m.group(3), text)
    return _KEYWORD.sub(lambda m: m.group(1) + MASK, text)


def _mask_embedded(value: str) -> str:
    if not _embedded(value):
        return value
    if _parse(value) is None:
        return redact(value)  # a libpq conninfo: ``host=db password=...``
    return safe_url(value)


def safe_url(url: URL | str) -> str:
    """The URL as it may be shown in logs, errors and output: every secret masked.

    Everything else (driver, user, host, port, database, non-secret parameters such as
    ``sslmode`` or ``passfile``) stays visible, so two safe URLs are equal when their
    URLs name the same database with the same options.
    """
    parsed = _parse(url)
    if parsed is None:
        return redact(str(url))
    query: dict[str, str | tuple[str, ...]] = {}
    for key, value in parsed.query.items():
        items = (value,) if isinstance(value, str) else tuple(value)
        masked = tuple(MASK if is_secret_key(key) else _mask_embedded(v) for v in items)
        query[key] = masked[0] if isinstance(value, str) else masked
    parsed = parsed.set(
        password=MASK if parsed.password else None,
        database=_mask_embedded(parsed.database) if parsed.database else parsed.database,
        query=query,
    )
    # the mask is percent-encoded in a query: show it as the mask
    rendered = parsed.render_as_string(hide_password=False).replace("%2A%2A%2A", MASK)
    return redact(rendered)
