"""The message Celery built for a task: captured once, stored in the row, sent again.

Every publication of a leased task sends the message Celery's own ``amqp`` layer
produced for it (DESIGN.md, "The row holds the message"): headers, properties and
body, with chains, callbacks, errbacks, chord membership, expiry, time limits, custom
headers and ids inside. So whatever Celery (or a later Celery) puts in a message
survives a re-publish, a recovery and an operator's retry by construction.

How it is captured: Celery's ``Task.apply_async`` runs as usual, routing, options and
all, with a :class:`_Recorder` in place of the producer. The recorder keeps the
arguments of each ``publish`` call instead of sending them, and touches no broker, so
a message can be built (and its row written) while the broker is down. The first
publication then replays those calls on a real producer, exactly as Celery would
have made them; later ones send the stored form (:func:`stored`), with only the
bookkeeping that must change updated: the ETA of a delayed re-publish and the
broker-side expiration, which Celery derives from the absolute ``expires`` header.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from celery import Celery
from celery.app.task import Context
from celery.result import AsyncResult
from kombu import Queue
from kombu.serialization import dumps as kombu_dumps
from kombu.utils.json import JSONEncoder
from kombu.utils.json import dumps as json_dumps
from kombu.utils.json import loads as json_loads

from .._broker import publish_options
from ..exceptions import ConfigurationError

#: Version of the stored form (a key of the JSON object, for later changes).
FORMAT = 1

#: ``Producer.publish`` keywords that are not message properties.
_PUBLISH_ARGS = frozenset(
    {
        "exchange",
        "routing_key",
        "serializer",
        "compression",
        "retry",
        "retry_policy",
        "delivery_mode",
        "declare",
        "headers",
        "timeout",
        "confirm_timeout",
        "content_type",
        "content_encoding",
        "mandatory",
        "immediate",
    }
)


#: The header of a message built for a task whose arguments a later submission replaced
#: (``on_conflict="replace"``): the row's revision, which the claim checks.
REVISION_HEADER = "lease_revision"


def revision_of(request: Any) -> str | None:
    """The revision a delivered message carries: ``request`` is a task's request context
    or a worker request's dict of headers (``None``: the message has none)."""
    if isinstance(request, dict):
        value = request.get(REVISION_HEADER)
    else:
        value = getattr(request, REVISION_HEADER, None)
        if value is None:
            headers = getattr(request, "headers", None)
            value = headers.get(REVISION_HEADER) if isinstance(headers, dict) else None
    return value if isinstance(value, str) else None


class _NoConnection:
    """What ``send_task`` asks of ``producer.connection`` while a message is captured.

    A task published from inside a worker (a chain's next task, a chord's body, a
    ``link`` callback) goes through Celery's callback-retry path, which reads the
    connection's recoverable errors: nothing is sent here, so none can occur."""

    recoverable_connection_errors: tuple[type[BaseException], ...] = ()
    recoverable_channel_errors: tuple[type[BaseException], ...] = ()
    connection_errors: tuple[type[BaseException], ...] = ()
    channel_errors: tuple[type[BaseException], ...] = ()

    @contextlib.contextmanager
    def _reraise_as_library_errors(self) -> Iterator[None]:
        yield


