-- pglock_0002 upgrade: semaphores (stored limits, permit rows) and their functions.
-- Placeholders are filled by pglock/migrations/versions/0002_semaphores.py (see 0001).

SELECT pg_catalog.pg_advisory_xact_lock({lock});

CREATE TABLE IF NOT EXISTS {s}.semaphore (
    name text COLLATE "C" PRIMARY KEY CHECK (name <> ''),
    max_permits integer NOT NULL CHECK (max_permits > 0),
    waiters boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE IF NOT EXISTS {s}.semaphore_permit (
    semaphore text COLLATE "C" NOT NULL REFERENCES {s}.semaphore (name) ON DELETE CASCADE,
    holder text NOT NULL CHECK (holder <> ''),
    permits integer NOT NULL CHECK (permits > 0),
    acquired_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    metadata jsonb,
    PRIMARY KEY (semaphore, holder)
) WITH (fillfactor = 80);

CREATE OR REPLACE FUNCTION {s}.semaphore_acquire(
    p_name text,
    p_limit integer,
    p_holder text,
    p_permits integer,
    p_ttl double precision,
    p_metadata jsonb DEFAULT NULL,
    p_wait boolean DEFAULT false)
RETURNS TABLE (granted boolean, max_permits integer, held integer, expires_at timestamptz,
               retry_in double precision, server_time timestamptz)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_limit integer;
    v_waiters boolean;
    v_now timestamptz;
    v_held integer;
    v_next timestamptz;
BEGIN
    IF p_name IS NULL OR p_name = '' OR p_holder IS NULL OR p_holder = ''
       OR p_limit IS NULL OR p_limit < 1 OR p_permits IS NULL OR p_permits < 1
       OR p_permits > p_limit OR p_ttl IS NULL OR NOT (p_ttl > 0 AND p_ttl <= {max_ttl}) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'pglock semaphore_acquire: invalid '
            'argument (name and holder non-empty, 1 <= permits <= limit, '
            '0 < ttl <= {max_ttl} seconds)';
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- Under a snapshot older than the row lock, a concurrent grant would be invisible.
        RAISE EXCEPTION USING ERRCODE = '25001', MESSAGE = 'pglock semaphore_acquire must run '
            'in a READ COMMITTED transaction, not ' || current_setting('transaction_isolation');
    END IF;

    -- The first acquire stores the limit; a concurrent first acquire waits here for the
    -- other's row, then finds it.
    INSERT INTO {s}.semaphore AS m (name, max_permits)
    VALUES (p_name, p_limit)
    ON CONFLICT (name) DO NOTHING;
    SELECT m.max_permits, m.waiters INTO v_limit, v_waiters
      FROM {s}.semaphore AS m
     WHERE m.name = p_name
       FOR UPDATE;
    IF v_limit <> p_limit THEN
        RAISE EXCEPTION USING ERRCODE = {mismatch},
            MESSAGE = format('pglock semaphore %L has limit %s, not %s', p_name, v_limit,
                             p_limit);
    END IF;

    v_now := clock_timestamp();
    DELETE FROM {s}.semaphore_permit AS p
     WHERE p.semaphore = p_name AND p.expires_at <= v_now;
    SELECT coalesce(sum(p.permits), 0)::integer, min(p.expires_at)
      INTO v_held, v_next
      FROM {s}.semaphore_permit AS p
     WHERE p.semaphore = p_name;

    IF v_held + p_permits <= v_limit THEN
        INSERT INTO {s}.semaphore_permit AS p
               (semaphore, holder, permits, acquired_at, expires_at, metadata)
        VALUES (p_name, p_holder, p_permits, v_now, v_now + make_interval(secs => p_ttl),
                p_metadata);
        RETURN QUERY SELECT true, v_limit, v_held + p_permits,
                            v_now + make_interval(secs => p_ttl), NULL::double precision,
                            v_now;
        RETURN;
    END IF;

    IF p_wait AND NOT v_waiters THEN
        UPDATE {s}.semaphore AS m SET waiters = true WHERE m.name = p_name;
    END IF;
    -- A refused attempt changes nothing that needs a durable commit.
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY SELECT false, v_limit, v_held, NULL::timestamptz,
                        greatest(0, extract(epoch FROM v_next - clock_timestamp()))
                            ::double precision,
                        v_now;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.semaphore_extend(
    p_name text,
    p_holders text[],
    p_ttl double precision)
RETURNS TABLE (holder text, expires_at timestamptz)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
BEGIN
    IF p_ttl IS NULL OR NOT (p_ttl > 0 AND p_ttl <= {max_ttl}) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'pglock semaphore_extend: ttl must be > 0 and <= {max_ttl} seconds';
    END IF;
    -- Renews the live permits among p_holders; an expired or released one is not returned.
    -- Durable on purpose: after a crash the server must not think a permit ends sooner than
    -- its holder does.
    RETURN QUERY
    UPDATE {s}.semaphore_permit AS p
       SET expires_at = clock_timestamp() + make_interval(secs => p_ttl)
     WHERE p.semaphore = p_name AND p.holder = ANY (p_holders)
       AND p.expires_at > clock_timestamp()
    RETURNING p.holder, p.expires_at;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.semaphore_release(p_name text, p_holder text)
RETURNS TABLE (status text, notified boolean)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_waiters boolean;
    v_expires timestamptz;
BEGIN
    -- A release lost in a crash only makes waiters wait for the expiry.
    PERFORM set_config('synchronous_commit', 'off', true);
    -- The row lock orders this release after any refused acquire that is marking itself
    -- as a waiter, so that waiter is notified.
    SELECT m.waiters INTO v_waiters FROM {s}.semaphore AS m WHERE m.name = p_name FOR UPDATE;
    DELETE FROM {s}.semaphore_permit AS p
     WHERE p.semaphore = p_name AND p.holder = p_holder
    RETURNING p.expires_at INTO v_expires;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_held'::text, false;
        RETURN;
    END IF;
    IF v_waiters THEN
        -- Every waiter wakes and tries again; those that still do not fit mark it again.
        UPDATE {s}.semaphore AS m SET waiters = false WHERE m.name = p_name;
        PERFORM pg_notify({channel}, p_name);
    END IF;
    RETURN QUERY SELECT CASE WHEN v_expires > clock_timestamp() THEN 'released'
                             ELSE 'expired' END, coalesce(v_waiters, false);
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.semaphore_info(p_name text)
RETURNS TABLE (name text, max_permits integer, held integer, holders integer)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
    SELECT m.name, m.max_permits,
           coalesce(sum(p.permits), 0)::integer, count(p.holder)::integer
      FROM {s}.semaphore AS m
      LEFT JOIN {s}.semaphore_permit AS p
        ON p.semaphore = m.name AND p.expires_at > clock_timestamp()
     WHERE m.name = p_name
     GROUP BY m.name, m.max_permits
$pglock$;

-- SECURITY DEFINER functions: only roles granted EXECUTE may call them.
REVOKE ALL ON FUNCTION {s}.semaphore_acquire(text, integer, text, integer, double precision, jsonb, boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.semaphore_extend(text, text[], double precision) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.semaphore_release(text, text) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.semaphore_info(text) FROM PUBLIC;

COMMENT ON TABLE {s}.semaphore IS 'pglock semaphores: the limit stored by the first acquire';

COMMENT ON TABLE {s}.semaphore_permit IS 'pglock semaphore permits: one row per holder, live while expires_at > clock_timestamp()';

INSERT INTO {s}.schema_revision (revision) VALUES ({rev}) ON CONFLICT DO NOTHING;
