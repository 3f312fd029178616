"""The believer oracle: whenever pglock reports a grant, the database must agree at that moment.

While :func:`believing` is active, every place a pglock lock reports a grant to its caller is
wrapped (class-level monkeypatching, undone afterwards), and each grant is checked before
control returns to the caller, through an independent observer connection (autocommit, the
server's default settings, ``application_name`` :data:`OBSERVER_APP`, raw SQL, never pglock):

* advisory locks (``pg_lock``, a re-entry, ``pool_lock``, ``Locker.lock``, rwlock holds, a
  singleton, a leader's campaign): the server session of the lock's connection holds every key
  in ``pg_locks``, granted, in the mode claimed (an exclusive lock also answers a shared claim);
* ``xact_lock`` / ``try_xact_lock``: the same, and the caller's transaction is open;
* leases (any grant ``Lease.acquire`` reports: a first grant, a re-acquire, a handoff from the
  wait queue, a resume): the ``<schema>.lease`` row names this holder and token and was
  unexpired when the grant was reported;
* semaphore permits (``Semaphore.acquire``, ``with sem``, ``with sem.hold()``): the
  ``<schema>.semaphore_permit`` row of this holder has its permits and was unexpired;
* leader election (``is_leader`` True, ``wait_elected`` True, ``on_elected`` called): the
  leader's session (pid and start time) holds the election's key exclusively.

What is wrapped: ``acquire`` and ``__enter__`` of the lock base class and of every subclass
that defines its own (found by walking the subclasses, so a new lock class or override is
wrapped too; a lock object the oracle cannot describe is an oracle error, not a pass);
``Semaphore.hold()``'s ``__enter__``; the public functions ``xact_lock`` and ``try_xact_lock``
wherever pglock or a test module bound them; ``LeaderElection.is_leader``,
``wait_elected`` and the ``on_elected`` callback given to its constructor. Constructors of
``PgLock``, ``PoolLock`` and ``Permit`` and ``RWLock.read``/``write`` are wrapped only to
remember their arguments (what the lock claims: the connection, the mode).

A grant whose database truth can legitimately be gone by the time the observer looks is
judged by what pglock still believes then: a lease or permit row missing or another holder's
while the handle no longer believes it held (its client deadline passed during the check) is
*inconclusive* (counted, never a pass in disguise); the leader's session ended meanwhile
likewise. A lease or permit row of this grant that had expired before the report while pglock
believed the grant is always a disagreement (the check allows only the time the oracle itself
took between the report and its query, measured on the client). The leader is observed on the
test server (its session's pid and start time say which session).

Disagreements are recorded with what pglock claimed and what the database said; the
``believer`` fixture (tests/conftest.py) fails the test at teardown with them, and with any
oracle error (an observer that failed, a lock it cannot describe).

Private pglock names used (the rest is public API):

* ``pglock._semaphore._Hold.__enter__``: ``with sem.hold()`` reports its grant there (the
  public ``hold()`` returns that object; its ``__enter__`` is the report);
* ``pglock._conn.fetch`` (as tests/_sent.py): every lease and semaphore statement goes
  through it; the connection it ran on says which database the row lives in;
* ``Lease._source.database`` and ``Permit._source.database``: the same, when no statement
  ran in the call that reported the grant (``("database", host, port, dbname)``);
* ``Permit._schema``: the semaphore's schema (no public property says it);
* ``LeaderElection._session``: ``(pid, backend_start)`` of the leader's dedicated session;
* ``pglock._conn.state_for(conn).pooler`` / ``.backend_pid``: the server pid pglock probed,
  used only when pglock found a pooler in front of the connection (``conn.info.backend_pid``
  otherwise).

Importable from every test module as ``_believer``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.pq import TransactionStatus

import pglock

OBSERVER_APP = "pglock-believer"
X, S = "ExclusiveLock", "ShareLock"
TESTS = Path(__file__).resolve().parent

#: Every granted advisory lock on ``keys``, in every session: (key, pid, mode).
_ADVISORY = (
    "SELECT k, l.pid, l.mode FROM unnest(%s::int8[]) AS k"
    " JOIN pg_catalog.pg_locks l ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
    " AND ((l.classid::int8 << 32) | l.objid::int8) = k ORDER BY 1, 2, 3"
)
#: The leader's session: its start, and whether it holds ``key`` exclusively.
_LEADER = (
    "SELECT a.backend_start, EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = a.pid"
    " AND l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ExclusiveLock'"
    " AND ((l.classid::int8 << 32) | l.objid::int8) = %s)"
    " FROM pg_catalog.pg_stat_activity a WHERE a.pid = %s"
)
# Unexpired when reported: the query runs ``elapsed`` seconds (client clock) after the report,
# so ``clock_timestamp() - elapsed`` is no earlier than the report on the database clock.
_LEASE = (
    "SELECT holder, token, expires_at > pg_catalog.clock_timestamp()"
    " - pg_catalog.make_interval(secs => %s), expires_at FROM {}.lease WHERE name = %s"
)
_PERMIT = (
    "SELECT permits, expires_at > pg_catalog.clock_timestamp()"
    " - pg_catalog.make_interval(secs => %s), expires_at FROM {}.semaphore_permit"
    " WHERE semaphore = %s AND holder = %s"
)


#: Where an observer connects: (host, port, dbname); empty parts are the server DSN's.
Server = tuple[str, str, str]


class OracleError(Exception):
    """The oracle could not check a grant (it cannot describe the lock, or could not look)."""


@dataclasses.dataclass(frozen=True)
class Disagreement:
    kind: str
    api: str
    claimed: str
    database: str

    def __str__(self) -> str:
        return (f"[{self.kind}] {self.api}: pglock claimed {self.claimed}; "
                f"the database: {self.database}")


@dataclasses.dataclass(eq=False)  # frames are told apart by identity
class _Frame:
    """One wrapped call in progress on a thread: what the calls nested in it saw."""

    permits: list[Any] = dataclasses.field(default_factory=list)
    #: advisory grants verified inside: (server, pid, keys, exclusive)
    verified: list[tuple[Server, int, frozenset[int], bool]] = dataclasses.field(
        default_factory=list
    )
    checked: set[int] = dataclasses.field(default_factory=set)  # ids of objects verified inside
    #: where pglock's statements ran inside (its lease and semaphore statements among them)
    databases: list[Server] = dataclasses.field(default_factory=list)


class Session:
    """Totals over the pytest session, for the terminal summary (tests/conftest.py)."""

    def __init__(self) -> None:
        self.checks: Counter[str] = Counter()
        self.by_api: Counter[str] = Counter()
        self.inconclusive: Counter[str] = Counter()
        self.disagreements = 0
        self.spent = 0.0
        self.tests = 0
        self.quiet: list[str] = []  # tests under the oracle that saw no grant

    def record(self, nodeid: str, oracle: Believer) -> None:
        self.tests += 1
        self.checks.update(oracle.checks)
        self.by_api.update(oracle.by_api)
        self.inconclusive.update(oracle.inconclusive)
        self.disagreements += len(oracle.disagreements)
        self.spent += oracle.spent
        if not oracle.total:
            self.quiet.append(nodeid)

    def summary(self) -> list[str]:
        """Lines for the end of the run (none when no test ran under the oracle)."""
        if not self.tests:
            return []
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.checks.items())) or "none"
        lines = [
            f"{self.tests} tests under the believer oracle: {sum(self.checks.values())} grants "
            f"checked ({kinds}), {self.disagreements} disagreement(s); the oracle took "
            f"{self.spent:.2f} s",
            "by report: " + ", ".join(f"{a} {n}" for a, n in sorted(self.by_api.items())),
        ]
        if self.inconclusive:
            unsure = ", ".join(f"{k} {n}" for k, n in sorted(self.inconclusive.items()))
            lines.append(f"inconclusive (the grant's own deadline passed first): {unsure}")
        if self.quiet:
            lines.append(f"{len(self.quiet)} of them saw no grant (suspicious unless the test "
                         "takes nothing):")
            lines += [f"  {nodeid}" for nodeid in self.quiet]
        return lines


SESSION = Session()
_active: Believer | None = None


class Believer:
    """One activation of the oracle: its observers, counters and findings."""

    def __init__(self, server_dsn: str) -> None:
        self._server_dsn = make_conninfo(server_dsn, options=None)
        self._lock = threading.Lock()
        self._observers: dict[Server, tuple[threading.Lock, psycopg.Connection[Any]]] = {}
        self._local = threading.local()
        self._args: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        self.closed = False
        #: checks done, by kind (advisory, xact, lease, permit, leader) and by api
        self.checks: Counter[str] = Counter()
        self.by_api: Counter[str] = Counter()
        #: grants the database could no longer confirm or refute when the oracle looked
        self.inconclusive: Counter[str] = Counter()
        self.notes: list[str] = []
        self.disagreements: list[Disagreement] = []
        self.errors: list[str] = []
        #: seconds the oracle itself took (installing, checking, closing): what it adds
        self.spent = 0.0

    # --- findings ---------------------------------------------------------------------------

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.checks.values())

    def _count(self, kind: str, api: str) -> None:
        with self._lock:
            self.checks[kind] += 1
            self.by_api[api] += 1

    def _disagree(self, d: Disagreement) -> None:
        with self._lock:
            self.disagreements.append(d)

    def _unsure(self, kind: str, note: str) -> None:
        with self._lock:
            self.inconclusive[kind] += 1
            self.notes.append(note)

    def _spent(self, since: float) -> None:
        took = time.monotonic() - since
        with self._lock:
            self.spent += took

    def error(self, api: str, obj: Any, exc: Exception) -> None:
        with self._lock:
            if not self.closed:  # a thread still running after the test: nobody to tell
                what = f"{type(obj).__name__} {getattr(obj, 'name', getattr(obj, 'names', ''))!r}"
                self.errors.append(f"{api} on {what}: {type(exc).__name__}: {exc}")

    def verdict(self) -> str | None:
        """What fails the test: the disagreements and oracle errors, or None."""
        with self._lock:
            lines = [str(d) for d in self.disagreements] + [
                f"oracle error: {e}" for e in self.errors
            ]
        if not lines:
            return None
        head = "the believer oracle found grants the database did not make:"
        return "\n  ".join([head, *lines])

    # --- observers --------------------------------------------------------------------------

    def _observe(
        self, server: Server, query: Any, params: tuple[Any, ...] | Callable[[], tuple[Any, ...]]
    ) -> list[Any]:
        """Run ``query`` on the observer of ``server`` (connected at its first use); a
        callable ``params`` is called just before it is sent (a time since the report)."""
        with self._lock:
            if self.closed:
                raise OracleError("the oracle was closed")
            found = self._observers.get(server)
            if found is None:
                host, port, dbname = server
                extra = {k: v for k, v in (("host", host), ("port", port), ("dbname", dbname)) if v}
                dsn = make_conninfo(self._server_dsn, application_name=OBSERVER_APP, **extra)
                conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
                found = self._observers[server] = (threading.Lock(), conn)
        lock, conn = found
        with lock:
            return conn.execute(query, params() if callable(params) else params).fetchall()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            observers, self._observers = list(self._observers.values()), {}
        for _, conn in observers:
            with contextlib.suppress(Exception):
                conn.close()

    # --- frames -----------------------------------------------------------------------------

    def _stack(self) -> list[_Frame]:
        stack: list[_Frame] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _push(self) -> _Frame:
        frame = _Frame()
        self._stack().append(frame)
        return frame

    def _pop(self, frame: _Frame) -> _Frame | None:
        stack = self._stack()
        stack.remove(frame)
        parent = stack[-1] if stack else None
        if parent is not None:
            parent.permits += frame.permits
            parent.verified += frame.verified
            parent.checked |= frame.checked
            parent.databases += frame.databases
        return parent

    def call(self, api: str, obj: Any, granted: Callable[[Any], bool], describe: Callable[..., Any],
             fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a wrapped pglock call on ``obj``); if ``granted(result)``, check the grant
        ``describe(obj, result, frame)`` says was made, before returning ``result``."""
        frame = self._push()
        try:
            result = fn()
        finally:
            parent = self._pop(frame)
        if not granted(result) or self.closed:
            return result
        reported = time.monotonic()
        if id(obj) in frame.checked:
            return result  # checked inside this call already (``with`` over ``acquire()``)
        try:
            describe(obj, result, frame, api, reported, parent)
        except Exception as exc:
            self.error(api, obj, exc)
        self._spent(reported)
        if parent is not None:
            parent.checked.add(id(obj))
        return result

    # --- what each kind claims, and the check -----------------------------------------------

    def lock_object(self, obj: Any, result: Any, frame: _Frame, api: str, reported: float,
                    parent: _Frame | None) -> None:
        """A lock object reported a grant (acquire True, ``with`` entered)."""
        if isinstance(obj, pglock.Lease):
            self.lease(obj, api, reported, frame)
        elif isinstance(obj, pglock.Semaphore):
            self.permit(_last_permit(obj, frame), api, reported, frame)
        elif isinstance(obj, pglock.Singleton):
            self.nested(obj, api, frame, pglock.key(obj.name), parent)
        else:
            conn, keys, exclusive = self._advisory_claim(obj)
            self.advisory(api, conn, keys, exclusive, parent)

    def _advisory_claim(self, obj: Any) -> tuple[Any, frozenset[int], bool]:
        args = self._args.get(obj)
        if isinstance(obj, pglock.PgLock) and args is not None:
            return args["conn"], frozenset(obj.keys), not obj.shared
        if isinstance(obj, pglock.PoolLock) and args is not None:
            return obj.connection, _keys(obj.names), not args["shared"]
        if args is not None and "rwlock" in args:  # a hold of RWLock.read() / write()
            rw = args["rwlock"]
            return obj.connection, frozenset([rw.key]), not args["shared"]
        raise OracleError(
            f"the oracle does not know what a {type(obj).__qualname__} grant claims: teach "
            "tests/_believer.py"
        )

    def advisory(self, api: str, conn_obj: Any, keys: frozenset[int], exclusive: bool,
                 parent: _Frame | None, *, xact: bool = False) -> None:
        conn = _psycopg(conn_obj)
        kind = "xact" if xact else "advisory"
        pid = _server_pid(conn)
        server = (str(conn.info.host), str(conn.info.port), str(conn.info.dbname))
        claimed = _advisory_text(pid, keys, exclusive)
        if xact and conn.info.transaction_status != TransactionStatus.INTRANS:
            self._count(kind, api)
            self._disagree(Disagreement(kind, api, claimed + " in the open transaction",
                                        f"the connection is {conn.info.transaction_status.name}"))
            return
        self._check_held(kind, api, server, pid, keys, exclusive, claimed)
        if parent is not None:
            parent.verified.append((server, pid, keys, exclusive))

    def _check_held(self, kind: str, api: str, server: Server, pid: int,
                    keys: frozenset[int], exclusive: bool, claimed: str) -> None:
        rows = self._observe(server, _ADVISORY, (sorted(keys),))
        self._count(kind, api)
        modes = {(k, m) for k, p, m in rows if p == pid}
        wanted = (X,) if exclusive else (X, S)
        missing = [k for k in sorted(keys) if not any((k, m) in modes for m in wanted)]
        if missing:
            seen = ", ".join(f"key {k}: pid {p} {m}" for k, p, m in rows) or "nobody holds them"
            self._disagree(Disagreement(kind, api, claimed,
                                        f"not held in that mode: keys {missing} ({seen})"))

    def nested(self, obj: Any, api: str, frame: _Frame, key: int, parent: _Frame | None) -> None:
        """A lock whose holding session is not public (a singleton): the advisory grant of
        ``key`` (exclusive) that a lock inside this call verified, still held now."""
        inner = [v for v in frame.verified if key in v[2] and v[3]]
        if not inner:
            self._count("advisory", api)
            self._disagree(Disagreement(
                "advisory", api, f"exclusive lock on key {key}",
                "no lock inside the call was seen granted that key (no session to check)",
            ))
            return
        server, pid, _, _ = inner[-1]
        self._check_held("advisory", api, server, pid, frozenset([key]), True,
                         _advisory_text(pid, frozenset([key]), True))
        if parent is not None:
            parent.verified.append((server, pid, frozenset([key]), True))

    def lease(self, lease: pglock.Lease, api: str, reported: float, frame: _Frame) -> None:
        believed = lease.locked
        claimed = (f"lease {lease.name!r} held by {lease.holder!r} with token {lease.token} "
                   f"(believed {'until after' if believed else 'not even at'} the report)")
        query = sql.SQL(_LEASE).format(sql.Identifier(lease.schema))
        rows = self._observe(_database(lease, frame), query,
                             lambda: (time.monotonic() - reported, lease.name))
        self._count("lease", api)
        row = rows[0] if rows else None
        if row is not None and (row[0], row[1]) == (lease.holder, lease.token):
            if row[2]:
                return
            if believed:
                self._disagree(Disagreement("lease", api, claimed,
                                            f"the row expired at {row[3]}, before the report"))
                return
        database = (
            "no row" if row is None else f"row of {row[0]!r} token {row[1]}, expires {row[3]}"
        )
        self._judge_gone("lease", api, claimed, database, still=lease.locked)

    def permit(self, permit: Any, api: str, reported: float, frame: _Frame) -> None:
        believed = permit.locked
        claimed = (f"{permit.permits} permit(s) of semaphore {permit.name!r} for holder "
                   f"{permit.holder!r}")
        query = sql.SQL(_PERMIT).format(sql.Identifier(permit._schema))
        rows = self._observe(_database(permit, frame), query,
                             lambda: (time.monotonic() - reported, permit.name, permit.holder))
        self._count("permit", api)
        row = rows[0] if rows else None
        if row is not None and row[0] == permit.permits and row[1]:
            return
        if row is not None and (row[0] != permit.permits or believed):
            self._disagree(Disagreement("permit", api, claimed,
                                        f"the row has {row[0]} permit(s), expires {row[2]}"))
            return
        database = "no row" if row is None else f"expired at {row[2]}"
        self._judge_gone("permit", api, claimed, database, still=permit.locked)

    def _judge_gone(self, kind: str, api: str, claimed: str, database: str, *, still: bool) -> None:
        """The row is not this grant's (any more): a disagreement while pglock still believes
        the grant when the answer is in, inconclusive once its own deadline had passed."""
        if still:
            self._disagree(Disagreement(kind, api, claimed, database))
        else:
            self._unsure(kind, f"{api}: {claimed}; {database}, and pglock had stopped "
                               "believing it (its deadline passed) before the oracle's answer")

    def leader(self, election: Any, api: str) -> None:
        session = election._session
        key = pglock.key(election.name)
        claimed = f"leader of {election.name!r}: session {session} holds key {key} exclusively"
        if session is None:
            self._unsure("leader", f"{api}: {election.name!r}: the term ended before the look")
            return
        pid, started = session
        rows = self._observe(("", "", ""), _LEADER, (key, pid))
        self._count("leader", api)
        # A start of None: pglock could not read it (no pg_read_all_stats), the pid alone counts.
        if rows and started in (None, rows[0][0]) and rows[0][1]:
            return
        database = ("no such session" if not rows else
                    f"session started {rows[0][0]}, holds it: {rows[0][1]}")
        if election._session != session:
            self._unsure("leader", f"{api}: {claimed}; {database}, but the term ended meanwhile")
            return
        self._disagree(Disagreement("leader", api, claimed, database))

    # --- installing -------------------------------------------------------------------------

    def remember(self, obj: Any, args: dict[str, Any]) -> None:
        with self._lock:
            self._args[obj] = args

    def frame_permit(self, permit: Any) -> None:
        stack = self._stack()
        if stack:
            stack[-1].permits.append(permit)

    def frame_database(self, conn: psycopg.Connection[Any]) -> None:
        stack = self._stack()
        if stack and not conn.closed:
            info = conn.info
            stack[-1].databases.append((str(info.host), str(info.port), str(info.dbname)))


