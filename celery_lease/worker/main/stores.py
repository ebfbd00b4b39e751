"""Which store each live worker uses, so that ``celery lease check`` sees a producer and
a worker that disagree.

A worker that uses another database than its producers (the default SQLite file of
another directory, another schema or table prefix) runs every task, but none of them
is the row the producer wrote: tasks are adopted as new rows, dedup keys and retries
are not shared, operators look at the wrong store. Nothing fails; the check has to ask.

The store's own workers table cannot tell: a worker on another store is not in it.
So the check asks every worker on the broker, through a remote-control command
(:data:`COMMAND`) that the worker answers from its main process with its incarnation
id and its store's URL (secrets masked), and looks the incarnation up in its own
store. An incarnation this store has never seen uses another store, whatever the URLs
look like (two spellings of one database agree, the same spelling in two directories
does not).
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.control import inspect_command

from ..._runtime import runtime

logger = logging.getLogger("celery_lease")

#: The remote-control command every celery-lease worker answers.
COMMAND = "lease_store"


@inspect_command(name=COMMAND)
def lease_store(state: Any, **kwargs: Any) -> dict[str, Any]:
    """Remote control: this worker's incarnation id and store (URL with secrets masked)."""
    app = state.consumer.app
    rt = runtime(app)
    inc = rt.incarnation
    if inc is None:
        return {"incarnation": None, "store": None}
    return {
        "incarnation": inc.id,
        "store": rt.store.url,
        "host": inc.hostname,
        "pid": inc.pid,
        "tasks": leased_tasks(app),
    }


def leased_tasks(app: Any) -> list[str]:
    """Names of ``app``'s leased tasks (what tells this app's workers from others')."""
    app.tasks  # noqa: B018  (finalizes the app: every task binds, and leased ones record themselves)
    return sorted(runtime(app).leased)


def worker_stores(app: Any, timeout: float) -> dict[str, dict[str, Any]]:
    """``{nodename: answer}`` of every celery-lease worker that answered within ``timeout``.

    Raises:
        OSError, kombu.exceptions.OperationalError: the broker cannot be reached.
    """
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
        replies = app.control.broadcast(COMMAND, reply=True, timeout=timeout, connection=conn)
    out: dict[str, dict[str, Any]] = {}
    for reply in replies or ():
        for nodename, answer in reply.items():
            # workers without celery-lease answer with an error: not ours to judge
            if isinstance(answer, dict) and answer.get("incarnation"):
                out[nodename] = answer
    return out


def on_other_stores(
    answers: dict[str, dict[str, Any]], known: set[str], tasks: list[str]
) -> list[tuple[str, dict[str, Any]]]:
    """The workers whose incarnation is not among ``known`` (this store's incarnations).

    With ``tasks`` (this app's leased task names), only workers that run one of them
    count: another application sharing the broker may rightly use another store.
    """
    wanted = set(tasks)
    return [
        (node, a)
        for node, a in sorted(answers.items())
        if a["incarnation"] not in known and (not wanted or wanted & set(a.get("tasks") or ()))
    ]
