"""The oracles of shared/TESTING.md: what "nothing lost" means, checked against Postgres.

* **Lost-update counter and set** (Jepsen's lock-set): inside the critical section, over a
  *separate* autocommit connection, read the shared row, sleep 0-3 ms, write ``value + 1`` and
  the set with this operation's unique id appended. Never an atomic increment: row locks would
  serialise it and hide a broken lock. At the end the counter equals the number of acknowledged
  sections and the set equals the acknowledged ids.
* **Overlap audit**: each section inserts an ``enter_seq = nextval(...)`` row on entry and sets
  ``exit_seq = nextval(...)`` on exit; a self-join finds every pair of overlapping intervals
  (a sequence is a linearizable, real-time-ordered counter). Tokens, where a lock kind has
  them, must rise in ``enter_seq`` order.
* **Postgres truth**: what pglock believes a connection holds equals what ``pg_locks`` shows
  for that backend.

This module is also imported by the holder subprocesses (``holder.py``), so it imports nothing
from the test package.
"""

from __future__ import annotations

import itertools
import random
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

BIGINT_MAX = 9223372036854775807

# --- lost-update counter / set and overlap audit -------------------------------------------


@dataclass(frozen=True)
class Oracle:
    """Names of one run's oracle objects (tables and a sequence, unique per run)."""

    prefix: str

    @property
    def counter(self) -> sql.Identifier:
        return sql.Identifier(f"{self.prefix}_counter")

    @property
    def audit(self) -> sql.Identifier:
        return sql.Identifier(f"{self.prefix}_audit")

    @property
    def seq(self) -> sql.Identifier:
        return sql.Identifier(f"{self.prefix}_seq")

    @property
    def seq_name(self) -> sql.Literal:
        return sql.Literal(f"{self.prefix}_seq")

    @classmethod
    def create(cls, conn: psycopg.Connection[Any], prefix: str | None = None) -> Oracle:
        """Create the objects on ``conn`` (autocommit) and return their names."""
        o = cls(prefix or f"pglock_oracle_{uuid.uuid4().hex[:10]}")
        conn.execute(
            sql.SQL(
                "CREATE TABLE {c} (id int PRIMARY KEY, value bigint NOT NULL, ids text[] NOT NULL);"
                "INSERT INTO {c} VALUES (1, 0, '{{}}');"
                "CREATE SEQUENCE {s};"
                "CREATE TABLE {a} (id bigserial PRIMARY KEY, holder text NOT NULL, token bigint,"
                " enter_seq bigint NOT NULL, exit_seq bigint)"
            ).format(c=o.counter, s=o.seq, a=o.audit)
        )
        return o

    def drop(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(
            sql.SQL("DROP TABLE IF EXISTS {c}, {a}; DROP SEQUENCE IF EXISTS {s}").format(
                c=self.counter, a=self.audit, s=self.seq
            )
        )

    # -- inside the critical section (worker side) ---------------------------------------

    def enter(self, oconn: psycopg.Connection[Any], holder: str, token: int | None = None) -> int:
        row = oconn.execute(
            sql.SQL(
                "INSERT INTO {a} (holder, token, enter_seq) VALUES (%s, %s, nextval({s}))"
                " RETURNING id"
            ).format(a=self.audit, s=self.seq_name),
            (holder, token),
        ).fetchone()
        assert row is not None
        return int(row[0])

    def exit(self, oconn: psycopg.Connection[Any], audit_id: int) -> None:
        oconn.execute(
            sql.SQL("UPDATE {a} SET exit_seq = nextval({s}) WHERE id = %s").format(
                a=self.audit, s=self.seq_name
            ),
            (audit_id,),
        )

    def update(self, oconn: psycopg.Connection[Any], op_id: str, max_sleep: float = 0.003) -> None:
        """The non-atomic read-modify-write: read, sleep 0..max_sleep, write value+1 and id."""
        row = oconn.execute(
            sql.SQL("SELECT value, ids FROM {c} WHERE id = 1").format(c=self.counter)
        ).fetchone()
        assert row is not None
        value, ids = row
        time.sleep(random.uniform(0, max_sleep))
        oconn.execute(
            sql.SQL("UPDATE {c} SET value = %s, ids = %s WHERE id = 1").format(c=self.counter),
            (value + 1, [*ids, op_id]),
        )

    def section(
        self,
        oconn: psycopg.Connection[Any],
        holder: str,
        op_id: str,
        token: int | None = None,
        max_sleep: float = 0.003,
    ) -> None:
        """The whole critical-section body: audit enter, read-modify-write, audit exit."""
        audit_id = self.enter(oconn, holder, token)
        self.update(oconn, op_id, max_sleep)
        self.exit(oconn, audit_id)

    # -- after the run (checker side) -----------------------------------------------------

    def check(
        self, conn: psycopg.Connection[Any], acked: Iterable[str], *, closed_only: bool = False
    ) -> Verdict:
        """Compare the shared state with the acknowledged operations.

        ``closed_only``: count overlaps among finished sections only (a holder killed inside
        its section never writes its exit row)."""
        acked_list = list(acked)
        row = conn.execute(
            sql.SQL("SELECT value, ids FROM {c} WHERE id = 1").format(c=self.counter)
        ).fetchone()
        assert row is not None
        value, ids = row
        overlaps = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM {a} x JOIN {a} y ON x.id < y.id"
                " WHERE x.enter_seq < coalesce(y.exit_seq, {m})"
                "   AND y.enter_seq < coalesce(x.exit_seq, {m}){closed}"
            ).format(
                a=self.audit,
                m=sql.Literal(BIGINT_MAX),
                closed=sql.SQL(
                    " AND x.exit_seq IS NOT NULL AND y.exit_seq IS NOT NULL" if closed_only else ""
                ),
            )
        ).fetchone()
        intervals = conn.execute(
            sql.SQL("SELECT enter_seq, exit_seq, token FROM {a} ORDER BY enter_seq").format(
                a=self.audit
            )
        ).fetchall()
        assert overlaps is not None
        return Verdict(
            counter=int(value),
            ids=list(ids),
            acked=acked_list,
            overlaps=int(overlaps[0]),
            max_concurrency=max_concurrency([(e, x) for e, x, _ in intervals]),
            tokens=[t for _, _, t in intervals if t is not None],
        )


