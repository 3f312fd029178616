"""Semaphores: the stored limit of each semaphore and its permit rows, and their functions.

Revision ID: pglock_0002
Revises: pglock_0001

Objects, all in the pglock schema (default ``pglock``):

* ``semaphore``: one row per semaphore name with its limit (``max_permits``), stored by the
  first acquire; every later acquire must pass the same limit (SQLSTATE ``PGL01`` otherwise).
  ``waiters`` is set by a refused acquire that will wait, so that a release sends a NOTIFY
  only when somebody listens for it.
* ``semaphore_permit``: one row per holder (a unique id per acquisition) with its weight
  (``permits``) and ``expires_at``; a holder's keepalive renews it. An expired row counts for
  nothing and is deleted by the next acquire: a crashed holder's permits come back within its
  TTL.
* functions ``semaphore_acquire``, ``semaphore_extend``, ``semaphore_release`` and
  ``semaphore_info``. ``semaphore_acquire`` locks the semaphore row (``FOR UPDATE``), so the
  admissions of one semaphore are serialized and the sum of live permits never exceeds the
  limit; it refuses to run outside READ COMMITTED, where its reads could miss a concurrent
  grant. Time is ``clock_timestamp()``; every function pins its ``search_path``, is
  ``SECURITY DEFINER`` (like the lease functions: application roles need ``EXECUTE``, not table
  privileges) and is not executable by ``PUBLIC``.

Leader election needs nothing here (its terms are transaction ids), nor do read-write locks or
singleton jobs (advisory locks).

The statements are idempotent and run under the same transaction-level advisory lock as the
first revision (``pglock:install:<schema>``), so concurrent installs serialize.
"""

from __future__ import annotations

from psycopg import sql

from pglock._contract import LIMIT_MISMATCH, MAX_TTL, install_lock_key, semaphore_channel
from pglock.migrations import alembic_execute, alembic_schema

revision = "pglock_0002"
down_revision = "pglock_0001"
branch_labels = None
depends_on = None

def _names(schema: str) -> dict[str, sql.Composable]:
    s = sql.Identifier(schema)
    return {
        "s": s,
        "channel": sql.Literal(semaphore_channel(schema)),
        "rev": sql.Literal(revision),
        "lock": sql.Literal(install_lock_key(schema)),
        "max_ttl": sql.Literal(MAX_TTL),
        "mismatch": sql.Literal(LIMIT_MISMATCH),
        # The downgrade's refusal to drop live permits (dynamic SQL: the table may be gone).
        "permit_table": sql.Literal(f"{s.as_string(None)}.semaphore_permit"),
        "lock_permits": sql.Literal(
            sql.SQL("LOCK TABLE {0}.semaphore, {0}.semaphore_permit IN ACCESS EXCLUSIVE MODE")
            .format(s)
            .as_string(None)
        ),
        "count_live": sql.Literal(
            sql.SQL(
                "SELECT count(*) FROM {}.semaphore_permit"
                " WHERE expires_at > pg_catalog.clock_timestamp()"
            ).format(s).as_string(None)
        ),
    }


#: The signatures of this revision's functions (for REVOKE).
FUNCTIONS = (
    "semaphore_acquire(text, integer, text, integer, double precision, jsonb, boolean)",
    "semaphore_extend(text, text[], double precision)",
    "semaphore_release(text, text)",
    "semaphore_info(text)",
)