class _Recorder:
    """A stand-in producer: records ``publish`` calls, sends nothing.

    Anything else a result backend asks of the producer (the RPC backend declares its
    reply queue on ``producer.channel``) is answered by a real producer, acquired on
    first use: exactly what plain Celery would need at that point.
    """

    def __init__(self, app: Celery, producer: Any = None) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        self.connection = _NoConnection()
        self._app = app
        self._given = producer
        self._acquired: Any = None
        self._ctx: Any = None

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.calls.append((body, kwargs))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._given is not None:
            return getattr(self._given, name)
        if self._acquired is None:
            self._ctx = self._app.producer_or_acquire(None)
            self._acquired = self._ctx.__enter__()
        return getattr(self._acquired, name)

    def release(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx, self._acquired = self._ctx, None, None
            ctx.__exit__(None, None, None)


@dataclasses.dataclass
class Outgoing:
    """A message built by Celery for one publication of a task."""

    task_id: str
    #: The ``publish`` calls Celery made (the task message first; then, with
    #: ``task_send_sent_event``, the ``task-sent`` event).
    calls: list[tuple[Any, dict[str, Any]]]
    #: What ``apply_async`` returned (an ``AsyncResult``, ``ignored`` set as Celery does).
    result: AsyncResult[Any]
    #: The task message's body as :meth:`stored` serialized it (content type, encoding,
    #: bytes): published as it is, so the body is encoded once and the broker gets the
    #: very bytes the row holds.
    payload: tuple[str, str | None, bytes] | None = None

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.calls[0][1].get("headers") or {})

    def arguments(self) -> tuple[list[Any], dict[str, Any]]:
        """The arguments as Celery put them in the message (after its own conversions:
        a ``pydantic=True`` task's models are dumped to dicts)."""
        args, kwargs, _embed = self.calls[0][0]
        return list(args or ()), dict(kwargs or {})

    def stored(self) -> str:
        """The task message as stored in the row (JSON)."""
        body, kw = self.calls[0]
        content_type = kw.get("content_type")
        content_encoding = kw.get("content_encoding")
        payload: Any = body
        if content_type is None:
            content_type, content_encoding, payload = kombu_dumps(body, kw.get("serializer"))
        if isinstance(payload, str):
            payload = payload.encode(content_encoding or "utf-8")
        if content_type is not None:
            self.payload = (content_type, content_encoding, payload)
        # readable JSON in the row when the body is UTF-8 text; base64 otherwise
        text, b64 = base64.b64encode(payload).decode("ascii"), True
        if (content_encoding or "").lower().replace("-", "") == "utf8":
            with contextlib.suppress(UnicodeDecodeError):
                text, b64 = payload.decode("utf-8"), False
        exchange = kw.get("exchange")
        declare = [q.name for q in kw.get("declare") or () if isinstance(q, Queue)]
        return json_dumps(
            {
                "v": FORMAT,
                "body": text,
                "b64": b64,
                "content_type": content_type,
                "content_encoding": content_encoding,
                "headers": kw.get("headers") or {},
                "properties": {k: v for k, v in kw.items() if k not in _PUBLISH_ARGS},
                "exchange": getattr(exchange, "name", exchange),
                "routing_key": kw.get("routing_key"),
                "delivery_mode": kw.get("delivery_mode"),
                "compression": kw.get("compression"),
                "declare": declare,
            }
        )


class _Shown(JSONEncoder):
    """Celery's JSON encoder (kombu's: datetimes, dates, UUIDs, decimals and bytes as
    typed values it decodes again); a value only another serializer carries (pickle,
    msgpack) is shown by its ``repr``, the message keeps the value itself."""

    def default(self, o: Any) -> Any:
        try:
            return super().default(o)
        except TypeError:
            return {"__repr__": repr(o)}


def arguments_text(args: Any, kwargs: Any, *, exact: bool = False) -> tuple[str, str]:
    """The row's ``args`` and ``kwargs`` columns: compact JSON as Celery's JSON
    serializer writes it (:func:`kombu.utils.json.loads` reads it back).

    Raises:
        TypeError: with ``exact``, a value Celery's JSON serializer cannot encode
            (without it, such a value is shown by its ``repr``).
    """
    cls = JSONEncoder if exact else _Shown
    return (
        json_dumps(list(args or ()), cls=cls, separators=(",", ":")),
        json_dumps(dict(kwargs or {}), cls=cls, separators=(",", ":")),
    )


def build(
    task: Any,
    args: Any,
    kwargs: Any,
    task_id: str,
    link: Any = None,
    link_error: Any = None,
    shadow: str | None = None,
    producer: Any = None,
    **options: Any,
) -> Outgoing:
    """Have Celery build ``task``'s message (``Task.apply_async`` with a recording
    producer) without sending it."""
    from celery import Task

    recorder: Any = _Recorder(task.app, producer)
    try:
        result = Task.apply_async(
            task, args, kwargs, task_id, recorder, link, link_error, shadow, **options
        )
    finally:
        recorder.release()
    if not recorder.calls:
        raise ConfigurationError(f"task {task.name}: Celery built no message for it")
    headers = recorder.calls[0][1].get("headers") or {}
    if "id" not in headers or "task" not in headers:
        raise ConfigurationError(
            "celery-lease needs Celery's task message protocol 2 (the default): "
            "task_protocol = 1 is not supported"
        )
    return Outgoing(task_id, recorder.calls, result)


