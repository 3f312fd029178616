"""A lock holder in its own process, driven over pipes (stdin/stdout, one JSON object a line).

Run by :class:`faults.procs.Holder`; the test kills (SIGKILL), pauses (SIGSTOP) and resumes
(SIGCONT) it. Every request gets exactly one reply ``{"ok": true, ...}`` or
``{"ok": false, "error": "<exception class>", "message": "..."}``.

Requests (``op``):

``connect`` ``{dsn, autocommit}``
    open the connection; replies ``pid`` (its backend pid).
``lock`` ``{kind, name, timeout}``
    take a lock of ``kind`` (see :data:`KINDS`) on the connection and keep it.
``release`` ``{name}``
    release it (session: ``release()``; transaction: ``commit``).
``sql`` ``{sql, params}``
    run a statement on the connection; replies ``rows``.
``prepare`` / ``go``
    the T01 workload: ``prepare`` opens ``threads`` pairs of connections (lock, oracle),
    ``go`` runs ``iterations`` critical sections per thread and replies the acknowledged ids.
``exit``
    close and exit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import psycopg

import pglock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracles import Oracle

_out_lock = threading.Lock()


def reply(obj: dict[str, Any]) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(obj, default=str) + "\n")
        sys.stdout.flush()


def error_reply(exc: BaseException) -> dict[str, Any]:
    return {
        "ok": False,
        "error": type(exc).__name__,
        "module": type(exc).__module__,
        "message": str(exc),
        "sqlstate": getattr(exc, "sqlstate", None),
    }


# --- lock kinds ---------------------------------------------------------------------------------
# A kind is a context manager factory (conn, name, ctx) -> yields a fencing token or None.
# ``ctx`` carries per-process resources (dsn, pools) that some kinds need.


@contextlib.contextmanager
def _none(conn: psycopg.Connection[Any], name: str, ctx: dict[str, Any]) -> Iterator[int | None]:
    yield None


@contextlib.contextmanager
def _session(conn: psycopg.Connection[Any], name: str, ctx: dict[str, Any]) -> Iterator[int | None]:
    with pglock.pg_lock(conn, name, timeout=ctx.get("timeout")):
        yield None


@contextlib.contextmanager
def _xact(conn: psycopg.Connection[Any], name: str, ctx: dict[str, Any]) -> Iterator[int | None]:
    with conn.transaction():
        pglock.xact_lock(conn, name, timeout=ctx.get("timeout"))
        yield None


@contextlib.contextmanager
def _raw_session(
    conn: psycopg.Connection[Any], name: str, ctx: dict[str, Any]
) -> Iterator[int | None]:
    """Raw pg_advisory_lock, no pglock: the negative control for threads sharing a connection
    (Postgres grants a session's lock again to every thread on it)."""
    k = pglock.key(name)
    conn.execute("SELECT pg_advisory_lock(%s)", (k,))
    try:
        yield None
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (k,))


@contextlib.contextmanager
def _pool(conn: psycopg.Connection[Any], name: str, ctx: dict[str, Any]) -> Iterator[int | None]:
    """pglock.pool_lock on the process's psycopg_pool pool (``conn`` is not used)."""
    with pglock.pool_lock(ctx["pool"], name, timeout=ctx.get("timeout")):  # type: ignore[attr-defined]
        yield None


@contextlib.contextmanager
def _lease(conn: psycopg.Connection[Any], name: str, ctx: dict[str, Any]) -> Iterator[int | None]:
    lease = pglock.lease  # type: ignore[attr-defined]
    with lease(ctx["source"], name, ttl=ctx.get("ttl", 30), timeout=ctx.get("timeout")) as held:
        yield int(held.token)


@contextlib.contextmanager
def _semaphore(
    conn: psycopg.Connection[Any], name: str, ctx: dict[str, Any]
) -> Iterator[int | None]:
    sem = pglock.semaphore(ctx["source"], name, limit=ctx["limit"])  # type: ignore[attr-defined]
    if not sem.acquire(timeout=ctx.get("timeout")):
        raise pglock.LockNotAcquired(name, timeout=ctx.get("timeout"))
    try:
        yield None
    finally:
        sem.release()


