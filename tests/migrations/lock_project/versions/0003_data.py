"""A data migration that must run exactly once."""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("INSERT INTO item (v) SELECT g FROM generate_series(1, 10) g")
    op.execute("INSERT INTO applied (revision, pid) VALUES ('0003', pg_backend_pid())")


def downgrade() -> None:
    op.execute("DELETE FROM item")