_ACQUIRE = """
CREATE OR REPLACE FUNCTION {s}.semaphore_acquire(
    p_name text,
    p_limit integer,
    p_holder text,
    p_permits integer,
    p_ttl double precision,
    p_metadata jsonb DEFAULT NULL,
    p_wait boolean DEFAULT false)
RETURNS TABLE (granted boolean, max_permits integer, held integer, expires_at timestamptz,
               retry_in double precision, server_time timestamptz)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_limit integer;
    v_waiters boolean;
    v_now timestamptz;
    v_held integer;
    v_next timestamptz;
BEGIN
    IF p_name IS NULL OR p_name = '' OR p_holder IS NULL OR p_holder = ''
       OR p_limit IS NULL OR p_limit < 1 OR p_permits IS NULL OR p_permits < 1
       OR p_permits > p_limit OR p_ttl IS NULL OR NOT (p_ttl > 0 AND p_ttl <= {max_ttl}) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'pglock semaphore_acquire: invalid '
            'argument (name and holder non-empty, 1 <= permits <= limit, '
            '0 < ttl <= {max_ttl} seconds)';
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- Under a snapshot older than the row lock, a concurrent grant would be invisible.
        RAISE EXCEPTION USING ERRCODE = '25001', MESSAGE = 'pglock semaphore_acquire must run '
            'in a READ COMMITTED transaction, not ' || current_setting('transaction_isolation');
    END IF;

    -- The first acquire stores the limit; a concurrent first acquire waits here for the
    -- other's row, then finds it.
    INSERT INTO {s}.semaphore AS m (name, max_permits)
    VALUES (p_name, p_limit)
    ON CONFLICT (name) DO NOTHING;
    SELECT m.max_permits, m.waiters INTO v_limit, v_waiters
      FROM {s}.semaphore AS m
     WHERE m.name = p_name
       FOR UPDATE;
    IF v_limit <> p_limit THEN
        RAISE EXCEPTION USING ERRCODE = {mismatch},
            MESSAGE = format('pglock semaphore %L has limit %s, not %s', p_name, v_limit,
                             p_limit);
    END IF;

    v_now := clock_timestamp();
    DELETE FROM {s}.semaphore_permit AS p
     WHERE p.semaphore = p_name AND p.expires_at <= v_now;
    SELECT coalesce(sum(p.permits), 0)::integer, min(p.expires_at)
      INTO v_held, v_next
      FROM {s}.semaphore_permit AS p
     WHERE p.semaphore = p_name;

    IF v_held + p_permits <= v_limit THEN
        INSERT INTO {s}.semaphore_permit AS p
               (semaphore, holder, permits, acquired_at, expires_at, metadata)
        VALUES (p_name, p_holder, p_permits, v_now, v_now + make_interval(secs => p_ttl),
                p_metadata);
        RETURN QUERY SELECT true, v_limit, v_held + p_permits,
                            v_now + make_interval(secs => p_ttl), NULL::double precision,
                            v_now;
        RETURN;
    END IF;

    IF p_wait AND NOT v_waiters THEN
        UPDATE {s}.semaphore AS m SET waiters = true WHERE m.name = p_name;
    END IF;
    -- A refused attempt changes nothing that needs a durable commit.
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY SELECT false, v_limit, v_held, NULL::timestamptz,
                        greatest(0, extract(epoch FROM v_next - clock_timestamp()))
                            ::double precision,
                        v_now;
END
$pglock$
"""

_EXTEND = """
CREATE OR REPLACE FUNCTION {s}.semaphore_extend(
    p_name text,
    p_holders text[],
    p_ttl double precision)
RETURNS TABLE (holder text, expires_at timestamptz)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
BEGIN
    IF p_ttl IS NULL OR NOT (p_ttl > 0 AND p_ttl <= {max_ttl}) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'pglock semaphore_extend: ttl must be > 0 and <= {max_ttl} seconds';
    END IF;
    -- Renews the live permits among p_holders; an expired or released one is not returned.
    -- Durable on purpose: after a crash the server must not think a permit ends sooner than
    -- its holder does.
    RETURN QUERY
    UPDATE {s}.semaphore_permit AS p
       SET expires_at = clock_timestamp() + make_interval(secs => p_ttl)
     WHERE p.semaphore = p_name AND p.holder = ANY (p_holders)
       AND p.expires_at > clock_timestamp()
    RETURNING p.holder, p.expires_at;
END
$pglock$
"""

_RELEASE = """
CREATE OR REPLACE FUNCTION {s}.semaphore_release(p_name text, p_holder text)
RETURNS TABLE (status text, notified boolean)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_waiters boolean;
    v_expires timestamptz;
BEGIN
    -- A release lost in a crash only makes waiters wait for the expiry.
    PERFORM set_config('synchronous_commit', 'off', true);
    -- The row lock orders this release after any refused acquire that is marking itself
    -- as a waiter, so that waiter is notified.
    SELECT m.waiters INTO v_waiters FROM {s}.semaphore AS m WHERE m.name = p_name FOR UPDATE;
    DELETE FROM {s}.semaphore_permit AS p
     WHERE p.semaphore = p_name AND p.holder = p_holder
    RETURNING p.expires_at INTO v_expires;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_held'::text, false;
        RETURN;
    END IF;
    IF v_waiters THEN
        -- Every waiter wakes and tries again; those that still do not fit mark it again.
        UPDATE {s}.semaphore AS m SET waiters = false WHERE m.name = p_name;
        PERFORM pg_notify({channel}, p_name);
    END IF;
    RETURN QUERY SELECT CASE WHEN v_expires > clock_timestamp() THEN 'released'
                             ELSE 'expired' END, coalesce(v_waiters, false);
END
$pglock$
"""