def _keys(names: Any) -> frozenset[int]:
    return frozenset(pglock.key(n) for n in ([names] if isinstance(names, str) else names))


def _advisory_text(pid: int, keys: frozenset[int], exclusive: bool) -> str:
    return f"pid {pid} holds keys {sorted(keys)} {'exclusively' if exclusive else 'shared'}"


def _last_permit(sem: Any, frame: _Frame) -> Any:
    mine = [p for p in frame.permits if p.name == sem.name]
    if not mine:
        raise OracleError(f"semaphore {sem.name!r} reported a grant, but no permit was made")
    return mine[-1]


def _database(held: Any, frame: _Frame) -> Server:
    """Where the statements of the call that made the grant ran; else where the handle's
    source says it connects (an Engine made with ``creator=`` cannot say)."""
    if frame.databases:
        return frame.databases[-1]
    identity = held._source.database
    if len(identity) != 4 or identity[0] != "database":
        raise OracleError(f"cannot tell which database {held!r} is in ({identity!r})")
    return str(identity[1]), str(identity[2]), str(identity[3])


def _psycopg(obj: Any) -> psycopg.Connection[Any]:
    """The psycopg connection of what a lock was given or yields (psycopg, SQLAlchemy
    Connection or Session, Django connection), found without SQL."""
    if isinstance(obj, psycopg.Connection):
        return obj
    inner = getattr(obj, "connection", None)
    if isinstance(inner, psycopg.Connection):  # Django's wrapper
        return inner
    raw = getattr(inner, "driver_connection", None)  # SQLAlchemy Connection
    if raw is None and callable(inner):  # SQLAlchemy Session: its transaction's connection
        raw = inner().connection.driver_connection
    if isinstance(raw, psycopg.Connection):
        return raw
    raise OracleError(f"cannot find the psycopg connection of {obj!r}")


