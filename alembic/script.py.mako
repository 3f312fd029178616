"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}

pglock revisions keep their SQL in upgrade_statements()/downgrade_statements() (composed with
psycopg.sql for a given schema) so that ``pglock install`` can run them without Alembic; take
the install lock first and keep every statement idempotent.
"""

from __future__ import annotations

from psycopg import sql

from pglock._contract import install_lock_key
from pglock.migrations import alembic_execute, alembic_schema

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade_statements(schema: str) -> list[sql.Composed]:
    s = sql.Identifier(schema)
    lock = sql.Literal(install_lock_key(schema))
    return [
        sql.SQL("SELECT pg_catalog.pg_advisory_xact_lock({})").format(lock),
        # ... your statements, e.g. sql.SQL("CREATE TABLE IF NOT EXISTS {}.x (...)").format(s)
        sql.SQL("INSERT INTO {}.schema_revision (revision) VALUES ({}) ON CONFLICT DO NOTHING")
        .format(s, sql.Literal(revision)),
    ]


def downgrade_statements(schema: str) -> list[sql.Composed]:
    s = sql.Identifier(schema)
    lock = sql.Literal(install_lock_key(schema))
    return [
        sql.SQL("SELECT pg_catalog.pg_advisory_xact_lock({})").format(lock),
        # ... undo the upgrade
        sql.SQL("DELETE FROM {}.schema_revision WHERE revision = {}").format(s, sql.Literal(revision)),
    ]


def upgrade() -> None:
    alembic_execute(upgrade_statements(alembic_schema()))


def downgrade() -> None:
    alembic_execute(downgrade_statements(alembic_schema()))
