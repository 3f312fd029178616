-- pglock_0005 downgrade: the internal helpers run with their owner's rights again, as revision
-- 0004 made them (callable directly by any role granted EXECUTE on the schema's functions), and
-- the token_epoch trigger is an ordinary one again.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

ALTER TABLE {s}.lease ENABLE TRIGGER token_epoch;

ALTER FUNCTION {s}.acquire(text, text, double precision, jsonb, double precision, boolean) RESET exit_on_error;

ALTER FUNCTION {s}.extend(text, text, bigint, double precision, boolean) RESET exit_on_error;

ALTER FUNCTION {s}.extend_many(text[], text[], bigint[], double precision[], boolean, double precision) RESET exit_on_error;

ALTER FUNCTION {s}.release(text, text, bigint) RESET exit_on_error;

ALTER FUNCTION {s}.guard(text, text, bigint) RESET exit_on_error;

ALTER FUNCTION {s}.semaphore_acquire(text, integer, text, integer, double precision, jsonb, boolean) RESET exit_on_error;

ALTER FUNCTION {s}.semaphore_extend(text, text[], double precision) RESET exit_on_error;

ALTER FUNCTION {s}.semaphore_release(text, text) RESET exit_on_error;

ALTER FUNCTION {s}.hand_over_v4(text, double precision) RESET exit_on_error;

ALTER FUNCTION {s}.take_over_v4(text, double precision) RESET exit_on_error;

ALTER FUNCTION {s}.acquire_v4(text, text, double precision, jsonb, double precision, boolean, double precision) RESET exit_on_error;

ALTER FUNCTION {s}.release_v4(text, text, bigint) RESET exit_on_error;

ALTER FUNCTION {s}.wait_v4(text, text, bigint, double precision) RESET exit_on_error;

ALTER FUNCTION {s}.leave_v4(text, text, bigint) RESET exit_on_error;

ALTER FUNCTION {s}.info(text) RESET exit_on_error;

ALTER FUNCTION {s}.leases(text) RESET exit_on_error;

ALTER FUNCTION {s}.semaphore_info(text) RESET exit_on_error;

ALTER FUNCTION {s}.token_epoch_v4() RESET exit_on_error;

ALTER FUNCTION {s}.take_over_v4(text, double precision) SECURITY DEFINER;

ALTER FUNCTION {s}.hand_over_v4(text, double precision) SECURITY DEFINER;

COMMENT ON FUNCTION {s}.take_over_v4(text, double precision) IS NULL;

COMMENT ON FUNCTION {s}.hand_over_v4(text, double precision) IS NULL;

DELETE FROM {s}.schema_revision WHERE revision = {rev};