def _server_pid(conn: psycopg.Connection[Any]) -> int:
    """The pid of the server session: libpq's, unless pglock found a pooler in front (then
    the pid pglock probed on the server)."""
    from pglock import _conn

    state_for = getattr(_conn, "state_for", None)
    state = None if state_for is None else state_for(conn)
    if getattr(state, "pooler", False) and getattr(state, "backend_pid", None) is not None:
        return int(state.backend_pid)
    return int(conn.info.backend_pid)


# --- the wrappers -----------------------------------------------------------------------------


def _is_true(result: Any) -> bool:
    return result is True


def _returned(_result: Any) -> bool:
    return True


def _wrap_method(mp: pytest.MonkeyPatch, owner: type, attr: str, oracle: Believer,
                 granted: Callable[[Any], bool], describe: Callable[..., Any],
                 label: str | None = None) -> None:
    orig = owner.__dict__[attr]

    @functools.wraps(orig)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        api = label or f"{type(self).__name__}.{attr}"
        return oracle.call(api, self, granted, describe, lambda: orig(self, *args, **kwargs))

    wrapper._believer = True  # type: ignore[attr-defined]
    mp.setattr(owner, attr, wrapper)


def _remembering(mp: pytest.MonkeyPatch, owner: type, oracle: Believer) -> None:
    """Remember the arguments of ``owner(...)`` (what a grant of it will claim)."""
    orig = owner.__dict__["__init__"]
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        oracle.remember(self, dict(bound.arguments))

    mp.setattr(owner, "__init__", __init__)


