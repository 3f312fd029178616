-- pglock_0005 downgrade: the internal helpers run with their owner's rights again, as revision
-- 0004 made them (callable directly by any role granted EXECUTE on the schema's functions), and
-- the token_epoch trigger is an ordinary one again.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

ALTER TABLE {s}.lease ENABLE TRIGGER token_epoch;

ALTER FUNCTION {s}.take_over_v4(text, double precision) SECURITY DEFINER;

ALTER FUNCTION {s}.hand_over_v4(text, double precision) SECURITY DEFINER;

COMMENT ON FUNCTION {s}.take_over_v4(text, double precision) IS NULL;

COMMENT ON FUNCTION {s}.hand_over_v4(text, double precision) IS NULL;

DELETE FROM {s}.schema_revision WHERE revision = {rev};
