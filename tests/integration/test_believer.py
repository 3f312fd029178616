"""The believer oracle's own controls (tests/_believer.py).

Negative controls: pglock is made to report grants the database did not make, the way a bug
would, and the oracle must flag each one. Advisory and transaction locks: every statement that
takes a lock (the pre-rendered ones and the composed batches) answers "granted" and locks
nothing; or asks for the wrong mode. Leases and semaphore permits: the answer to the acquire
(or resume) statement is replaced by a grant the database never wrote. Every control first
shows that the fake took effect (Postgres holds nothing of it) and then that the oracle named
the claim and what the database said, once per lock object that reported it.

Positive control: real grants of every kind and through every report point (acquire, ``with``,
re-entry, a handoff from the lease queue, a resume, ``hold()``, the leader's reports) are all
checked, and the oracle stays quiet.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import _believer
import psycopg
import pytest
from _threads import started
from _truth import holders
from psycopg import sql
from psycopg_pool import ConnectionPool
from test_lease_support import sleep_until_expired, wait_until

import pglock
from pglock import _lease, _semaphore, _sql

pytestmark = pytest.mark.timeout(60)

#: A lock function call in pglock's statements, rendered or composed (quoted identifiers).
_LOCK_CALL = re.compile(
    r'"?pg_catalog"?\."?pg_(?:try_)?advisory_(?:xact_)?lock(?:_shared)?"?\(([^()]*)\)'
)


def _no_lock(text: str) -> str:
    """``text`` with every lock function call replaced by "granted" (true, or a value where
    the caller reads none), taking nothing."""
    faked, n = _LOCK_CALL.subn(lambda m: f"(({m[1]})::int8 IS NOT NULL)", text)
    assert n, f"no lock call to fake in {text!r}: update the negative control"
    return faked


@pytest.fixture
def oracle(pg_dsn: str) -> Iterator[_believer.Believer]:
    with _believer.believing(pg_dsn) as o:
        yield o


@pytest.fixture
def fake_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """pglock's advisory lock statements answer "granted" and lock nothing."""
    for table in (_sql.LOCK_ONE, _sql.LOCK_MANY):
        for flags, query in list(table.items()):
            monkeypatch.setitem(table, flags, _no_lock(query.decode()).encode())
    for flags, text in list(_sql._XACT_ONE.items()):
        monkeypatch.setitem(_sql._XACT_ONE, flags, _no_lock(text))
    lock = _sql.lock

    def no_lock(keys: Any, **kwargs: Any) -> sql.Composable:
        return sql.SQL(_no_lock(lock(keys, **kwargs).as_string(None)))

    monkeypatch.setattr(_sql, "lock", no_lock)


class Env:
    """Connections and pools on the module's database (the test's application_name)."""

    def __init__(self, dsn: str, name: str) -> None:
        self.dsn = dsn
        self.name = name
        self.stack = contextlib.ExitStack()
        self.obs = self.conn()

    def conn(self, autocommit: bool = True) -> psycopg.Connection[Any]:
        c = psycopg.connect(self.dsn, autocommit=autocommit)
        self.stack.callback(c.close)
        return c

    def pool(self) -> ConnectionPool[Any]:
        p: ConnectionPool[Any] = ConnectionPool(self.dsn, min_size=1, max_size=2, open=True,
                                                timeout=10)
        self.stack.callback(p.close)
        return p

    def nothing_held(self, *names: str) -> None:
        """The fake took effect: no session holds ``names``."""
        for n in names:
            assert holders(self.obs, n) == [], f"{n!r} is really held: the fake did not apply"


@pytest.fixture
def env(dsn: str, name: str) -> Iterator[Env]:
    e = Env(dsn, name)
    yield e
    e.stack.close()


def _flagged(oracle: _believer.Believer, kind: str) -> set[str]:
    """The report points the oracle flagged (all of ``kind``, each message complete)."""
    assert oracle.errors == []
    assert oracle.disagreements, "the oracle found nothing wrong with a faked grant"
    for d in oracle.disagreements:
        assert d.kind == kind, d
        assert "pglock claimed" in str(d) and d.database, d
    return {d.api for d in oracle.disagreements}


# --- advisory locks: granted, nothing locked ----------------------------------------------------


def _pg_lock_try(env: Env) -> None:
    h = pglock.pg_lock(env.conn(), env.name, timeout=0)
    assert h.acquire() is True
    with pytest.raises(pglock.LockLost):
        h.release()


