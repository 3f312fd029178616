-- pglock_0004 downgrade: drops the lease waiter queue and the _v4 lease functions. Queued
-- waiters of running clients then find the functions gone and wait the 0001 way.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

DROP FUNCTION IF EXISTS {s}.leave_v4(text, text, bigint);

DROP FUNCTION IF EXISTS {s}.wait_v4(text, text, bigint, double precision);

DROP FUNCTION IF EXISTS {s}.release_v4(text, text, bigint);

DROP FUNCTION IF EXISTS {s}.acquire_v4(text, text, double precision, jsonb, double precision, boolean, double precision);

DROP FUNCTION IF EXISTS {s}.take_over_v4(text, double precision);

DROP FUNCTION IF EXISTS {s}.hand_over_v4(text, double precision);

DROP TABLE IF EXISTS {s}.lease_waiter;

DROP TRIGGER IF EXISTS token_epoch ON {s}.lease;

DROP FUNCTION IF EXISTS {s}.token_epoch_v4();

DELETE FROM {s}.schema_revision WHERE revision = {rev};
