-- pglock_0002 downgrade: drops the semaphore objects.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

-- A downgrade never drops live permits (their holders still count on them); the tables are
-- locked first, so no grant slips in before the DROP.
DO $pglock$
DECLARE
    v_live bigint;
BEGIN
    IF pg_catalog.to_regclass({permit_table}) IS NULL THEN
        RETURN;
    END IF;
    EXECUTE {lock_permits};
    EXECUTE {count_live} INTO v_live;
    IF v_live > 0 THEN
        RAISE EXCEPTION USING ERRCODE = '55006', MESSAGE = pg_catalog.format(
            'pglock downgrade refused: %s live semaphore permit(s) in %s; release them or let '
            'them expire (or delete the rows), then downgrade again', v_live, {permit_table});
    END IF;
END
$pglock$;

DROP FUNCTION IF EXISTS {s}.semaphore_info(text);

DROP FUNCTION IF EXISTS {s}.semaphore_release(text, text);

DROP FUNCTION IF EXISTS {s}.semaphore_extend(text, text[], double precision);

DROP FUNCTION IF EXISTS {s}.semaphore_acquire(text, integer, text, integer, double precision, jsonb, boolean);

DROP TABLE IF EXISTS {s}.semaphore_permit;

DROP TABLE IF EXISTS {s}.semaphore;

DELETE FROM {s}.schema_revision WHERE revision = {rev};
