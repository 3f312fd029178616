-- pglock_0003 downgrade: drops the name registry.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

DROP TABLE IF EXISTS {s}.lock_names;

DELETE FROM {s}.schema_revision WHERE revision = {rev};
