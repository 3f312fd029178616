"""pglock's Alembic revisions (one module per revision; see :mod:`pglock.migrations`)."""