@contextlib.contextmanager
def _rwlock(conn: psycopg.Connection[Any], name: str, ctx: dict[str, Any]) -> Iterator[int | None]:
    """A read-write lock on the process's pool: 20 % writers. Yields 1 for a writer, 0 for a
    reader (recorded as the audit row's token)."""
    import random

    rw = pglock.rwlock(ctx["pool"], name)  # type: ignore[attr-defined]
    if random.random() < 0.2:
        with rw.write(timeout=ctx.get("timeout")):
            yield 1
    else:
        with rw.read(timeout=ctx.get("timeout")):
            yield 0


KINDS: dict[str, Callable[..., contextlib.AbstractContextManager[int | None]]] = {
    "none": _none,
    "session": _session,
    "xact": _xact,
    "raw_session": _raw_session,
    "pool": _pool,
    "semaphore": _semaphore,
    "rwlock": _rwlock,
    "lease": _lease,
}


# --- the T01 workload ---------------------------------------------------------------------------


class Workload:
    def __init__(self, req: dict[str, Any]) -> None:
        self.req = req
        self.oracle = Oracle(req["oracle"])
        self.kind = KINDS[req["kind"]]
        self.go = threading.Event()
        self.acked: list[str] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.conns: list[tuple[Any, psycopg.Connection[Any]]] = []
        app = req["app"]
        shared = None
        if req.get("share_conn"):
            shared = psycopg.connect(req["dsn"], autocommit=True, application_name=app)
        for _ in range(req["threads"]):
            c: Any = shared
            if c is None and req["kind"] not in ("pool", "rwlock"):  # these check out their own
                c = psycopg.connect(req["dsn"], autocommit=True, application_name=app)
            o = psycopg.connect(req["dsn"], autocommit=True, application_name=app + ":oracle")
            self.conns.append((c, o))
        self.ctx: dict[str, Any] = {"source": req["dsn"], "timeout": req.get("timeout")}
        self.ctx["limit"] = req.get("limit")
        if req["kind"] in ("pool", "rwlock"):
            from psycopg_pool import ConnectionPool

            self.ctx["pool"] = ConnectionPool(
                req["dsn"],
                min_size=req["threads"],
                max_size=req["threads"],
                kwargs={"autocommit": True, "application_name": app},
                reset=pglock.reset_connection,  # type: ignore[attr-defined]
                open=True,
            )
        if req.get("ttl"):
            self.ctx["ttl"] = req["ttl"]
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True)
            for i in range(req["threads"])
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        conn, oconn = self.conns[i]
        worker = f"{self.req['worker']}.{i}"
        if not self.go.wait(60):
            return
        for n in range(self.req["iterations"]):
            op_id = f"{worker}.{n}"
            try:
                with self.kind(conn, self.req["name"], self.ctx) as token:
                    self.oracle.section(
                        oconn, worker, op_id, token, self.req.get("max_sleep", 0.003)
                    )
                with self.lock:
                    self.acked.append(op_id)
            except Exception as exc:
                with self.lock:
                    self.errors.append(f"{op_id}: {type(exc).__name__}: {exc}")

    def run(self) -> dict[str, Any]:
        self.go.set()
        for t in self.threads:
            t.join(300)
        for c, o in self.conns:
            if c is not None:
                c.close()
            o.close()
        if "pool" in self.ctx:
            self.ctx["pool"].close()
        return {"ok": True, "acked": self.acked, "errors": self.errors}


# --- the T27 soak ----------------------------------------------------------------------------


def _soak_connect(req: dict[str, Any]) -> psycopg.Connection[Any] | None:
    """A new session for the soak, or None if the server does not take one now."""
    try:
        return psycopg.connect(
            req["dsn"], autocommit=True, application_name=req["app"], connect_timeout=2
        )
    except psycopg.OperationalError:
        return None


def _soak_acquire(
    conn: psycopg.Connection[Any], kind: str, name: str, timeout: float
) -> tuple[bool, pglock.PgLock | None]:
    """One acquire attempt: (got it, the session lock to release or None)."""
    if kind == "none":  # the negative control: no lock at all
        return True, None
    if kind == "session":
        lock = pglock.pg_lock(conn, name, timeout=timeout)
        return lock.acquire(), lock
    conn.execute("BEGIN")
    try:
        pglock.xact_lock(conn, name, timeout=timeout)
        return True, None
    except pglock.LockNotAcquired:
        conn.execute("ROLLBACK")
        return False, None


