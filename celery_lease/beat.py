"""Beat with slots: any number of ``celery beat`` processes, each periodic send once.

``beat_scheduler = "celery_lease.beat:LeaseScheduler"`` (Celery's
``PersistentScheduler`` underneath), or :func:`leased` on another scheduler class
(django-celery-beat's ``DatabaseScheduler``). Entries of plain tasks are sent as the
scheduler underneath sends them; for an entry whose task is leased:

* each send is a **slot**, the entry's name and its scheduled time. The slots are the
  same on every beat: crontab and solar entries by their scheduled times, interval
  entries at whole multiples of the interval since the Unix epoch (never a process's
  start time);
* a beat decides an entry's due slots in one transaction that locks the entry's row
  (:meth:`~celery_lease.store.Store.schedule_slots`): the tasks of the slots that run
  are written in it, each with the slot's dedup key, and published once it commits. A
  second beat finds the slots decided: a slot runs once whatever the number of beats.
  A beat that dies after the commit leaves PENDING rows that the reaper publishes;
* the latest due slot, if at most :data:`ON_TIME` seconds old when a beat decides it,
  is on time; the other due slots passed with no beat to send them (all down, the
  database unreachable, the beat held up) and follow the entry's catch-up policy
  (``lease_catchup``, see :func:`plan`); slots whose previous run has not finished
  follow its overlap policy (``lease_overlap``); every missed or skipped slot is
  counted in the entry's row (``celery -A proj lease schedules``, the metrics).

Every decision compares slots with the database's time. The beat's wake-ups are timed
from the database's time at its last store call plus the monotonic clock since, never
from the host's wall clock: a clock step on the beat's host neither sends a slot early
nor sleeps through one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from celery import beat as _beat
from celery.schedules import crontab, schedstate
from celery.schedules import schedule as interval

from ._crashpoints import crash_point
from ._runtime import runtime
from .config import CATCHUP_POLICIES, MAX_SECONDS, OVERLAP_POLICIES, LeaseConfig, check_seconds
from .exceptions import ConfigurationError
from .states import State
from .store import BeatRow, SlotDecision, Store, join_transaction
from .task import LeasedTask

logger = logging.getLogger("celery_lease.beat")

#: The per-entry options (in the entry's ``options``), and the settings they default to.
OPTIONS = {
    "lease_catchup": "catchup",
    "lease_catchup_window": "catchup_window",
    "lease_catchup_max": "catchup_max",
    "lease_overlap": "overlap",
}

#: A due slot at most this many seconds older than the database's time, and the latest
#: due one, is on time (a beat was there to send it); older ones were missed.
ON_TIME = 10.0

#: The reaper's own entry: a plain task, sent once per slot (see :meth:`_LeaseSlots._send`).
REAP_TASK = "celery_lease.reap"

#: States in which a run is not finished (overlap: it may still run).
UNFINISHED = frozenset({State.PENDING, State.RUNNING, State.RETRY_WAIT, State.TIMEOUT})

#: After a failed decision (the database unreachable), the entry is tried again this
#: many seconds later; while a slot is buffered, the beat looks this often.
RETRY_AFTER = 1.0
#: How often a beat records itself as seen (seconds).
SEEN_EVERY = 10.0
#: Beats seen within this many seconds are "recent" (``lease schedules``).
RECENT_BEATS = 300.0
#: Most slots counted in one decision (an entry every second missed for a day is 86400).
SCAN_LIMIT = 1_000_000

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_US = timedelta(microseconds=1)

S = TypeVar("S", bound=type[_beat.Scheduler])


@dataclasses.dataclass(frozen=True)
class SlotPolicy:
    """An entry's catch-up and overlap policies (its options over the app's settings)."""

    catchup: str
    window: float
    max: int
    overlap: str

    @classmethod
    def of(cls, name: str, options: Mapping[str, Any] | None, config: LeaseConfig) -> SlotPolicy:
        """The entry's policy, checked.

        Raises:
            ConfigurationError: an unknown policy, a negative or non-numeric window, a
                ``lease_catchup_max`` below 1 (naming the entry).
        """
        given = lease_options(name, options)
        values = {field: given.get(key, getattr(config, field)) for key, field in OPTIONS.items()}
        if values["catchup"] not in CATCHUP_POLICIES:
            raise ConfigurationError(
                f"beat entry {name!r}: lease_catchup must be one of {CATCHUP_POLICIES}, "
                f"got {values['catchup']!r}"
            )
        if values["overlap"] not in OVERLAP_POLICIES:
            raise ConfigurationError(
                f"beat entry {name!r}: lease_overlap must be one of {OVERLAP_POLICIES}, "
                f"got {values['overlap']!r}"
            )
        window = check_seconds(
            f"beat entry {name!r}: lease_catchup_window", values["catchup_window"], zero=True
        )
        most = values["catchup_max"]
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise ConfigurationError(
                f"beat entry {name!r}: lease_catchup_max must be a whole number of at least "
                f"1, got {most!r}"
            )
        return cls(values["catchup"], window, most, values["overlap"])


def lease_options(name: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The per-entry options (:data:`OPTIONS`) of entry ``name``: from its ``options``,
    else from ``options["headers"]`` (django-celery-beat's ``PeriodicTask`` has no field
    for options of one's own, but its ``headers`` JSON reaches the entry's options).

    Raises:
        ConfigurationError: a ``lease_`` key that is none of :data:`OPTIONS` (a typo
            would otherwise leave the entry on the defaults unnoticed), naming the entry.
    """
    options = options or {}
    headers = options.get("headers")
    found: dict[str, Any] = {}
    for where, source in (("headers", headers), ("options", options)):
        if not isinstance(source, Mapping):
            continue
        for key, value in source.items():
            if not (isinstance(key, str) and key.startswith("lease_")):
                continue
            if key not in OPTIONS:
                raise ConfigurationError(
                    f"beat entry {name!r}: unknown option {key!r} in its {where} "
                    f"(the per-entry options are {', '.join(OPTIONS)})"
                )
            found[key] = value  # the options' own win over the headers'
    return found