def _tag_holds(mp: pytest.MonkeyPatch, oracle: Believer) -> None:
    for attr, shared in (("read", True), ("write", False)):
        orig = pglock.RWLock.__dict__[attr]

        def make(orig: Callable[..., Any], shared: bool) -> Callable[..., Any]:
            @functools.wraps(orig)
            def hold(self: Any, *args: Any, **kwargs: Any) -> Any:
                made = orig(self, *args, **kwargs)
                oracle.remember(made, {"rwlock": self, "shared": shared})
                return made

            return hold

        mp.setattr(pglock.RWLock, attr, make(orig, shared))


def _subclasses(cls: type) -> Iterator[type]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def base_lock() -> type:
    """The lock base class (where ``acquire`` and ``with`` are defined for every kind)."""
    return next(c for c in pglock.PgLock.__mro__ if "__enter__" in c.__dict__)


def _wrap_locks(mp: pytest.MonkeyPatch, oracle: Believer) -> None:
    for cls in _subclasses(base_lock()):
        if cls.__module__ not in ("pglock",) and not cls.__module__.startswith("pglock."):
            continue
        for attr, granted in (("acquire", _is_true), ("__enter__", _returned)):
            if attr in cls.__dict__:
                _wrap_method(mp, cls, attr, oracle, granted, oracle.lock_object)
    from pglock import _semaphore

    def held_permit(_hold: Any, permit: Any, frame: _Frame, api: str, reported: float,
                    _parent: _Frame | None) -> None:
        oracle.permit(permit, api, reported, frame)

    _wrap_method(mp, _semaphore._Hold, "__enter__", oracle, _returned, held_permit,
                 "Semaphore.hold().__enter__")
    orig_permit = pglock.Permit.__dict__["__init__"]

    @functools.wraps(orig_permit)
    def permit_init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_permit(self, *args, **kwargs)
        oracle.frame_permit(self)

    mp.setattr(pglock.Permit, "__init__", permit_init)
    from pglock import _conn

    fetch = _conn.fetch

    @functools.wraps(fetch)
    def watched(conn: psycopg.Connection[Any], *args: Any, **kwargs: Any) -> Any:
        oracle.frame_database(conn)
        return fetch(conn, *args, **kwargs)

    mp.setattr(_conn, "fetch", watched)
    _remembering(mp, pglock.PgLock, oracle)
    _remembering(mp, pglock.PoolLock, oracle)
    _tag_holds(mp, oracle)


