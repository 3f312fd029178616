-- pglock_0001 downgrade: drops the lease objects, the revision table and the schema.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

-- A downgrade never drops a live lease: its holder still believes in it, and the next process
-- would get the name at once. The table is locked first, so no grant slips in before the DROP.
DO $pglock$
DECLARE
    v_live bigint;
BEGIN
    IF pg_catalog.to_regclass({lease_table}) IS NULL THEN
        RETURN;
    END IF;
    EXECUTE {lock_leases};
    EXECUTE {count_live} INTO v_live;
    IF v_live > 0 THEN
        RAISE EXCEPTION USING ERRCODE = '55006', MESSAGE = pg_catalog.format(
            'pglock downgrade refused: %s live lease(s) in %s; release them or let them '
            'expire (or delete the rows), then downgrade again', v_live, {lease_table});
    END IF;
END
$pglock$;

DROP FUNCTION IF EXISTS {s}.leases(text);

DROP FUNCTION IF EXISTS {s}.info(text);

DROP FUNCTION IF EXISTS {s}.guard(text, text, bigint);

DROP FUNCTION IF EXISTS {s}.release(text, text, bigint);

DROP FUNCTION IF EXISTS {s}.extend_many(text[], text[], bigint[], double precision[], boolean, double precision);

DROP FUNCTION IF EXISTS {s}.extend(text, text, bigint, double precision, boolean);

DROP FUNCTION IF EXISTS {s}.acquire(text, text, double precision, jsonb, double precision, boolean);

DROP TABLE IF EXISTS {s}.lease;

DROP SEQUENCE IF EXISTS {s}.lease_token;

DROP TABLE IF EXISTS {s}.schema_revision;

-- The schema goes too, unless something else lives in it (another application's objects).
DO $pglock$
BEGIN
    EXECUTE {drop_schema};
EXCEPTION WHEN dependent_objects_still_exist THEN
    NULL;
END
$pglock$;