@dataclass
class Verdict:
    counter: int
    ids: list[str]
    acked: list[str]
    overlaps: int
    max_concurrency: int
    tokens: list[int] = field(default_factory=list)

    @property
    def lost(self) -> set[str]:
        """Acknowledged operations missing from the final set (lost updates)."""
        return set(self.acked) - set(self.ids)

    @property
    def phantom(self) -> set[str]:
        """Ids in the set that were never acknowledged."""
        return set(self.ids) - set(self.acked)

    @property
    def lost_increments(self) -> int:
        return len(self.acked) - self.counter

    @property
    def tokens_increasing(self) -> bool:
        return all(a < b for a, b in itertools.pairwise(self.tokens))

    @property
    def clean(self) -> bool:
        """No lost update, no phantom, no duplicate, no overlap."""
        return (
            self.counter == len(self.acked)
            and not self.lost
            and not self.phantom
            and len(self.ids) == len(set(self.ids))
            and self.overlaps == 0
        )

    def summary(self) -> str:
        return (
            f"acked={len(self.acked)} counter={self.counter} set={len(self.ids)} "
            f"lost={len(self.lost)} phantom={len(self.phantom)} overlaps={self.overlaps} "
            f"max_concurrency={self.max_concurrency}"
        )


def max_concurrency(intervals: Iterable[tuple[int, int | None]]) -> int:
    """The most intervals open at once (an open one, exit None, stays open)."""
    events: list[tuple[int, int]] = []
    for enter, exit_ in intervals:
        events.append((enter, 1))
        events.append((exit_ if exit_ is not None else BIGINT_MAX, -1))
    best = cur = 0
    for _, delta in sorted(events):
        cur += delta
        best = max(best, cur)
    return best


# --- Postgres truth ---------------------------------------------------------------------------

