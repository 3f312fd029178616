"""Bad input: every call fails with the documented exception BEFORE any SQL is sent, and
nothing changes (statements sent, the backend's activity, pg_locks, transaction status)."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from _pgdb import sa_url
from _wire import RecordingConnection

import pglock
from pglock import _conn
from pglock._keys import MAX_TIMEOUT

NAME = "test:bad-input"


def enter(conn: object, names: object = NAME, **kwargs: Any) -> None:
    with pglock.pg_lock(conn, names, **kwargs):  # type: ignore[arg-type]
        pytest.fail("the body ran")


def acquire(conn: object, **kwargs: Any) -> None:
    pglock.pg_lock(conn, NAME).acquire(**kwargs)


def xact(conn: object, names: object = NAME, **kwargs: Any) -> None:
    pglock.xact_lock(conn, names, **kwargs)  # type: ignore[arg-type]


def try_xact(conn: object, names: object = NAME, **kwargs: Any) -> None:
    pglock.try_xact_lock(conn, names, **kwargs)  # type: ignore[arg-type]


@dataclass
class Case:
    id: str
    call: Callable[[object], object]
    exc: type[BaseException] | tuple[type[BaseException], ...]
    #: state of the subject connection: "intrans", "idle", "autocommit", "inerror", "closed"
    state: str = "intrans"
    #: what is passed as the connection: "subject" or a wrong type
    conn: str = "subject"


BAD_NAMES: list[tuple[str, object, type[BaseException]]] = [
    ("empty", "", ValueError),
    ("nul", "a\x00b", ValueError),
    ("lone-surrogate", "a\ud800", ValueError),
    ("bytes", b"account:1", TypeError),
    ("none", None, TypeError),
    ("int", 42, TypeError),
    ("too-long", "x" * (pglock.MAX_NAME_BYTES + 1), ValueError),
    ("too-long-utf8", "\u00e9" * 513, ValueError),
    ("empty-list", [], ValueError),
    ("list-with-int", ["a", 1], TypeError),
    ("list-with-empty", ["a", ""], ValueError),
    ("dict", {"a": 1}, TypeError),
]

BAD_TIMEOUTS: list[tuple[str, object, type[BaseException]]] = [
    ("minus-one", -1, ValueError),
    ("nan", math.nan, ValueError),
    ("inf", math.inf, ValueError),
    ("true", True, TypeError),
    ("str", "5", TypeError),
    ("too-large", MAX_TIMEOUT + 1, ValueError),
]

CASES: list[Case] = []
for _id, _name, _exc in BAD_NAMES:
    CASES += [
        Case(f"name-{_id}-pg_lock", functools.partial(enter, names=_name), _exc),
        Case(f"name-{_id}-xact_lock", functools.partial(xact, names=_name), _exc),
        Case(f"name-{_id}-try_xact_lock", functools.partial(try_xact, names=_name), _exc),
    ]
for _id, _t, _exc in BAD_TIMEOUTS:
    CASES += [
        Case(f"timeout-{_id}-pg_lock", functools.partial(enter, timeout=_t), _exc),
        Case(f"timeout-{_id}-acquire", functools.partial(acquire, timeout=_t), _exc),
        Case(f"timeout-{_id}-xact_lock", functools.partial(xact, timeout=_t), _exc),
    ]
CASES += [
    Case("shared-yes-pg_lock", lambda c: enter(c, shared="yes"), TypeError),
    Case("shared-yes-xact_lock", lambda c: xact(c, shared="yes"), TypeError),
    Case("shared-yes-try_xact_lock", lambda c: try_xact(c, shared=1), TypeError),
    Case("blocking-int-acquire", lambda c: acquire(c, blocking=0), TypeError),
    Case(
        "blocking-false-with-timeout", lambda c: acquire(c, blocking=False, timeout=1), ValueError
    ),
]
for _kind in ("none", "dsn", "psycopg2", "async", "engine"):
    CASES += [
        Case(f"conn-{_kind}-pg_lock", enter, TypeError, conn=_kind),
        Case(f"conn-{_kind}-xact_lock", xact, TypeError, conn=_kind),
        Case(f"conn-{_kind}-try_xact_lock", try_xact, TypeError, conn=_kind),
    ]
for _call, _label in ((enter, "pg_lock"), (xact, "xact_lock"), (try_xact, "try_xact_lock")):
    CASES += [
        Case(f"closed-{_label}", _call, pglock.InvalidConnectionState, state="closed"),
        Case(f"failed-transaction-{_label}", _call, pglock.InvalidConnectionState, "inerror"),
    ]
CASES += [
    Case("xact-in-autocommit", xact, pglock.InvalidConnectionState, state="autocommit"),
    Case("try-xact-in-autocommit", try_xact, pglock.InvalidConnectionState, state="autocommit"),
    Case("failed-transaction-acquire", acquire, pglock.InvalidConnectionState, state="inerror"),
    # Argument errors win over connection state: still nothing sent.
    Case("bad-name-on-failed-transaction", lambda c: enter(c, ""), ValueError, state="inerror"),
    Case("bad-timeout-in-autocommit", lambda c: enter(c, timeout=-1), ValueError, "autocommit"),
]


@pytest.fixture
def subject_factory(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any]
) -> Iterator[Callable[[str], RecordingConnection]]:
    opened: list[RecordingConnection] = []

    def make(state: str) -> RecordingConnection:
        c: RecordingConnection = RecordingConnection.connect(
            pg_dsn,
            autocommit=(state == "autocommit"),
            application_name=app_name,
        )
        opened.append(c)
        if state == "intrans":
            c.execute("SELECT 1")
        elif state == "inerror":
            with pytest.raises(psycopg.errors.DivisionByZero):
                c.execute("SELECT 1/0")
        elif state == "closed":
            c.close()
        c.sent.clear()
        return c

    yield make
    for c in opened:
        c.close()


def activity(observer: psycopg.Connection[Any], pid: int) -> tuple[Any, ...]:
    """The backend's view of itself: any statement sent would change query/state_change."""
    row = observer.execute(
        "SELECT query, state, state_change, xact_start, query_start "
        "FROM pg_stat_activity WHERE pid = %s",
        (pid,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def locks(observer: psycopg.Connection[Any], pid: int) -> list[tuple[Any, ...]]:
    return observer.execute(
        "SELECT locktype, classid, objid, objsubid, virtualxid, mode, granted FROM pg_locks "
        "WHERE pid = %s ORDER BY 1, 2, 3, 4, 5, 6",
        (pid,),
    ).fetchall()


@pytest.fixture
def wrong_conn(pg_dsn: str, app_name: str) -> Iterator[Callable[[str], tuple[object, int | None]]]:
    """Wrong connection types; returns (object, backend pid or None)."""
    cleanups: list[Callable[[], None]] = []

    def make(kind: str) -> tuple[object, int | None]:
        if kind == "none":
            return None, None
        if kind == "dsn":
            return pg_dsn, None
        if kind == "psycopg2":
            import psycopg2

            c2 = psycopg2.connect(pg_dsn, application_name=app_name)
            cleanups.append(c2.close)
            return c2, c2.get_backend_pid()
        if kind == "async":
            loop = asyncio.new_event_loop()
            ac = loop.run_until_complete(
                psycopg.AsyncConnection.connect(pg_dsn, application_name=app_name)
            )

            def close_async() -> None:
                loop.run_until_complete(ac.close())
                loop.close()

            cleanups.append(close_async)
            return ac, ac.info.backend_pid
        if kind == "engine":
            url = sa_url(pg_dsn)
            eng = sa.create_engine(url, connect_args={"application_name": app_name})
            cleanups.append(eng.dispose)
            return eng, None
        raise AssertionError(kind)

    yield make
    for fn in cleanups:
        fn()


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_before_any_sql(
    case: Case,
    subject_factory: Callable[[str], RecordingConnection],
    wrong_conn: Callable[[str], tuple[object, int | None]],
    other: psycopg.Connection[Any],
) -> None:
    subject = subject_factory(case.state)
    target: object = subject
    watched: int | None = None if subject.closed else subject.info.backend_pid
    if case.conn != "subject":
        target, watched = wrong_conn(case.conn)
    status = subject.info.transaction_status
    before = (activity(other, watched), locks(other, watched)) if watched else None

    with pytest.raises(case.exc) as info:
        case.call(target)

    assert str(info.value), "the error must say what was wrong"
    assert subject.sent == [], f"SQL was sent: {subject.sent}"
    assert subject.info.transaction_status == status
    if watched is not None:
        assert before == (activity(other, watched), locks(other, watched))
    if not subject.closed:
        # pglock's own bookkeeping is unchanged too.
        state = _conn.state_for(subject)
        assert state.holds == {} and state.xact == {} and state.deferred == []
    if case.conn == "subject" and case.state == "inerror":
        subject.rollback()


def test_messages_say_what_is_accepted(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(TypeError, match="psycopg"):
        pglock.pg_lock("postgresql://x", NAME)
    with pytest.raises(TypeError, match="str"):
        pglock.pg_lock(conn, 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="None waits forever"):
        pglock.pg_lock(conn, NAME, timeout=-1)
    with pytest.raises(TypeError, match="True or False"):
        pglock.pg_lock(conn, NAME, shared="yes")  # type: ignore[arg-type]
    with pytest.raises(pglock.InvalidConnectionState, match="autocommit"):
        pglock.xact_lock(conn, NAME)


def test_control_a_valid_call_is_seen_by_the_oracle(
    subject_factory: Callable[[str], RecordingConnection], other: psycopg.Connection[Any]
) -> None:
    """Negative control for the oracle above: a valid call does change what it watches."""
    subject = subject_factory("intrans")
    pid = subject.info.backend_pid
    before = (activity(other, pid), locks(other, pid))
    pglock.xact_lock(subject, NAME + ":control")
    assert subject.sent
    assert before != (activity(other, pid), locks(other, pid))
    subject.rollback()