class Slots:
    """The scheduled times of one entry's schedule, in UTC, the same on every beat."""

    def __init__(self, name: str, schedule: Any) -> None:
        self.name = name
        self.schedule = schedule
        #: Interval entries: the interval in microseconds (slots at its multiples).
        self.period: int | None = None
        if type(schedule) is interval or (
            isinstance(schedule, interval) and not isinstance(schedule, crontab)
        ):
            run_every: timedelta | None = getattr(schedule, "run_every", None)
            period = round(run_every.total_seconds() * 1e6) if run_every is not None else 0
            if not 0 < period <= MAX_SECONDS * 1e6:
                raise ConfigurationError(
                    f"beat entry {name!r}: the interval must be more than 0 and at most "
                    f"{MAX_SECONDS:g} s, got {run_every!r}"
                )
            self.period = period

    def after(self, t: datetime) -> datetime:
        """The first scheduled time strictly after ``t``.

        Raises:
            ConfigurationError: the schedule cannot compute it (naming the entry).
        """
        if self.period is not None:
            k = (t - _EPOCH) // _US // self.period + 1
            return _EPOCH + k * self.period * _US
        try:
            following = self._after(t)
        except Exception as error:
            raise ConfigurationError(
                f"beat entry {self.name!r}: its schedule {self.schedule!r} cannot compute "
                f"its next time ({type(error).__name__}: {error})"
            ) from error
        if not isinstance(following, datetime) or following.tzinfo is None or following <= t:
            raise ConfigurationError(
                f"beat entry {self.name!r}: its schedule {self.schedule!r} gave {following!r} "
                f"as its next time after {t.isoformat()}"
            )
        return following.astimezone(timezone.utc)

    def _after(self, t: datetime) -> datetime:
        sched = self.schedule
        if isinstance(sched, crontab):
            zone: Any = sched.tz
            last, delta, _ = sched.remaining_delta(t.astimezone(zone))
            following: datetime = last + delta
            return following
        # any other schedule (solar, a custom class): its estimate with "now" set to t
        clone = object.__new__(type(sched))
        clone.__dict__.update(sched.__dict__)
        clone.nowfun = lambda: t
        estimate: timedelta = clone.remaining_estimate(t)
        return t + estimate

    def between(self, lo: datetime, hi: datetime, keep: int) -> tuple[list[datetime], int]:
        """The slots in ``(lo, hi]``: the latest ``keep`` of them, oldest first, and how
        many there are (counted up to :data:`SCAN_LIMIT`)."""
        if hi <= lo:
            return [], 0
        if self.period is not None:
            first = (lo - _EPOCH) // _US // self.period + 1
            last = (hi - _EPOCH) // _US // self.period
            count = max(0, last - first + 1)
            ks = range(max(first, last - keep + 1), last + 1)
            return [_EPOCH + k * self.period * _US for k in ks], count
        found: list[datetime] = []
        count = 0
        s = self.after(lo)
        while s <= hi and count < SCAN_LIMIT:
            count += 1
            found.append(s)
            if len(found) > keep:
                del found[0]
            s = self.after(s)
        return found, count