def _pg_lock_with(env: Env) -> None:
    with pytest.raises(pglock.LockLost), pglock.pg_lock(env.conn(), env.name):  # waits: no timeout
        pass


def _pg_lock_timeout(env: Env) -> None:
    h = pglock.pg_lock(env.conn(), env.name, timeout=5)  # a batch with lock_timeout
    assert h.acquire() is True
    with pytest.raises(pglock.LockLost):
        h.release()


def _pg_lock_many(env: Env) -> None:
    h = pglock.pg_lock(env.conn(), [env.name + ":a", env.name + ":b"], timeout=0)
    assert h.acquire() is True
    env.nothing_held(env.name + ":a", env.name + ":b")
    with pytest.raises(pglock.LockLost):
        h.release()


def _rival_holds(env: Env) -> None:
    rival = env.conn()
    rival.execute("SELECT pg_advisory_lock(%s)", (pglock.key(env.name),))
    h = pglock.pg_lock(env.conn(), env.name, timeout=0)
    assert h.acquire() is True  # the fake grants it while the rival holds it
    assert holders(env.obs, env.name) == [(rival.info.backend_pid, "ExclusiveLock")]
    with pytest.raises(pglock.LockLost):
        h.release()
    rival.execute("SELECT pg_advisory_unlock_all()")


def _re_entry(env: Env) -> None:
    c = env.conn()
    first = pglock.pg_lock(c, env.name, timeout=0)
    assert first.acquire() is True
    again = pglock.pg_lock(c, env.name, timeout=0)
    assert again.acquire() is True  # re-entered in-process: no statement
    again.release()
    with pytest.raises(pglock.LockLost):
        first.release()


def _pool_lock(env: Env) -> None:
    with pytest.raises(pglock.LockLost), pglock.pool_lock(env.pool(), env.name, timeout=0):
        env.nothing_held(env.name)


def _locker(env: Env) -> None:
    locker = pglock.Locker(env.pool())
    with pytest.raises(pglock.LockLost), locker.lock(env.name, timeout=0):
        env.nothing_held(env.name)


def _rwlock_read(env: Env) -> None:
    with pytest.raises(pglock.LockLost), pglock.rwlock(env.conn(), env.name).read(timeout=0):
        env.nothing_held(env.name)


def _rwlock_write_pool(env: Env) -> None:
    with pytest.raises(pglock.LockLost), pglock.rwlock(env.pool(), env.name).write(timeout=0):
        env.nothing_held(env.name)


def _singleton_run(env: Env) -> None:
    ran: list[bool] = []
    with pytest.raises(pglock.LockLost):
        pglock.singleton(env.pool(), env.name).run(lambda: ran.append(True))
    assert ran == [True]


def _singleton_with(env: Env) -> None:
    with pytest.raises(pglock.LockLost), pglock.singleton(env.pool(), env.name):
        env.nothing_held(env.name)


PG, POOL, RW, ONE = "PgLock.acquire", "PoolLock.acquire", "RWHold.acquire", "Singleton.acquire"

ADVISORY: dict[str, tuple[Callable[[Env], None], set[str]]] = {
    "pg_lock-try": (_pg_lock_try, {PG}),
    "pg_lock-with": (_pg_lock_with, {PG}),
    "pg_lock-timeout": (_pg_lock_timeout, {PG}),
    "pg_lock-many": (_pg_lock_many, {PG}),
    "rival-holds": (_rival_holds, {PG}),
    "re-entry": (_re_entry, {PG}),
    "pool_lock": (_pool_lock, {PG, POOL}),
    "Locker.lock": (_locker, {PG, POOL}),
    "rwlock-read": (_rwlock_read, {PG, RW}),
    "rwlock-write-pool": (_rwlock_write_pool, {PG, POOL, RW}),
    "singleton-run": (_singleton_run, {PG, POOL, RW}),
    "singleton-with": (_singleton_with, {PG, POOL, RW, ONE}),
}


@pytest.mark.parametrize("case", list(ADVISORY))
def test_a_faked_advisory_grant_is_caught(
    case: str, env: Env, fake_locks: None, oracle: _believer.Believer
) -> None:
    run, flagged = ADVISORY[case]
    run(env)
    env.nothing_held(env.name)
    assert _flagged(oracle, "advisory") == flagged
    if case == "re-entry":  # both handles reported a grant: both are flagged
        assert len(oracle.disagreements) == 2
    if case == "rival-holds":
        assert "pid" in oracle.disagreements[0].database


