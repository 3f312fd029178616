"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}

SQL: ``pglock/sql/NNNN_name.up.sql`` and ``.down.sql``: take the install lock first, keep every
statement idempotent, and give every function a versioned name (docs/alembic.md).
"""

from __future__ import annotations

from psycopg import sql

from pglock._contract import install_lock_key
from pglock.migrations import alembic_execute, alembic_schema, statements

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def _names(schema: str) -> dict[str, sql.Composable]:
    return {
        "s": sql.Identifier(schema),
        "rev": sql.Literal(revision),
        "lock": sql.Literal(install_lock_key(schema)),
    }


def upgrade_statements(schema: str) -> list[sql.Composed]:
    return statements("NNNN_name.up", _names(schema))


def downgrade_statements(schema: str) -> list[sql.Composed]:
    return statements("NNNN_name.down", _names(schema))


def upgrade() -> None:
    alembic_execute(upgrade_statements(alembic_schema()))


def downgrade() -> None:
    alembic_execute(downgrade_statements(alembic_schema()))