def _fingerprint(entry: Any) -> tuple[str, str, str]:
    """What an entry's slot state is made from: its task, schedule and options."""
    return (str(entry.task), repr(entry.schedule), repr(entry.options))


def slot_key(name: str, slot: datetime) -> str:
    """The dedup key of entry ``name``'s slot at ``slot``: the same on every beat."""
    key = f"beat:{name}@{slot.astimezone(timezone.utc).isoformat()}"
    if len(key) > 200:
        digest = hashlib.sha256(name.encode()).hexdigest()[:32]
        key = f"beat:{digest}@{slot.astimezone(timezone.utc).isoformat()}"
    return key


@dataclasses.dataclass
class Plan:
    """The due slots of one decision, sorted into those to run and those missed."""

    run: list[datetime]
    missed: int
    #: The latest due slot: every slot up to it is decided.
    last: datetime | None


def plan(slots: Sequence[datetime], count: int, now: datetime, policy: SlotPolicy) -> Plan:
    """Which of the due ``slots`` (the latest ones, oldest first, of ``count``) run.

    The latest due slot is on time when at most :data:`ON_TIME` seconds older than
    ``now`` (the database's time) and always runs; the others were missed while no beat
    ran: ``skip`` runs none of them, ``latest`` the most recent, ``all`` the most recent
    ``lease_catchup_max`` (oldest first); none older than ``lease_catchup_window``.
    """
    if not slots:
        return Plan([], 0, None)
    latest = slots[-1]
    on_time = (now - latest).total_seconds() <= ON_TIME
    late = list(slots[:-1]) if on_time else list(slots)
    recent = [s for s in late if (now - s).total_seconds() <= policy.window]
    if policy.catchup == "skip":
        caught: list[datetime] = []
    elif policy.catchup == "latest":
        caught = recent[-1:]
    else:
        caught = recent[-policy.max :]
    missed = count - (1 if on_time else 0) - len(caught)
    return Plan([*caught, latest] if on_time else caught, missed, latest)


@dataclasses.dataclass
class _EntryState:
    """What a beat keeps in memory of one slotted entry (the store holds the truth)."""

    slots: Slots
    policy: SlotPolicy
    #: What the state was made from (:func:`_fingerprint`): an entry changed in a
    #: database-backed schedule is checked again.
    fingerprint: tuple[str, str, str] = ("", "", "")
    #: The next slot after those decided (UTC), or ``None``: decide at once.
    next_slot: datetime | None = None
    #: Not before this time (UTC, database clock): after a failure, or while buffering.
    retry_at: datetime | None = None
    buffering: bool = False


