"""Group commit: single submissions made at the same moment by threads of one process
share one statement and one commit.

A web server submits from many threads. Each ``apply_async`` must wait for its row's
commit before it publishes (the row is the outbox), so with one statement per call
every thread pays a round trip, a commit, and a pooled connection of its own (more
threads than the pool holds open and close connections). Instead, one submission at a
time writes (the *leader*); the submissions that arrive while it writes wait, and when
it is done the first of them leads the next write with all of them: the rows in one
multi-row statement and one commit (:meth:`Submission.submit_many`), each caller
woken with its own answer (or the write's exception; a value the database refuses
fails the shared statement, and then each row is written alone, so only its own caller
gets that error). A submission that finds no write
under way writes alone at once, in the single-row statement: one thread submitting
sends exactly one insert and one commit per call, as before.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Sequence

from ..exceptions import StoreDataError
from ._types import NewTask

Answer = tuple[str, bool]


@dataclasses.dataclass(eq=False)
class _Waiting:
    """One caller's submission in a group."""

    new: NewTask
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: Set by the leader that hands over: this caller writes the next group.
    lead: bool = False
    answer: Answer | None = None
    error: BaseException | None = None

    def result(self) -> Answer:
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer


class GroupCommit:
    """Single submissions of one store, written alone or in groups (see the module)."""

    def __init__(
        self,
        one: Callable[[NewTask], Answer],
        many: Callable[[Sequence[NewTask]], list[Answer]],
    ) -> None:
        # weakly: the store holds this, and must be freed with its app (no cycle)
        self._one = weakref.WeakMethod(one)
        self._many = weakref.WeakMethod(many)
        self._reset()
        ref = weakref.ref(self)

        def after_fork() -> None:
            group = ref()
            if group is not None:
                group._reset()  # a write under way belongs to the parent

        os.register_at_fork(after_in_child=after_fork)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[_Waiting] = []
        self._busy = False
        #: Set while this thread writes a group (or a submission alone).
        self._writing = threading.local()

    def submit(self, new: NewTask) -> Answer:
        """Write ``new`` (alone, or with the submissions waiting when its turn comes);
        its (task id, created), or the exception its write raised."""
        if getattr(self._writing, "active", False):
            # submitted from inside this thread's own write (a transition listener):
            # waiting for that write would wait for ourselves
            one = self._one()
            if one is None:
                raise RuntimeError("celery-lease: the store of this submission was closed")
            return one(new)
        me = _Waiting(new)
        with self._lock:
            if self._busy:
                self._queue.append(me)
            else:
                self._busy = True
                me.lead = True
        if not me.lead:
            # the leader under way always wakes every caller of its group, and hands
            # over to the first one waiting after it; it is bounded by lease_db_timeout
            me.done.wait()
            if not me.lead:
                return me.result()
            with self._lock:
                group, self._queue = self._queue, []  # this caller is the first of them
        else:
            group = [me]
        try:
            self._write(group)
        finally:
            with self._lock:
                if self._queue:
                    after = self._queue[0]
                    after.lead = True
                    after.done.set()
                else:
                    self._busy = False
        return me.result()

    def _write(self, group: list[_Waiting]) -> None:
        self._writing.active = True
        try:
            one, many = self._one(), self._many()
            if one is None or many is None:
                raise RuntimeError("celery-lease: the store of this submission was closed")
            if len(group) == 1:
                group[0].answer = one(group[0].new)
                return
            try:
                answers = many([w.new for w in group])
            except StoreDataError:
                # a value the database refuses fails the whole statement, which wrote
                # nothing: each is written alone, so only its own caller gets the error
                for waiting in group:
                    try:
                        waiting.answer = one(waiting.new)
                    except Exception as error:
                        waiting.error = error
                return
            for waiting, answer in zip(group, answers, strict=True):
                waiting.answer = answer
        except BaseException as error:
            for waiting in group:
                waiting.error = error  # raised to each caller by result()
        finally:
            self._writing.active = False
            for waiting in group:
                if not waiting.lead:
                    waiting.done.set()