# No pg_database in here: it is a shared catalog, and locking it needs a slot in the shared
# lock table, which T24 fills. Filter by pid (a backend belongs to one database) instead.
_ADVISORY = (
    "SELECT l.pid, ((l.classid::bigint << 32) | l.objid::bigint) AS key, l.mode, l.granted"
    " FROM pg_catalog.pg_locks l"
    " WHERE l.locktype = 'advisory' AND l.objsubid = 1"
)


def advisory_locks(
    observer: psycopg.Connection[Any],
    *,
    pid: int | None = None,
    key: int | None = None,
    granted: bool | None = None,
) -> list[tuple[int, int, str]]:
    """(pid, key, mode) of advisory locks in this database, filtered by pid/key/granted."""
    rows = observer.execute(_ADVISORY).fetchall()
    return [
        (p, k, m)
        for p, k, m, g in rows
        if (pid is None or p == pid)
        and (key is None or k == key)
        and (granted is None or g == granted)
    ]


def holders(observer: psycopg.Connection[Any], key: int) -> list[int]:
    """Pids holding ``key`` (granted)."""
    return [p for p, _, _ in advisory_locks(observer, key=key, granted=True)]


def waiters(observer: psycopg.Connection[Any], key: int) -> list[int]:
    """Pids waiting for ``key`` (not granted)."""
    return [p for p, _, _ in advisory_locks(observer, key=key, granted=False)]


def held_by_app(observer: psycopg.Connection[Any], app_name: str) -> list[tuple[Any, ...]]:
    """Granted advisory locks of sessions whose application_name is ``app_name``."""
    return observer.execute(
        "SELECT a.pid, l.mode, ((l.classid::bigint << 32) | l.objid::bigint) AS key"
        " FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = %s",
        (app_name,),
    ).fetchall()


def believed(conn: psycopg.Connection[Any]) -> dict[int, str]:
    """Keys pglock believes this connection's session holds: key -> "x" or "s".

    Session locks from pglock's per-connection bookkeeping, plus transaction locks recorded
    for the transaction now open (none when the connection is idle)."""
    from pglock import _conn

    state = _conn.state_for(conn)
    with state.cond:
        out = {k: h.mode for k, h in state.holds.items() if not h.pending}
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            for k in state.xact:
                out.setdefault(k, "x")
    return out


def truth(observer: psycopg.Connection[Any], pid: int) -> dict[int, str]:
    """Keys ``pid`` holds in pg_locks: key -> "x" (ExclusiveLock) or "s" (ShareLock)."""
    return {
        k: ("x" if m == "ExclusiveLock" else "s")
        for _, k, m in advisory_locks(observer, pid=pid, granted=True)
    }


def assert_truth(conn: psycopg.Connection[Any], observer: psycopg.Connection[Any]) -> None:
    """pglock's belief about ``conn`` equals pg_locks for its backend (session locks)."""
    pid = conn.info.backend_pid
    seen = truth(observer, pid)
    think = believed(conn)
    assert think == seen, f"pglock believes {think}, pg_locks shows {seen} for pid {pid}"


# --- waiting on Postgres state ----------------------------------------------------------------


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str = "condition",
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# --- lease grant history (issue 13: the lease waiter queue) ----------------------------------

_LEASE_AUDIT = """
CREATE TABLE IF NOT EXISTS public.pglock_lease_audit (
    id bigserial PRIMARY KEY,
    op text NOT NULL,
    name text NOT NULL,
    old_holder text, old_token bigint, old_expires_at timestamptz,
    new_holder text, new_token bigint, new_acquired_at timestamptz, new_expires_at timestamptz,
    app text NOT NULL,
    at timestamptz NOT NULL
);
CREATE OR REPLACE FUNCTION public.pglock_lease_audit_row() RETURNS trigger
LANGUAGE plpgsql AS $a$
BEGIN
    INSERT INTO public.pglock_lease_audit (op, name, old_holder, old_token, old_expires_at,
        new_holder, new_token, new_acquired_at, new_expires_at, app, at)
    VALUES (TG_OP, coalesce(NEW.name, OLD.name),
        CASE WHEN TG_OP <> 'INSERT' THEN OLD.holder END,
        CASE WHEN TG_OP <> 'INSERT' THEN OLD.token END,
        CASE WHEN TG_OP <> 'INSERT' THEN OLD.expires_at END,
        CASE WHEN TG_OP <> 'DELETE' THEN NEW.holder END,
        CASE WHEN TG_OP <> 'DELETE' THEN NEW.token END,
        CASE WHEN TG_OP <> 'DELETE' THEN NEW.acquired_at END,
        CASE WHEN TG_OP <> 'DELETE' THEN NEW.expires_at END,
        current_setting('application_name'), clock_timestamp());
    RETURN NULL;
END
$a$;
"""