def test_a_grant_in_the_wrong_mode_is_caught(
    env: Env, monkeypatch: pytest.MonkeyPatch, oracle: _believer.Believer
) -> None:
    """pglock claims an exclusive lock; the database granted a shared one."""
    monkeypatch.setitem(_sql.LOCK_ONE, (False, False, True), _sql.LOCK_ONE[(False, True, True)])
    lock = _sql.lock

    def shared_lock(keys: Any, *, shared: bool, xact: bool, try_: bool) -> sql.Composable:
        return lock(keys, shared=True, xact=xact, try_=try_)

    monkeypatch.setattr(_sql, "lock", shared_lock)  # the batch that also registers the name
    c = env.conn()
    h = pglock.pg_lock(c, env.name, timeout=0)
    assert h.acquire() is True
    assert holders(env.obs, env.name) == [(c.info.backend_pid, "ShareLock")]
    assert _flagged(oracle, "advisory") == {PG}
    assert "ShareLock" in oracle.disagreements[0].database
    with contextlib.suppress(pglock.LockLost):
        h.release()
    c.execute("SELECT pg_advisory_unlock_all()")


@pytest.mark.parametrize("case", ["xact_lock", "xact_lock-wait", "try_xact_lock-many"])
def test_a_faked_transaction_lock_is_caught(
    case: str, env: Env, fake_locks: None, oracle: _believer.Believer
) -> None:
    c = env.conn(autocommit=False)
    names = [env.name + ":a", env.name + ":b"]
    with c.transaction():
        if case == "xact_lock":
            pglock.xact_lock(c, env.name, timeout=0)
        elif case == "xact_lock-wait":
            pglock.xact_lock(c, env.name)
        else:
            assert pglock.try_xact_lock(c, names) is True
        env.nothing_held(env.name, *names)
    assert _flagged(oracle, "xact") == {case.split("-")[0]}


def test_a_faked_leader_is_caught(
    env: Env, fake_locks: None, monkeypatch: pytest.MonkeyPatch, oracle: _believer.Believer
) -> None:
    """The campaign's lock is faked and so is the leader's check that its session holds it."""
    monkeypatch.setattr(_sql, "held_advisory", lambda keys, shared: sql.SQL("SELECT 1"))
    with pglock.leader(env.dsn, env.name, check_interval=0.1) as election:
        assert election.wait_elected(timeout=20) is True
        env.nothing_held(env.name)
        assert election.is_leader
    assert oracle.errors == []
    assert {(d.kind, d.api) for d in oracle.disagreements} == {
        ("advisory", PG),
        ("leader", "LeaderElection.wait_elected"),
        ("leader", "LeaderElection.is_leader"),
    }


# --- leases and permits: the acquire statement's answer is faked --------------------------------


def _fake_lease_answers(monkeypatch: pytest.MonkeyPatch, token: int = 10**12) -> None:
    """Lease acquires (and resumes) answer "granted" with ``token``; nothing is written."""
    real = _lease._run

    def fake(source: Any, kind: str, schema: str, args: tuple[Any, ...], **kw: Any) -> Any:
        now = dt.datetime.now(dt.timezone.utc)
        if kind in ("acquire", "acquire_v4"):
            ttl = args[2]
            row = (True, args[1], token, now, now + dt.timedelta(seconds=ttl), now)
            return [(*row, None)] if kind == "acquire_v4" else [row]
        if kind == "extend" and args[2] is None:  # a resume
            return [(token, now, now + dt.timedelta(seconds=args[3]), None)]
        return real(source, kind, schema, args, **kw)

    monkeypatch.setattr(_lease, "_run", fake)


LEASE_CASES = ["try-once", "wait", "resume", "rival-row", "expired-row"]


@pytest.mark.parametrize("case", LEASE_CASES)
def test_a_faked_lease_grant_is_caught(
    case: str, env: Env, monkeypatch: pytest.MonkeyPatch, oracle: _believer.Believer
) -> None:
    n, token = env.name, 10**12
    rival = None
    if case == "rival-row":
        rival = pglock.lease(env.dsn, n, holder="rival", keepalive=False)
        assert rival.acquire(timeout=0)
    elif case == "expired-row":  # this holder's row with this token, expired a minute ago
        env.obs.execute(
            "INSERT INTO pglock.lease (name, holder, token, acquired_at, expires_at)"
            " VALUES (%s, 'me', %s, now() - interval '2 min', now() - interval '1 min')",
            (n, token),
        )
    _fake_lease_answers(monkeypatch, token)
    lease = pglock.lease(env.dsn, n, holder="me", keepalive=False, resume=case == "resume")
    assert lease.acquire(timeout=0 if case != "wait" else 5) is True
    assert lease.locked and lease.token == token
    assert _flagged(oracle, "lease") == {"Lease.acquire"}
    what = oracle.disagreements[0].database
    assert {"rival-row": "'rival'", "expired-row": "expired"}.get(case, "no row") in what
    with contextlib.suppress(pglock.LockLost):
        lease.release()
    if rival is not None:
        rival.release()
    env.obs.execute("DELETE FROM pglock.lease WHERE name = %s", (n,))