def _wrap_xact(mp: pytest.MonkeyPatch, oracle: Believer) -> None:
    """``xact_lock`` (returns None when granted) and ``try_xact_lock`` (True), wherever pglock
    or a test module bound them."""
    for orig, granted in ((pglock.xact_lock, _returned), (pglock.try_xact_lock, _is_true)):
        signature = inspect.signature(orig)
        api = orig.__name__

        def make(orig: Callable[..., Any], granted: Callable[[Any], bool], api: str,
                 signature: inspect.Signature) -> Callable[..., Any]:
            def describe(_obj: Any, _result: Any, _frame: _Frame, api: str, _reported: float,
                         parent: _Frame | None, bound: inspect.BoundArguments) -> None:
                args = bound.arguments
                oracle.advisory(api, args["conn"], _keys(args["names"]), not args["shared"],
                                parent, xact=True)

            @functools.wraps(orig)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                try:
                    bound = signature.bind(*args, **kwargs)
                except TypeError:  # pglock says what is wrong with the arguments
                    return orig(*args, **kwargs)
                bound.apply_defaults()
                return oracle.call(api, object(), granted,
                                   functools.partial(describe, bound=bound),
                                   lambda: orig(*args, **kwargs))

            wrapper._believer = True  # type: ignore[attr-defined]
            return wrapper

        wrapped = make(orig, granted, api, signature)
        for module in _binding_modules():
            for attr, value in list(vars(module).items()):
                if value is orig:
                    mp.setattr(module, attr, wrapped)


