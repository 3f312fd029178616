"""The name registry: which lock name each advisory-lock key stands for.

Revision ID: pglock_0003
Revises: pglock_0002

Objects, in the pglock schema (default ``pglock``):

* ``lock_names``: ``key`` (the bigint advisory-lock key, primary key), ``name`` (the pglock
  name it was taken for) and ``first_seen``. pglock inserts a row the first time a process
  takes a key in a database where this table exists (``INSERT ... ON CONFLICT DO NOTHING``, in
  the lock statement's round trip); ``pglock.advisory_locks()`` and ``pglock status`` join it
  with ``pg_locks`` to show names instead of two 32-bit numbers. The lock APIs record names
  only in ``pglock.lock_names`` (they take no schema; introspection reads the schema it is
  given), and pglock uses the table only while it is a plain table with
  its comment (``pglock name registry``), without triggers, rules or row security, owned by a
  role it trusts (docs/guarantees.md): keep the comment, add no trigger.

The table grows by one row (about 100 bytes with a short name) per distinct name ever locked;
rows are never updated. Prune it at will (``DELETE ... WHERE first_seen < ...``): a pruned name
comes back when a process that has not registered it yet takes it again. ``REVOKE INSERT ON
<schema>.lock_names FROM <role>`` stops a role from registering names.

The statements are idempotent and run under the same transaction-level advisory lock as the
other revisions (``pglock:install:<schema>``), so concurrent installs serialize.
"""

from __future__ import annotations

from psycopg import sql

from pglock._contract import install_lock_key
from pglock.migrations import alembic_execute, alembic_schema

revision = "pglock_0003"
down_revision = "pglock_0002"
branch_labels = None
depends_on = None


def _names(schema: str) -> dict[str, sql.Composable]:
    return {
        "s": sql.Identifier(schema),
        "rev": sql.Literal(revision),
        "lock": sql.Literal(install_lock_key(schema)),
    }


_UPGRADE = [
    "SELECT pg_catalog.pg_advisory_xact_lock({lock})",
    """
CREATE TABLE IF NOT EXISTS {s}.lock_names (
    key bigint PRIMARY KEY,
    name text NOT NULL CHECK (name <> ''),
    first_seen timestamptz NOT NULL DEFAULT clock_timestamp()
)
""",
    "COMMENT ON TABLE {s}.lock_names IS 'pglock name registry: the lock name of each "
    "advisory-lock key that pglock took in this database (pglock status, "
    "pglock.advisory_locks)'",
    "INSERT INTO {s}.schema_revision (revision) VALUES ({rev}) ON CONFLICT DO NOTHING",
]

_DOWNGRADE = [
    "SELECT pg_catalog.pg_advisory_xact_lock({lock})",
    "DROP TABLE IF EXISTS {s}.lock_names",
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
