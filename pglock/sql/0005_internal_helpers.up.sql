-- pglock_0005 upgrade: revision 0004's internal helpers, hand_over_v4 and take_over_v4, run
-- with the rights of their caller (SECURITY INVOKER) instead of their owner's; its token_epoch
-- trigger fires whatever the session's session_replication_role.
-- Placeholders are filled by pglock/migrations/versions/0005_internal_helpers.py;
-- docs/leases.md ("Permissions") and docs/reference/sql.md say what an application role can do.
--
-- Why: the documented grants (GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA, and ALTER DEFAULT
-- PRIVILEGES ... GRANT EXECUTE ON FUNCTIONS) give an application role EXECUTE on every function
-- of the schema, these two included; the REVOKE FROM PUBLIC of 0004 does not take it back, and
-- a revoke from the roles granted today would be undone by the next such grant. As SECURITY
-- DEFINER, hand_over_v4 called directly handed a live lease to the queue's head without its
-- holder id or token and without waiting for a guard()ing transaction (its UPDATE changes no
-- key column, which FOR KEY SHARE lets through); take_over_v4 handed a free or expired lease
-- with a provisional expiry of the caller's choosing (wait_v4 bounds it to 60 s).
--
-- The fix is the smallest that does not depend on who was granted EXECUTE: an invoker's
-- function can do nothing its caller could not do with its own privileges. The public
-- functions that call the helpers (acquire_v4, release_v4, wait_v4, leave_v4) are SECURITY
-- DEFINER, so there the current role is the owner and nothing changes; called directly by a
-- role without privileges on the tables (the documented grants give none), the first
-- statement of either helper fails with insufficient_privilege (42501) and nothing changes.
-- A role that may write the tables could change the leases itself anyway. Nothing else is
-- touched: the functions' text, search_path and grants stay as 0004 made them, so a client
-- of either revision, and waiters queued during the upgrade, are served as before.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

ALTER FUNCTION {s}.hand_over_v4(text, double precision) SECURITY INVOKER;

ALTER FUNCTION {s}.take_over_v4(text, double precision) SECURITY INVOKER;

COMMENT ON FUNCTION {s}.hand_over_v4(text, double precision) IS 'pglock internal (SECURITY INVOKER): hand the lease, its row locked by the caller, to the first live waiter; called by release_v4 and take_over_v4';

COMMENT ON FUNCTION {s}.take_over_v4(text, double precision) IS 'pglock internal (SECURITY INVOKER): hand a free or expired lease to the first live waiter; called by acquire_v4 and wait_v4';

-- The token_epoch trigger (0004) keeps fencing tokens above the WAL timeline's floor. An
-- ordinary trigger does not fire in a session whose session_replication_role is replica (which a
-- superuser can set for a role or a database): its grants would draw tokens below the floor,
-- which a failover can hand out again. ALWAYS: it fires whatever the session says.
ALTER TABLE {s}.lease ENABLE ALWAYS TRIGGER token_epoch;

-- Errors the functions catch themselves (lock_not_available behind a guard()ing transaction, a
-- concurrent insert) must stay errors: a session whose exit_on_error is on would otherwise end at
-- the first of them, with the caller's statement and every lock of its session.
ALTER FUNCTION {s}.acquire(text, text, double precision, jsonb, double precision, boolean) SET exit_on_error = off;

ALTER FUNCTION {s}.extend(text, text, bigint, double precision, boolean) SET exit_on_error = off;

ALTER FUNCTION {s}.extend_many(text[], text[], bigint[], double precision[], boolean, double precision) SET exit_on_error = off;

ALTER FUNCTION {s}.release(text, text, bigint) SET exit_on_error = off;

ALTER FUNCTION {s}.guard(text, text, bigint) SET exit_on_error = off;

ALTER FUNCTION {s}.semaphore_acquire(text, integer, text, integer, double precision, jsonb, boolean) SET exit_on_error = off;

ALTER FUNCTION {s}.semaphore_extend(text, text[], double precision) SET exit_on_error = off;

ALTER FUNCTION {s}.semaphore_release(text, text) SET exit_on_error = off;

ALTER FUNCTION {s}.hand_over_v4(text, double precision) SET exit_on_error = off;

ALTER FUNCTION {s}.take_over_v4(text, double precision) SET exit_on_error = off;

ALTER FUNCTION {s}.acquire_v4(text, text, double precision, jsonb, double precision, boolean, double precision) SET exit_on_error = off;

ALTER FUNCTION {s}.release_v4(text, text, bigint) SET exit_on_error = off;

ALTER FUNCTION {s}.wait_v4(text, text, bigint, double precision) SET exit_on_error = off;

ALTER FUNCTION {s}.leave_v4(text, text, bigint) SET exit_on_error = off;

ALTER FUNCTION {s}.info(text) SET exit_on_error = off;

ALTER FUNCTION {s}.leases(text) SET exit_on_error = off;

ALTER FUNCTION {s}.semaphore_info(text) SET exit_on_error = off;

ALTER FUNCTION {s}.token_epoch_v4() SET exit_on_error = off;

INSERT INTO {s}.schema_revision (revision) VALUES ({rev}) ON CONFLICT DO NOTHING;
