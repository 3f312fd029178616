-- pglock_0003 upgrade: the name registry (lock_names), which pglock uses only while it is a
-- plain table with this comment, without triggers, rules or row security (docs/guarantees.md).
-- Placeholders are filled by pglock/migrations/versions/0003_lock_names.py.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

CREATE TABLE IF NOT EXISTS {s}.lock_names (
    key bigint PRIMARY KEY,
    name text NOT NULL CHECK (name <> ''),
    first_seen timestamptz NOT NULL DEFAULT clock_timestamp()
);

COMMENT ON TABLE {s}.lock_names IS 'pglock name registry: the lock name of each advisory-lock key that pglock took in this database (pglock status, pglock.advisory_locks)';

INSERT INTO {s}.schema_revision (revision) VALUES ({rev}) ON CONFLICT DO NOTHING;
