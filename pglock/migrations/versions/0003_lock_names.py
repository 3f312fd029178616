"""The name registry: which lock name each advisory-lock key stands for.

Revision ID: pglock_0003
Revises: pglock_0002

SQL: ``pglock/sql/0003_lock_names.up.sql`` and ``.down.sql`` (docs/reference/sql.md).
"""

from __future__ import annotations

from psycopg import sql

from pglock._contract import install_lock_key
from pglock.migrations import alembic_execute, alembic_schema, statements

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


def upgrade_statements(schema: str) -> list[sql.Composed]:
    """This revision's upgrade for ``schema`` (run in one transaction)."""
    return statements("0003_lock_names.up", _names(schema))


def downgrade_statements(schema: str) -> list[sql.Composed]:
    """This revision's downgrade for ``schema`` (run in one transaction)."""
    return statements("0003_lock_names.down", _names(schema))


def upgrade() -> None:
    alembic_execute(upgrade_statements(alembic_schema()))


def downgrade() -> None:
    alembic_execute(downgrade_statements(alembic_schema()))