class _LeaseSlots:
    """The slot behaviour, mixed in before a Celery scheduler class (see :func:`leased`)."""

    app: Any
    schedule: Any
    adjust: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lease_entries: dict[str, _EntryState] = {}
        #: Slotted entries found bad after the start: name -> their fingerprint.
        self._lease_rejected: dict[str, tuple[str, str, str]] = {}
        #: The database's time at the last store call, and the monotonic clock then.
        self._lease_clock: tuple[datetime, float] | None = None
        self._lease_seen_at = 0.0
        self._lease_id = uuid.uuid4().hex
        self._lease_actor = f"beat:{socket.gethostname()}:{os.getpid()}"
        #: :meth:`close` ran: the beat is stopping.
        self._lease_closed = False
        super().__init__(*args, **kwargs)

    # -- set-up ----------------------------------------------------------------------

    @property
    def _lease_store(self) -> Store:
        return runtime(self.app).store

    def setup_schedule(self) -> None:
        # the app's tasks bound first: the first leased one adds the reaper's entry to
        # beat_schedule, which the scheduler underneath then reads
        self.app.tasks  # noqa: B018
        super().setup_schedule()  # type: ignore[misc]
        self._lease_setup(self.schedule)

    def _slotted(self, entry: Any) -> bool:
        """Whether ``entry`` is sent in slots: its task is leased, or it is the reaper's."""
        if entry.task == REAP_TASK:
            return True
        return isinstance(self.app.tasks.get(entry.task), LeasedTask)

    def _lease_setup(self, schedule: Mapping[str, Any]) -> None:
        """Check every slotted entry, then register them: nothing is written unless all
        are valid.

        Raises:
            ConfigurationError: an entry's policy or schedule is wrong (naming it).
        """
        config = runtime(self.app).config
        now = datetime.now(timezone.utc)
        checked: dict[str, _EntryState] = {}
        for name, entry in schedule.items():
            if self._slotted(entry):
                checked[name] = self._check(name, entry, config, now)
        if not checked:
            return
        store = self._lease_store
        store.ensure_schema()
        self._see(force=True)
        store.register_schedules({name: schedule[name].task for name in checked})
        self._lease_entries.update(checked)
        logger.info(
            "beat %s: %d leased entr%s sent in slots: %s",
            self._lease_actor,
            len(checked),
            "y" if len(checked) == 1 else "ies",
            ", ".join(sorted(checked)),
        )

    @staticmethod
    def _check(name: str, entry: Any, config: LeaseConfig, now: datetime) -> _EntryState:
        policy = SlotPolicy.of(name, entry.options, config)
        slots = Slots(name, entry.schedule)
        slots.after(now)  # a schedule that cannot compute its next time fails here
        return _EntryState(slots, policy, _fingerprint(entry))

    def _state(self, entry: Any) -> _EntryState | None:
        """The entry's slot state, or ``None``: not slotted, or rejected (then in
        ``_lease_rejected``). An entry that appeared or changed since the start (a
        database-backed schedule) is checked and registered now; a bad one is rejected,
        with its error logged, until it changes again."""
        name = entry.name
        fingerprint = _fingerprint(entry)
        state = self._lease_entries.get(name)
        if state is not None and state.fingerprint == fingerprint:
            return state
        if self._lease_rejected.get(name) == fingerprint:
            return None
        self._lease_entries.pop(name, None)
        self._lease_rejected.pop(name, None)
        if not self._slotted(entry):
            return None
        try:
            self._lease_setup({name: entry})
        except Exception:
            logger.exception("beat entry %r: not sent until it changes (see the error)", name)
            self._lease_rejected[name] = fingerprint
            return None
        return self._lease_entries.get(name)

    # -- time ------------------------------------------------------------------------

    def _db_now(self) -> datetime:
        """The database's time, as measured at the last store call and moved on by the
        monotonic clock since (only to decide when to wake up). The process's wall clock
        plays no part once a store call has answered: a step of the host's clock, back
        or forward, neither delays a slot nor brings one forward."""
        if self._lease_clock is None:
            return datetime.now(timezone.utc)
        db_time, at = self._lease_clock
        return db_time + timedelta(seconds=time.monotonic() - at)

    def _measured(self, db_time: datetime) -> None:
        self._lease_clock = (db_time, time.monotonic())

    def _when(self, entry: Any, next_time_to_run: float, mktime: Any = None) -> float:
        """The time of ``entry``'s next wake-up on Celery's heap: the estimated database
        time plus the delay (Celery's own uses the wall clock, which a clock step moves
        under the heap: a step back would sleep through the slots it stepped over)."""
        delay = self.adjust(next_time_to_run) or 0
        return self._db_now().timestamp() + delay

    def _see(self, *, force: bool = False) -> None:
        if not force and time.monotonic() - self._lease_seen_at < SEEN_EVERY:
            return
        self._lease_seen_at = time.monotonic()
        db_time = self._lease_store.beat_seen(self._lease_id, socket.gethostname(), os.getpid())
        self._measured(db_time)

    def close(self) -> None:
        # Celery's SIGTERM/SIGINT handler closes the scheduler (its schedule file, its
        # connections) from inside whatever the beat was doing, then raises SystemExit;
        # a publish it interrupts may turn that into another error on the way out
        self._lease_closed = True
        super().close()  # type: ignore[misc]

    def _stopping(self) -> None:
        """Raise ``SystemExit`` once the beat is stopping: Celery's loop ends on it, and
        saves nothing more (a slot whose row was written and not sent is the reaper's,
        as after a crash)."""
        if self._lease_closed:
            raise SystemExit()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        self._stopping()
        if self._lease_entries:
            try:
                self._see()
            except Exception as error:
                logger.warning("beat %s: not recorded as seen (%s)", self._lease_actor, error)
        result: float = super().tick(*args, **kwargs)  # type: ignore[misc]
        return result

    # -- Celery's hooks --------------------------------------------------------------

    def is_due(self, entry: Any) -> schedstate:
        state = self._state(entry)
        if state is None:
            if entry.name in self._lease_rejected:  # a bad entry: never sent unslotted
                return schedstate(False, RETRY_AFTER * 5)
            result: schedstate = super().is_due(entry)  # type: ignore[misc]
            return result
        now = self._db_now()
        wake = state.next_slot
        if state.retry_at is not None:
            wake = state.retry_at if wake is None else max(wake, state.retry_at)
        if wake is None or now >= wake:
            following = state.slots.after(now)
            delay = (following - now).total_seconds()
            if state.buffering:
                delay = min(delay, RETRY_AFTER)
            return schedstate(True, max(delay, 0.0))
        return schedstate(False, (wake - now).total_seconds())

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        state = self._state(entry)
        if state is None:
            if entry.name not in self._lease_rejected:
                super().apply_entry(entry, producer=producer)  # type: ignore[misc]
                self._stopping()  # Celery's own logs an error it met and goes on
            return
        try:
            self._decide(entry, state, producer)
        except Exception:
            self._stopping()
            state.retry_at = self._db_now() + timedelta(seconds=RETRY_AFTER)
            logger.exception(
                "beat entry %r: its slots could not be decided; tried again in %g s",
                entry.name,
                RETRY_AFTER,
            )

    # -- deciding --------------------------------------------------------------------

    def _decide(self, entry: Any, state: _EntryState, producer: Any) -> None:
        """Decide the entry's due slots in one transaction, with its row locked."""
        store = self._lease_store
        policy = state.policy
        plain: list[datetime] = []
        with store.schedule_slots(entry.name) as (conn, row, now):
            self._measured(now)
            keep = (policy.max if policy.catchup == "all" else 1) + 1
            slots, count = state.slots.between(row.last_slot, now, keep)
            planned = plan(slots, count, now, policy)
            reasons: list[str] = []
            if planned.missed and planned.last is not None:
                reasons.append(
                    f"{planned.missed} slot(s) up to {planned.last.isoformat()} missed "
                    f"(not sent in time: no beat, or no database), lease_catchup={policy.catchup!r}"
                )
            decision = SlotDecision(
                last_slot=planned.last or row.last_slot,
                last_run_slot=row.last_run_slot,
                last_task_id=row.last_task_id,
                buffered_slot=row.buffered_slot,
                missed=planned.missed,
            )
            if entry.task == REAP_TASK:
                # a plain task: sent after the commit, once per slot (a beat that dies in
                # between loses that sweep; the next slot sweeps again)
                plain = planned.run
                if plain:
                    decision.last_run_slot = plain[-1]
            else:
                self._run_slots(entry, conn, planned.run, decision, policy, reasons, producer)
            decision.reason = "; ".join(reasons) or None
            if (
                planned.last is not None
                or decision.last_task_id != row.last_task_id
                or decision.buffered_slot != row.buffered_slot
            ):
                store.advance_schedule(conn, entry.name, decision, self._lease_actor)
        state.buffering = decision.buffered_slot is not None
        state.retry_at = None
        state.next_slot = state.slots.after(max(now, decision.last_slot))
        for _ in plain:
            self._send_plain(entry, producer)
        if decision.missed or decision.skipped:
            logger.warning("beat entry %r: %s", entry.name, decision.reason)

    def _send_plain(self, entry: Any, producer: Any) -> None:
        """Send the reaper's entry as the scheduler underneath does, with a relative
        ``expires`` counted from the database's time: Celery counts it from this host's
        wall clock, so a beat whose clock is behind would send messages that workers
        find expired on arrival, and the sweeps through beat would stop."""
        options = entry.options or {}
        expires = options.get("expires")
        if isinstance(expires, (int, float)) and not isinstance(expires, bool):
            entry.options = {**options, "expires": self._db_now() + timedelta(seconds=expires)}
            try:
                super().apply_entry(entry, producer=producer)  # type: ignore[misc]
            finally:
                entry.options = options
            return
        super().apply_entry(entry, producer=producer)  # type: ignore[misc]

    def _run_slots(
        self,
        entry: Any,
        conn: Any,
        run: Sequence[datetime],
        decision: SlotDecision,
        policy: SlotPolicy,
        reasons: list[str],
        producer: Any,
    ) -> None:
        """Submit the slots that run, in ``conn``'s transaction, by the overlap policy."""
        store = self._lease_store
        row_run_slot = decision.last_run_slot

        def unfinished() -> State | None:
            if decision.last_task_id is None:
                return None
            st = store.task_state(conn, decision.last_task_id)
            return st if st in UNFINISHED else None

        def submit(slot: datetime) -> None:
            if decision.last_run_slot == row_run_slot:
                # registered before the first row, so it runs before the publishes of the
                # slots' rows: the crash suite's beat dies with them committed, not sent
                join_transaction(store, conn).after_commit(lambda: crash_point("beat_slot_rows"))
            decision.last_task_id = self._submit(entry, conn, slot, producer)
            decision.last_run_slot = slot

        buffered = decision.buffered_slot
        if buffered is not None and unfinished() is None:
            decision.buffered_slot = None
            submit(buffered)
        for slot in run:
            running = None if policy.overlap == "allow" else unfinished()
            if running is None:
                submit(slot)
            elif policy.overlap == "buffer_one" and decision.buffered_slot is None:
                decision.buffered_slot = slot
            else:
                decision.skipped += 1
                why = "buffer full" if policy.overlap == "buffer_one" else "lease_overlap='skip'"
                reasons.append(
                    f"slot {slot.isoformat()} skipped: previous run {decision.last_task_id} "
                    f"is {running.value} ({why})"
                )

    def _submit(self, entry: Any, conn: Any, slot: datetime, producer: Any) -> str:
        """Write the slot's task in ``conn``'s transaction (published after its commit)."""
        task = self.app.tasks[entry.task]
        options = {k: v for k, v in (entry.options or {}).items() if k not in OPTIONS}
        headers = {
            k: v for k, v in dict(options.pop("headers", None) or {}).items() if k not in OPTIONS
        }
        headers["celery_beat_task"] = True
        args = [a() if isinstance(a, _beat.BeatLazyFunc) else a for a in entry.args or ()]
        kwargs = {
            k: v() if isinstance(v, _beat.BeatLazyFunc) else v
            for k, v in (entry.kwargs or {}).items()
        }
        result = task.apply_async(
            args,
            kwargs,
            producer=producer,
            dedup_key=slot_key(entry.name, slot),
            connection=conn,
            headers=headers,
            **options,
        )
        return str(result.id)