def _fake_permit_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _semaphore._run

    def fake(source: Any, kind: str, schema: str, stmt: Any, *args: Any, **kw: Any) -> Any:
        if kind == "acquire":  # (granted, limit, held, retry_in)
            return [(True, 1, 1, None)], False
        return real(source, kind, schema, stmt, *args, **kw)

    monkeypatch.setattr(_semaphore, "_run", fake)


@pytest.mark.parametrize("how", ["acquire", "with", "hold"])
def test_a_faked_permit_is_caught(
    how: str, env: Env, monkeypatch: pytest.MonkeyPatch, oracle: _believer.Believer
) -> None:
    _fake_permit_answers(monkeypatch)
    sem = pglock.semaphore(env.dsn, env.name, 1)
    if how == "acquire":
        assert sem.acquire(timeout=0) is True
        with pytest.raises(pglock.LockLost):
            sem.release()
    else:
        with pytest.raises(pglock.LockLost), sem.hold() if how == "hold" else sem:
            pass
    live = env.obs.execute("SELECT count(*) FROM pglock.semaphore_permit WHERE semaphore = %s",
                           (env.name,)).fetchone()
    assert live == (0,)  # the fake took effect
    api = "Semaphore.hold().__enter__" if how == "hold" else "Semaphore.acquire"
    assert _flagged(oracle, "permit") == {api}
    assert oracle.disagreements[0].database == "no row"


def test_a_lock_the_oracle_cannot_describe_is_an_oracle_error(oracle: _believer.Believer) -> None:
    """A new lock class reporting a grant is not passed unchecked: the oracle says it cannot
    tell what the grant claims (and the ``believer`` fixture fails the test with it)."""

    class NewKind(_believer.base_lock()):  # type: ignore[misc]
        _timeout = None

        def _acquire(self, timeout: float | None) -> bool:
            return True

        def release(self) -> None: ...

        locked = False

        def _outstanding(self) -> bool:
            return False

        def _not_acquired(self) -> Any:
            return pglock.LockNotAcquired("x")

        def _wake(self) -> None: ...

    assert NewKind().acquire() is True
    assert oracle.disagreements == []
    assert len(oracle.errors) == 1 and "does not know" in oracle.errors[0]
    assert oracle.verdict() is not None and "oracle error" in str(oracle.verdict())


# --- a grant gone legitimately while the oracle looked -------------------------------------------