def install_lease_audit(conn: psycopg.Connection[Any], schema: str = "pglock") -> None:
    """Log every change of ``{schema}.lease`` rows (a test cluster only): who changed a grant,
    when on the database clock, from what to what. Idempotent."""
    conn.execute(_LEASE_AUDIT)
    conn.execute(
        sql.SQL(
            "CREATE OR REPLACE TRIGGER pglock_lease_audit AFTER INSERT OR UPDATE OR DELETE"
            " ON {}.lease FOR EACH ROW EXECUTE FUNCTION public.pglock_lease_audit_row()"
        ).format(sql.Identifier(schema))
    )


@dataclass
class Grant:
    """One grant of a lease (one token) as the audit log saw it."""

    holder: str
    token: int
    acquired_at: float
    expires_at: float  # the last expiry it was given (extends move it)
    made_by: int  # the audit row that made it
    ended_at: float | None = None  # when its row was deleted or given to another token
    ended_by: str | None = None  # the application_name of the session that did it
    ended_in: int | None = None  # the audit row that ended it


def lease_grants(conn: psycopg.Connection[Any], name: str) -> list[Grant]:
    """The grants of ``name`` in the order they were made (token 0 is a placeholder row before
    a token is drawn: not a grant). Times are seconds since the epoch on the database clock
    (floats: a placeholder's ``-infinity`` too). Changes of one row are serialized by
    its row lock, so the audit ids of one name follow the commit order."""
    rows = conn.execute(
        "SELECT id, op, old_token, new_holder, new_token, extract(epoch FROM new_acquired_at)"
        "::float8, extract(epoch FROM new_expires_at)::float8, app, extract(epoch FROM at)::float8"
        " FROM public.pglock_lease_audit WHERE name = %s ORDER BY id",
        (name,),
    ).fetchall()
    grants: list[Grant] = []
    for audit_id, op, old_token, holder, token, acquired, expires, app, at in rows:
        current = grants[-1] if grants and grants[-1].ended_at is None else None
        ends = op == "DELETE" or token != old_token
        if current is not None and current.token == old_token and ends:
            current.ended_at, current.ended_by, current.ended_in = at, app, audit_id
            current = None
        if op == "DELETE" or not token:
            continue
        if current is not None and current.token == token:
            current.expires_at = expires  # an extend (or a re-acquire) of the same grant
        else:
            grants.append(Grant(holder, token, acquired, expires, audit_id))
    return grants


def grant_violations(grants: list[Grant], app_of: Callable[[str], str]) -> list[str]:
    """What breaks "at most one unexpired lease per name at any instant of the database clock"
    and "strictly increasing tokens" in a grant history. A grant may end before its expiry
    only by its own holder's process (a release, maybe handing it to the next waiter in the
    same statement); ended by anyone else, it must have expired first. The next grant starts
    no earlier than the end or the expiry of the previous one, unless one row update did both
    (an atomic handoff). ``app_of(holder)`` is the application_name of the holder's process."""
    out: list[str] = []
    for a, b in itertools.pairwise(grants):
        if not a.token < b.token:
            out.append(f"token went back or repeated: {a.token} then {b.token}")
        if a.ended_in == b.made_by:
            continue
        end = a.expires_at if a.ended_at is None else min(a.expires_at, a.ended_at)
        if b.acquired_at < end:
            out.append(f"grant {b.token} made at {b.acquired_at} while {a.token} was live")
    for g in grants:
        early = g.ended_at is not None and g.ended_at < g.expires_at
        if early and g.ended_by != app_of(g.holder):
            out.append(
                f"grant {g.token} of {g.holder!r} ended at {g.ended_at} by {g.ended_by!r}, "
                f"before its expiry {g.expires_at}"
            )
    return out