def _soak_section(oracle: Oracle, conn: psycopg.Connection[Any], p: str, op_id: str) -> bool:
    """The critical section; whether it completed."""
    try:
        oracle.section(conn, p, op_id, None, 0.004)
        return True
    except Exception:
        return False


def _soak_release(conn: psycopg.Connection[Any], kind: str, lock: pglock.PgLock | None) -> None:
    if kind == "session":
        assert lock is not None
        lock.release()
    elif kind == "xact":
        conn.execute("COMMIT")


def soak(req: dict[str, Any]) -> dict[str, Any]:
    """Random acquire / critical section / release on a few names until the deadline, logging
    every invoke and completion to a history file (flushed per line, so a SIGKILL loses
    nothing that happened). The critical section runs on the lock's own session (session kind)
    or in its transaction (xact kind): session-bound writes are fenced even under faults."""
    import random
    import time

    rng = random.Random(req["seed"])
    deadline = time.monotonic() + req["seconds"]
    kind = req["kind"]
    names: list[str] = req["names"]
    oracles = {n: Oracle(p) for n, p in zip(names, req["oracles"], strict=True)}
    hist = open(req["history"], "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    conn: psycopg.Connection[Any] | None = None
    gen = 0
    seq = 0

    def log(**ev: Any) -> None:
        ev["t"] = time.monotonic()
        hist.write(json.dumps(ev) + "\n")

    def drop() -> None:
        nonlocal conn
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        conn = None

    while time.monotonic() < deadline:
        if conn is None or conn.closed or conn.broken:
            new = _soak_connect(req)
            if new is None:
                time.sleep(0.05)
                continue
            conn = new
            gen += 1
        p = f"{os.getpid()}:{gen}"
        name = rng.choice(names)
        timeout = rng.choice([0.0, 0.05, 0.2])
        seq += 1
        op_id = f"{p}:{seq}"
        log(p=p, name=name, f="acquire", ev="invoke", op=op_id)
        try:
            ok, lock = _soak_acquire(conn, kind, name, timeout)
        except Exception as exc:
            log(p=p, name=name, f="acquire", ev="info", error=type(exc).__name__)
            drop()  # the session ends, and with it anything the attempt may have got
            continue
        log(p=p, name=name, f="acquire", ev="ok" if ok else "fail")
        if not ok:
            time.sleep(rng.uniform(0, 0.005))
            continue
        section_ok = _soak_section(oracles[name], conn, p, op_id)
        log(p=p, name=name, f="release", ev="invoke")
        try:
            _soak_release(conn, kind, lock)
            log(p=p, name=name, f="release", ev="ok", op=op_id, acked=section_ok)
        except Exception as exc:
            # Lost some time after the acquire (session ended, transaction rolled back or an
            # unknown COMMIT outcome): the section is not acknowledged.
            log(p=p, name=name, f="release", ev="lost", op=op_id, error=type(exc).__name__)
            drop()
    drop()
    hist.close()
    return {"ok": True, "generations": gen, "ops": seq}


# --- T22: a leader-election candidate --------------------------------------------------------


def candidate(req: dict[str, Any]) -> Any:
    """Start a candidate in the background; log its beliefs to a history file: callbacks,
    and every change of ``is_leader`` seen by a 5 ms poller (monotonic times, flushed)."""
    import time

    hist = open(req["history"], "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    lock = threading.Lock()

    def log(ev: str, term: Any) -> None:
        with lock:
            hist.write(json.dumps({"ev": ev, "t": time.monotonic(), "term": term}) + "\n")

    holder: dict[str, Any] = {}
    election = pglock.leader(  # type: ignore[attr-defined]
        req["dsn"],
        req["name"],
        on_elected=lambda: log("elected", holder["e"].term),
        on_lost=lambda: log("lost", holder["e"].term),
        check_interval=req.get("check_interval", 0.2),
    )
    holder["e"] = election

    def poll() -> None:
        was = False
        while True:
            now = bool(election.is_leader)
            if now != was:
                log("believes" if now else "doubts", election.term)
                was = now
            time.sleep(0.005)

    election.start()
    threading.Thread(target=poll, daemon=True).start()
    return election


# --- issue 13: queued lease waiters (test_lease_queue.py) -----------------------------------


class QueueWaiter:
    """A lease waiter in a thread of this process, logging what it believes to a history file.

    Events (JSON lines, monotonic ``t``, flushed per line so a SIGKILL loses nothing):
    ``invoke`` (acquire sent; ``wait`` is its timeout), ``granted`` (acquire returned True,
    with ``token``), ``refused`` (it returned False), ``error``, ``believes`` / ``doubts`` (a
    2 ms poller of ``locked``, with the token and the client deadline), ``on_lost``,
    ``release`` (about to call release()), ``released`` or ``release_error``. With ``hold``
    set it releases by itself that long after its grant."""

    def __init__(self, req: dict[str, Any], hist: Any, out_lock: threading.Lock) -> None:
        self.req = req
        self.hist = hist
        self.out_lock = out_lock
        self.done = threading.Event()
        self.lease = pglock.lease(  # type: ignore[attr-defined]
            req["source"],
            req["name"],
            ttl=req.get("ttl", 30),
            holder=req["holder"],
            keepalive=req.get("keepalive", True),
            on_lost=lambda _lease: self.log("on_lost"),
        )
        threading.Thread(target=self._run, daemon=True).start()
        threading.Thread(target=self._poll, daemon=True).start()

    def log(self, ev: str, **kw: Any) -> None:
        import time

        kw.update(ev=ev, t=time.monotonic(), holder=self.req["holder"])
        with self.out_lock:
            self.hist.write(json.dumps(kw, default=str) + "\n")
            self.hist.flush()

    def _run(self) -> None:
        import time

        self.log("invoke")
        # ``retry``: what an application does when the server went away (a restart): acquire
        # again with the same handle, until the wait's own deadline.
        wait = self.req.get("wait")
        until = None if wait is None else time.monotonic() + wait
        while True:
            try:
                left = None if until is None else max(0.0, until - time.monotonic())
                ok = self.lease.acquire(timeout=left)
                break
            except Exception as exc:
                self.log("error", error=type(exc).__name__, message=str(exc))
                if not (self.req.get("retry") and isinstance(exc, psycopg.OperationalError)):
                    self.done.set()
                    return
                time.sleep(0.1)
        if not ok:
            self.log("refused")
            self.done.set()
            return
        self.log("granted", token=self.lease.token, acquired_at=self.lease.acquired_at)
        if self.req.get("hold") is not None:
            time.sleep(self.req["hold"])
            self.release()
        self.done.set()

    def _poll(self) -> None:
        import time

        was = False
        while not self.done.is_set() or was:
            now = bool(self.lease.locked)
            if now != was:
                deadline = self.lease._deadline  # the client's own deadline (monotonic)
                self.log("believes" if now else "doubts", token=self.lease.token,
                         deadline=deadline if math.isfinite(deadline) else None)
                was = now
            time.sleep(0.002)

    def release(self) -> dict[str, Any]:
        self.log("release", token=self.lease.token)
        try:
            self.lease.release()
        except Exception as exc:
            self.log("release_error", error=type(exc).__name__)
            return error_reply(exc)
        self.log("released")
        return {"ok": True}


def _log_pglock(path: str) -> None:
    """pglock's INFO messages (why an acquire gave up, a failed leave or give-back) to ``path``,
    stamped with the monotonic clock of the histories."""
    import logging
    import time

    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(mono).4f %(process)d %(name)s %(message)s"))
    handler.addFilter(lambda record: setattr(record, "mono", time.monotonic()) or True)
    root = logging.getLogger("pglock")
    root.setLevel(logging.INFO)
    root.addHandler(handler)


def lease_soak(req: dict[str, Any]) -> dict[str, Any]:
    """The T27 loop on queued leases: acquire (timeouts of ``req["timeouts"]``, queued when not
    0), a critical section in one transaction fenced by ``guard()`` on a connection of its own,
    release; history events as :func:`soak` writes them. A section whose guard or commit fails
    is not acknowledged (it was rolled back, or its outcome is unknown)."""
    import random
    import time

    rng = random.Random(req["seed"])
    deadline = time.monotonic() + req["seconds"]
    names: list[str] = req["names"]
    oracles = {n: Oracle(p) for n, p in zip(names, req["oracles"], strict=True)}
    hist = open(req["history"], "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    p = f"{os.getpid()}"
    _log_pglock(req["history"] + ".log")
    seq = 0
    conn: psycopg.Connection[Any] | None = None

    def log(**ev: Any) -> None:
        ev["t"] = time.monotonic()
        hist.write(json.dumps(ev) + "\n")

    while time.monotonic() < deadline:
        if conn is None or conn.closed or conn.broken:
            conn = _soak_connect(req)
            if conn is None:
                time.sleep(0.05)
                continue
        name = rng.choice(names)
        seq += 1
        op_id = f"{p}:{seq}"
        lease = pglock.lease(  # type: ignore[attr-defined]
            req["source"], name, ttl=req["ttl"], holder=f"{req['app']}#{op_id}"
        )
        log(p=p, name=name, f="acquire", ev="invoke", op=op_id)
        try:
            ok = lease.acquire(timeout=rng.choice(req["timeouts"]))
        except Exception as exc:
            log(p=p, name=name, f="acquire", ev="info", op=op_id, error=type(exc).__name__,
                message=str(exc)[:200])
            time.sleep(0.05)  # the server is away (restart): do not pile up unknown outcomes
            continue
        log(p=p, name=name, f="acquire", ev="ok" if ok else "fail", op=op_id,
            why=None if ok else lease._why_not)
        if not ok:
            continue
        section_ok = False
        try:
            with conn.transaction():
                lease.guard(conn)
                oracles[name].section(conn, p, op_id, lease.token, 0.004)
            section_ok = True
        except Exception:
            if conn.closed or conn.broken:
                conn = None
        log(p=p, name=name, f="release", ev="invoke")
        try:
            lease.release()
            log(p=p, name=name, f="release", ev="ok", op=op_id, acked=section_ok)
        except Exception as exc:
            # Lost (expired, taken over) or no answer: released at some time since the acquire.
            log(p=p, name=name, f="release", ev="lost", op=op_id, error=type(exc).__name__)
    hist.close()
    return {"ok": True, "ops": seq}


# --- the request loop ---------------------------------------------------------------------------


class Holder:
    def __init__(self) -> None:
        self.conn: psycopg.Connection[Any] | None = None
        self.locks: dict[str, Any] = {}
        self.workload: Workload | None = None
        self.stack = contextlib.ExitStack()
        self.waiters: dict[str, QueueWaiter] = {}
        self.history: Any = None
        self.history_lock = threading.Lock()

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        # An op that is not a string (even an unhashable one) is unknown, as any other.
        handler = self.OPS.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ValueError(f"unknown op {op!r}")
        return handler(self, req)

    def _connect(self, req: dict[str, Any]) -> dict[str, Any]:
        self.conn = psycopg.connect(
            req["dsn"],
            autocommit=req.get("autocommit", True),
            application_name=req.get("app", "pglock-fault-holder"),
        )
        return {"ok": True, "pid": self.conn.info.backend_pid}

    def _lock(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.conn is not None
        kind, name = req["kind"], req["name"]
        if kind in ("session", "session_shared"):
            return self._lock_session(self.conn, kind, name, req)
        if kind == "xact":
            return self._lock_xact(self.conn, name, req)
        if kind == "lease":
            return self._lock_lease(name, req)
        return self._lock_kind(self.conn, kind, name, req)

    def _lock_session(
        self, conn: psycopg.Connection[Any], kind: str, name: str, req: dict[str, Any]
    ) -> dict[str, Any]:
        lock = pglock.pg_lock(
            conn, name, shared=kind == "session_shared", timeout=req.get("timeout")
        )
        if not lock.acquire():
            return {"ok": False, "error": "LockNotAcquired", "message": "timeout"}
        self.locks[name] = lock
        return {"ok": True}

    def _lock_xact(
        self, conn: psycopg.Connection[Any], name: str, req: dict[str, Any]
    ) -> dict[str, Any]:
        if conn.autocommit:
            conn.execute("BEGIN")
        pglock.xact_lock(conn, name, timeout=req.get("timeout"))
        self.locks[name] = "xact"
        return {"ok": True}

    def _lock_lease(self, name: str, req: dict[str, Any]) -> dict[str, Any]:
        held = pglock.lease(  # type: ignore[attr-defined]
            req["source"],
            name,
            ttl=req.get("ttl", 30),
            timeout=req.get("timeout"),
            keepalive=req.get("keepalive", True),
        )
        held.__enter__()
        self.locks[name] = held
        return {"ok": True, "token": held.token}

    def _lock_kind(
        self, conn: psycopg.Connection[Any], kind: str, name: str, req: dict[str, Any]
    ) -> dict[str, Any]:
        cm = KINDS[kind](
            conn,
            name,
            {
                "source": req.get("source"),
                "ttl": req.get("ttl"),
                "timeout": req.get("timeout"),
            },
        )
        token = self.stack.enter_context(cm)
        self.locks[name] = cm
        return {"ok": True, "token": token}

    def _release(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.conn is not None
        held = self.locks.pop(req["name"])
        if held == "xact":
            self.conn.commit() if not self.conn.autocommit else self.conn.execute("COMMIT")
        elif isinstance(held, pglock.PgLock):
            held.release()
        else:
            held.__exit__(None, None, None)
        return {"ok": True}

    def _sql(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.conn is not None
        cur = self.conn.execute(req["sql"], req.get("params"))
        rows = cur.fetchall() if cur.description else []
        return {"ok": True, "rows": rows}

    def _prepare(self, req: dict[str, Any]) -> dict[str, Any]:
        self.workload = Workload(req)
        return {"ok": True}

    def _go(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.workload is not None
        return self.workload.run()

    def _lease_check(self, req: dict[str, Any]) -> dict[str, Any]:
        self.locks[req["name"]].check()
        return {"ok": True}

    def _lease_write(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.conn is not None
        held = self.locks[req["name"]]
        with self.conn.transaction():
            if req.get("guard", True):
                held.guard(self.conn)
            self.conn.execute(req["sql"], req.get("params"))
        return {"ok": True}

    def _candidate(self, req: dict[str, Any]) -> dict[str, Any]:
        self.locks["candidate"] = candidate(req)
        return {"ok": True}

    def _soak(self, req: dict[str, Any]) -> dict[str, Any]:
        return soak(req)

    def _ping(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    def _queue_wait(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.history is None:
            self.history = open(req["history"], "a", encoding="utf-8")  # noqa: SIM115
        self.waiters[req["holder"]] = QueueWaiter(req, self.history, self.history_lock)
        return {"ok": True}

    def _queue_release(self, req: dict[str, Any]) -> dict[str, Any]:
        return self.waiters[req["holder"]].release()

    def _lease_soak(self, req: dict[str, Any]) -> dict[str, Any]:
        return lease_soak(req)

    OPS: ClassVar[dict[str, Callable[[Holder, dict[str, Any]], dict[str, Any]]]] = {
        "connect": _connect,
        "lock": _lock,
        "release": _release,
        "sql": _sql,
        "prepare": _prepare,
        "go": _go,
        "lease_check": _lease_check,
        "lease_write": _lease_write,
        "candidate": _candidate,
        "soak": _soak,
        "ping": _ping,
        "queue_wait": _queue_wait,
        "queue_release": _queue_release,
        "lease_soak": _lease_soak,
    }


def main() -> None:
    holder = Holder()
    reply({"ok": True, "ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req["op"] == "exit":
            reply({"ok": True})
            break
        try:
            out = holder.handle(req)
        except BaseException as exc:  # report everything; the test decides
            out = error_reply(exc)
            out["traceback"] = traceback.format_exc()
        reply(out)
    if holder.conn is not None:
        with contextlib.suppress(Exception):
            holder.conn.close()


if __name__ == "__main__":
    main()