def send(app: Celery, outgoing: Outgoing, producer: Any = None, *, timeout: float) -> None:
    """Publish a freshly built message: Celery's own ``publish`` calls, replayed, each
    given up after about ``timeout`` seconds without an answer (see :mod:`._broker`)."""
    bounded = publish_options(timeout)
    with app.producer_or_acquire(producer) as P, P.connection._reraise_as_library_errors():
        for index, (body, kw) in enumerate(outgoing.calls):
            if index == 0 and outgoing.payload is not None:
                # serialized once, by stored(): a content type makes kombu send it as is
                content_type, content_encoding, body = outgoing.payload
                kw = {**kw, "content_type": content_type, "content_encoding": content_encoding}
            P.publish(body, **{**kw, **bounded})


def send_stored(
    app: Celery, stored: str, *, countdown: float | None = None, timeout: float, retry: bool = True
) -> None:
    """Publish a stored message again (a re-publish, retry, recovery, operator retry),
    given up after about ``timeout`` seconds without an answer (see :mod:`._broker`;
    ``retry=False``: after one try).

    ``countdown``: seconds from now until it is due (its ETA header is set); the
    broker-side expiration is recomputed from the absolute ``expires`` header.
    """
    msg = json_loads(stored)
    headers = dict(msg["headers"])
    properties = dict(msg["properties"])
    now = app.now()
    if countdown is not None and countdown > 0:
        headers["eta"] = (now + timedelta(seconds=countdown)).isoformat()
    expires = headers.get("expires")
    if expires and "expiration" in properties:
        left = (_aware(app, datetime.fromisoformat(expires)) - now).total_seconds()
        properties["expiration"] = max(0.0, left)
    body = _body(msg)
    queues = app.amqp.queues
    declare = [queues[name] for name in msg["declare"] if name in queues]
    with app.producer_or_acquire(None) as P, P.connection._reraise_as_library_errors():
        P.publish(
            body,
            exchange=msg["exchange"] or "",
            routing_key=msg["routing_key"],
            content_type=msg["content_type"],
            content_encoding=msg["content_encoding"],
            compression=msg["compression"],
            delivery_mode=msg["delivery_mode"],
            headers=headers,
            declare=declare,
            **publish_options(timeout, retry=retry),
            **properties,
        )


def _body(msg: dict[str, Any]) -> bytes:
    if msg["b64"]:
        return base64.b64decode(msg["body"])
    return str(msg["body"]).encode("utf-8")


def _aware(app: Celery, value: datetime) -> datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=app.timezone)
    return value


def decode(app: Celery, stored: str) -> tuple[dict[str, Any], tuple[Any, Any, dict[str, Any]]]:
    """The headers and the (args, kwargs, embed) body of a stored message."""
    from kombu.serialization import loads

    msg = json_loads(stored)
    raw = _body(msg)
    accept = {msg["content_type"]}
    body = loads(raw, msg["content_type"], msg["content_encoding"], accept=accept)
    args, kwargs, embed = body
    return dict(msg["headers"]), (args, kwargs, embed or {})


def request_context(app: Celery, stored: str) -> Context:
    """A request ``Context`` for the stored message, as the worker would build it: what
    the result backend needs to call errbacks and count a chord's parts."""
    headers, (args, kwargs, embed) = decode(app, stored)
    return Context(
        {
            **headers,
            "args": args,
            "kwargs": kwargs,
            "callbacks": embed.get("callbacks"),
            "errbacks": embed.get("errbacks"),
            "chain": embed.get("chain"),
            "chord": embed.get("chord"),
            "delivery_info": {},
            "children": [],
        }
    )
