"""Tables of the throwaway project, and the audit of applied revisions."""

from __future__ import annotations

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE TABLE applied (revision text NOT NULL, pid int NOT NULL, "
        "at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    op.execute("CREATE TABLE item (id bigserial PRIMARY KEY, v int)")
    op.execute("INSERT INTO applied (revision, pid) VALUES ('0001', pg_backend_pid())")


def downgrade() -> None:
    op.execute("DROP TABLE item")
    op.execute("DROP TABLE applied")