#: Module name -> whether it is pglock's or a test module's (resolving paths is slow).
_OURS: dict[str, bool] = {}


def _binding_modules() -> Iterator[Any]:
    for name, module in list(sys.modules.items()):
        ours = _OURS.get(name)
        if ours is None:
            file = getattr(module, "__file__", None)
            ours = _OURS[name] = (
                name == "pglock" or name.startswith("pglock.")
                or bool(file and Path(file).resolve().is_relative_to(TESTS))
            )
        if ours and module is not None:
            yield module


def _wrap_leader(mp: pytest.MonkeyPatch, oracle: Believer) -> None:
    cls = pglock.LeaderElection
    is_leader = cls.__dict__["is_leader"].fget

    def check(election: Any, api: str) -> None:
        if oracle.closed:
            return
        since = time.monotonic()
        try:
            oracle.leader(election, api)
        except Exception as exc:
            oracle.error(api, election, exc)
        oracle._spent(since)

    @functools.wraps(is_leader)
    def leading(self: Any) -> bool:
        result: bool = is_leader(self)
        if result:
            check(self, "LeaderElection.is_leader")
        return result

    mp.setattr(cls, "is_leader", property(leading))
    wait_elected = cls.__dict__["wait_elected"]

    @functools.wraps(wait_elected)
    def waited(self: Any, *args: Any, **kwargs: Any) -> bool:
        result: bool = wait_elected(self, *args, **kwargs)
        if result:
            check(self, "LeaderElection.wait_elected")
        return result

    mp.setattr(cls, "wait_elected", waited)
    init = cls.__dict__["__init__"]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, on_elected: Any = None, **kwargs: Any) -> None:
        callback = on_elected
        if callable(callback):
            def elected() -> object:
                # on_elected runs on pglock's thread after the election; a term that already
                # ended (on_lost follows) is no claim any more.
                if is_leader(self):
                    check(self, "LeaderElection.on_elected")
                return callback()

            on_elected = elected
        init(self, *args, on_elected=on_elected, **kwargs)

    mp.setattr(cls, "__init__", __init__)


@contextlib.contextmanager
def believing(server_dsn: str) -> Iterator[Believer]:
    """Check every grant pglock reports while active (see the module docstring).

    :param server_dsn: a DSN of the test server (its user and password are the observers'; the
        host, port and database come from each lock's connection or source).
    """
    global _active
    if _active is not None:
        raise RuntimeError("the believer oracle is already active")
    oracle = Believer(server_dsn)
    since = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        _wrap_locks(mp, oracle)
        _wrap_xact(mp, oracle)
        _wrap_leader(mp, oracle)
        _active = oracle
        oracle._spent(since)
        try:
            yield oracle
        finally:
            since = time.monotonic()
            _active = None
            oracle.close()
            mp.undo()
            oracle.spent += time.monotonic() - since