_INFO = """
CREATE OR REPLACE FUNCTION {s}.semaphore_info(p_name text)
RETURNS TABLE (name text, max_permits integer, held integer, holders integer)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
    SELECT m.name, m.max_permits,
           coalesce(sum(p.permits), 0)::integer, count(p.holder)::integer
      FROM {s}.semaphore AS m
      LEFT JOIN {s}.semaphore_permit AS p
        ON p.semaphore = m.name AND p.expires_at > clock_timestamp()
     WHERE m.name = p_name
     GROUP BY m.name, m.max_permits
$pglock$
"""

_UPGRADE = [
    "SELECT pg_catalog.pg_advisory_xact_lock({lock})",
    """
CREATE TABLE IF NOT EXISTS {s}.semaphore (
    name text COLLATE "C" PRIMARY KEY CHECK (name <> ''),
    max_permits integer NOT NULL CHECK (max_permits > 0),
    waiters boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
""",
    """
CREATE TABLE IF NOT EXISTS {s}.semaphore_permit (
    semaphore text COLLATE "C" NOT NULL REFERENCES {s}.semaphore (name) ON DELETE CASCADE,
    holder text NOT NULL CHECK (holder <> ''),
    permits integer NOT NULL CHECK (permits > 0),
    acquired_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    metadata jsonb,
    PRIMARY KEY (semaphore, holder)
) WITH (fillfactor = 80)
""",
    _ACQUIRE,
    _EXTEND,
    _RELEASE,
    _INFO,
    # SECURITY DEFINER functions: only roles granted EXECUTE may call them.
    *(f"REVOKE ALL ON FUNCTION {{s}}.{signature} FROM PUBLIC" for signature in FUNCTIONS),
    "COMMENT ON TABLE {s}.semaphore IS 'pglock semaphores: the limit stored by the first "
    "acquire'",
    "COMMENT ON TABLE {s}.semaphore_permit IS 'pglock semaphore permits: one row per holder, "
    "live while expires_at > clock_timestamp()'",
    "INSERT INTO {s}.schema_revision (revision) VALUES ({rev}) ON CONFLICT DO NOTHING",
]

# A downgrade never drops live permits (their holders still count on them); the tables are
# locked first, so no grant slips in before the DROP.
_REFUSE_LIVE = """
DO $pglock$
DECLARE
    v_live bigint;
BEGIN
    IF pg_catalog.to_regclass({permit_table}) IS NULL THEN
        RETURN;
    END IF;
    EXECUTE {lock_permits};
    EXECUTE {count_live} INTO v_live;
    IF v_live > 0 THEN
        RAISE EXCEPTION USING ERRCODE = '55006', MESSAGE = pg_catalog.format(
            'pglock downgrade refused: %s live semaphore permit(s) in %s; release them or let '
            'them expire (or delete the rows), then downgrade again', v_live, {permit_table});
    END IF;
END
$pglock$
"""

_DOWNGRADE = [
    "SELECT pg_catalog.pg_advisory_xact_lock({lock})",
    _REFUSE_LIVE,
    "DROP FUNCTION IF EXISTS {s}.semaphore_info(text)",
    "DROP FUNCTION IF EXISTS {s}.semaphore_release(text, text)",
    "DROP FUNCTION IF EXISTS {s}.semaphore_extend(text, text[], double precision)",
    "DROP FUNCTION IF EXISTS {s}.semaphore_acquire(text, integer, text, integer, "
    "double precision, jsonb, boolean)",
    "DROP TABLE IF EXISTS {s}.semaphore_permit",
    "DROP TABLE IF EXISTS {s}.semaphore",
    "DELETE FROM {s}.schema_revision WHERE revision = {rev}",
]


def upgrade_statements(schema: str) -> list[sql.Composed]:
    """The statements of this revision's upgrade for ``schema`` (run in one transaction)."""
    names = _names(schema)
    return [sql.SQL(text).format(**names) for text in _UPGRADE]


def downgrade_statements(schema: str) -> list[sql.Composed]:
    """The statements of this revision's downgrade for ``schema`` (run in one transaction)."""
    names = _names(schema)
    return [sql.SQL(text).format(**names) for text in _DOWNGRADE]


def upgrade() -> None:
    alembic_execute(upgrade_statements(alembic_schema()))


def downgrade() -> None:
    alembic_execute(downgrade_statements(alembic_schema()))