@dataclasses.dataclass(frozen=True)
class EntryReport:
    """One slotted entry as ``lease schedules`` shows it."""

    name: str
    task: str
    #: The last slot run (its task submitted) and that task's id and state.
    last_run_slot: datetime | None
    last_task_id: str | None
    last_task_state: str | None
    #: The next slot, from the app's own schedule (``None``: the entry is not in the
    #: app's ``beat_schedule``, e.g. a database-backed one).
    next_slot: datetime | None
    buffered_slot: datetime | None
    missed: int
    skipped: int
    last_reason: str | None
    updated_at: datetime
    updated_by: str | None


def report(app: Any) -> tuple[datetime, list[EntryReport], list[BeatRow]]:
    """The database's time, every slotted entry, and the beats seen in the last
    :data:`RECENT_BEATS` seconds (``celery -A proj lease schedules``)."""
    store = runtime(app).store
    now = store.now()
    configured = app.conf.beat_schedule or {}
    out: list[EntryReport] = []
    for row in store.schedules():
        next_slot = None
        conf = configured.get(row.name)
        if conf is not None:
            try:
                sched = _beat.ScheduleEntry(name=row.name, app=app, **conf).schedule
                next_slot = Slots(row.name, sched).after(max(now, row.last_slot))
            except Exception:  # shown as unknown; the beat names the error at its start
                next_slot = None
        record = store.get(row.last_task_id) if row.last_task_id else None
        out.append(
            EntryReport(
                name=row.name,
                task=row.task,
                last_run_slot=row.last_run_slot,
                last_task_id=row.last_task_id,
                last_task_state=record.state.value if record is not None else None,
                next_slot=next_slot,
                buffered_slot=row.buffered_slot,
                missed=row.missed,
                skipped=row.skipped,
                last_reason=row.last_reason,
                updated_at=row.updated_at,
                updated_by=row.updated_by,
            )
        )
    return now, out, store.beats(RECENT_BEATS)