@pytest.mark.parametrize("taken_over", [False, True], ids=["still-there", "taken-over"])
def test_a_lease_that_expires_while_the_oracle_looks(
    taken_over: bool, env: Env, oracle: _believer.Believer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow look is no false alarm: the row still there agrees (it was unexpired at the
    report, which is what the check asks), and a rival's row, taken over once the grant
    expired, is inconclusive: pglock had stopped believing the grant by then."""
    n = env.name
    lease = pglock.lease(env.dsn, n, holder="me", ttl=0.3, keepalive=False)
    rival = pglock.lease(env.dsn, n, holder="rival", keepalive=False)
    observe = oracle._observe
    slowed: list[bool] = []

    def slow(server: Any, query: Any, params: Any) -> Any:
        if not slowed:
            slowed.append(True)
            sleep_until_expired(env.obs, n)
            if taken_over:
                assert rival.acquire(timeout=5) is True
        return observe(server, query, params)

    monkeypatch.setattr(oracle, "_observe", slow)
    assert lease.acquire(timeout=0) is True
    assert not lease.locked and slowed
    assert oracle.verdict() is None, oracle.verdict()
    assert oracle.checks["lease"] == (2 if taken_over else 1)
    assert oracle.inconclusive == ({"lease": 1} if taken_over else {}), oracle.notes
    if taken_over:
        rival.release()
    with contextlib.suppress(pglock.LockLost):
        lease.release()


# --- the positive control -----------------------------------------------------------------------


def _queued(env: Env, name: str) -> bool:
    row = env.obs.execute("SELECT count(*) FROM pglock.lease_waiter WHERE name = %s",
                          (name,)).fetchone()
    return row is not None and row[0] > 0


def _advisory_grants(env: Env) -> None:
    c = env.conn()
    with pglock.pg_lock(c, env.name), pglock.pg_lock(c, env.name):  # a re-entry
        pass
    with pglock.pg_lock(c, [env.name + ":a", env.name + ":b"], shared=True, timeout=5):
        pass
    pool = env.pool()
    with pglock.pool_lock(pool, env.name, timeout=0):
        pass
    rw = pglock.rwlock(c, env.name)
    with rw.read(timeout=0), rw.read(timeout=0):  # a second reader on the same connection
        pass
    with pglock.rwlock(pool, env.name).write():
        pass
    with pglock.singleton(pool, env.name):
        pass
    assert pglock.singleton(pool, env.name).run(lambda: "ran") == "ran"
    with pglock.Locker(pool) as locker, locker.lock(env.name):
        pass
    t = env.conn(autocommit=False)
    with t.transaction():
        pglock.xact_lock(t, env.name)
        assert pglock.try_xact_lock(t, [env.name + ":a", env.name + ":b"], shared=True)


def _lease_grants(env: Env) -> None:
    n = env.name + ":lease"
    first = pglock.lease(env.dsn, n, holder="me", keepalive=False)
    assert first.acquire(timeout=0)
    resumed = pglock.lease(env.dsn, n, holder="me", resume=True, keepalive=False)
    assert resumed.acquire()  # the same grant, re-attached (the first handle is superseded)
    waiter = pglock.lease(env.dsn, n, holder="next", keepalive=False)
    join = started(lambda: waiter.acquire(timeout=20))
    assert wait_until(lambda: _queued(env, n), 20)
    resumed.release()  # hands the lease to the queued waiter in the same statement
    row = env.obs.execute("SELECT holder FROM pglock.lease WHERE name = %s", (n,)).fetchone()
    assert row == ("next",)
    assert join() is True
    waiter.release()
    with pytest.raises(pglock.LockLost):
        first.release()


def _permit_grants(env: Env) -> None:
    sem = pglock.semaphore(env.dsn, env.name + ":sem", 3)
    assert sem.acquire(timeout=0)
    with sem, sem.hold(permits=1):
        pass
    sem.release()


def _leader_grants(env: Env) -> None:
    elected = threading.Event()
    with pglock.leader(env.dsn, env.name + ":leader", check_interval=0.1,
                       on_elected=elected.set) as election:
        assert election.wait_elected(timeout=20) and election.is_leader
        assert elected.wait(20)


def test_real_grants_of_every_kind_are_believed(env: Env, oracle: _believer.Believer) -> None:
    _advisory_grants(env)
    _lease_grants(env)
    _permit_grants(env)
    _leader_grants(env)
    assert oracle.verdict() is None, oracle.verdict()
    assert not oracle.inconclusive, oracle.notes
    assert set(oracle.checks) == {"advisory", "xact", "lease", "permit", "leader"}
    assert set(oracle.by_api) >= {
        PG, POOL, RW, ONE, "Lease.acquire", "Semaphore.acquire", "Semaphore.hold().__enter__",
        "xact_lock", "try_xact_lock", "LeaderElection.wait_elected", "LeaderElection.is_leader",
        "LeaderElection.on_elected",
    }, oracle.by_api


def test_every_report_point_is_wrapped_while_active_and_restored_after(pg_dsn: str) -> None:
    from pglock import _xact

    def wrapped() -> list[bool]:
        classes = [c for c in _believer._subclasses(_believer.base_lock())
                   if c.__module__.split(".")[0] == "pglock"]
        assert {c.__name__ for c in classes} >= {
            "PgLock", "PoolLock", "RWHold", "Singleton", "Lease", "Semaphore"
        }
        points = [getattr(c, a) for c in classes for a in ("acquire", "__enter__")]
        points += [_semaphore._Hold.__enter__, pglock.xact_lock, pglock.try_xact_lock,
                   _xact.xact_lock, _xact.try_xact_lock]
        return [hasattr(p, "_believer") for p in points]

    with _believer.believing(pg_dsn):
        assert all(wrapped())
        with pytest.raises(RuntimeError, match="already active"), _believer.believing(pg_dsn):
            pass
    assert not any(wrapped())