class LeaseScheduler(_LeaseSlots, _beat.PersistentScheduler):
    """Celery's ``PersistentScheduler`` with leased entries sent in slots, once each
    whatever the number of beats (``beat_scheduler = "celery_lease.beat:LeaseScheduler"``)."""


def leased(scheduler: S) -> S:
    """``scheduler`` (a Celery scheduler class, such as django-celery-beat's
    ``DatabaseScheduler``) with leased entries sent in slots, as :class:`LeaseScheduler`.

    Use the returned class as the beat's scheduler, from a module of yours::

        from django_celery_beat.schedulers import DatabaseScheduler
        from celery_lease.beat import leased

        LeasedDatabaseScheduler = leased(DatabaseScheduler)

    and ``celery -A proj beat -S proj.beat:LeasedDatabaseScheduler``.
    """
    if not (isinstance(scheduler, type) and issubclass(scheduler, _beat.Scheduler)):
        raise ConfigurationError(
            f"leased() takes a celery.beat.Scheduler subclass, got {scheduler!r}"
        )
    if issubclass(scheduler, _LeaseSlots):
        return scheduler
    made: Callable[..., Any] = type(
        f"Leased{scheduler.__name__}",
        (_LeaseSlots, scheduler),
        {"__module__": __name__, "__doc__": LeaseScheduler.__doc__},
    )
    return made  # type: ignore[return-value]


__all__ = [
    "EntryReport",
    "LeaseScheduler",
    "SlotPolicy",
    "Slots",
    "lease_options",
    "leased",
    "plan",
    "report",
    "slot_key",
]
