-- pglock_0001 upgrade: the lease table, the fencing-token sequence and the lease functions.
-- Placeholders ({s}, {max_ttl}, ...) are filled by pglock/migrations/versions/0001_leases.py;
-- statements end with ";" outside quotes; comments between statements are not sent.
-- docs/reference/sql.md describes the objects, docs/how-it-works.md the design.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

CREATE SCHEMA IF NOT EXISTS {s};

CREATE TABLE IF NOT EXISTS {s}.schema_revision (
    revision text PRIMARY KEY,
    installed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE SEQUENCE IF NOT EXISTS {s}.lease_token
    AS bigint MINVALUE 1 START WITH 1 CACHE 1 NO CYCLE;

CREATE TABLE IF NOT EXISTS {s}.lease (
    name text COLLATE "C" PRIMARY KEY CHECK (name <> ''),
    holder text NOT NULL CHECK (holder <> ''),
    token bigint NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    metadata jsonb,
    waiters boolean NOT NULL DEFAULT false
) WITH (fillfactor = 80);

CREATE OR REPLACE FUNCTION {s}.acquire(
    p_name text,
    p_holder text,
    p_ttl double precision,
    p_metadata jsonb DEFAULT NULL,
    p_wait double precision DEFAULT NULL,
    p_durable boolean DEFAULT true)
RETURNS TABLE (granted boolean, holder text, token bigint, acquired_at timestamptz,
               expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_ttl interval;
    v_now timestamptz;
    v_holder text;
    v_token bigint;
    v_acquired timestamptz;
    v_expires timestamptz;
    v_waiters boolean;
    v_found boolean;
    v_saved text;
    v_round integer := 0;
BEGIN
    IF p_name IS NULL OR p_name = '' OR p_holder IS NULL OR p_holder = ''
       OR p_ttl IS NULL OR NOT (p_ttl > 0 AND p_ttl <= {max_ttl}) OR p_wait < 0 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'pglock acquire: invalid argument '
            '(name and holder must be non-empty, 0 < ttl <= {max_ttl} seconds, wait >= 0)';
    END IF;
    IF NOT p_durable THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    v_ttl := make_interval(secs => p_ttl);
    LOOP
        -- A few rounds at most: each one follows a change made by a concurrent session.
        v_round := v_round + 1;
        IF v_round > 8 THEN
            RETURN QUERY SELECT false, NULL::text, NULL::bigint, NULL::timestamptz,
                                NULL::timestamptz, clock_timestamp();
            RETURN;
        END IF;

        SELECT l.holder, l.token, l.acquired_at, l.expires_at, l.waiters
          INTO v_holder, v_token, v_acquired, v_expires, v_waiters
          FROM {s}.lease AS l
         WHERE l.name = p_name;

        IF NOT FOUND THEN
            -- Free: a new grant. A concurrent first acquire (or an uncommitted release) of
            -- the same name makes this insert wait for it; if its row stays, the insert does
            -- nothing and the next round sees that row. The row goes in with a placeholder
            -- token (0: the sequence starts at 1, and nobody else can see the row before this
            -- transaction commits); the token is drawn only below, once the row is ours. A
            -- token drawn in the INSERT itself would come before that wait, and could be
            -- smaller than the token of a grant made and released meanwhile.
            v_now := clock_timestamp();
            INSERT INTO {s}.lease AS l (name, holder, token, acquired_at, expires_at, metadata)
            VALUES (p_name, p_holder, 0, v_now, v_now + v_ttl, p_metadata)
            ON CONFLICT (name) DO NOTHING;
            IF FOUND THEN
                -- The clock is read again too: the insert may have waited.
                v_now := clock_timestamp();
                UPDATE {s}.lease AS l
                   SET token = nextval({seq}::regclass), acquired_at = v_now,
                       expires_at = v_now + v_ttl
                 WHERE l.name = p_name
                RETURNING l.token, l.acquired_at, l.expires_at
                     INTO v_token, v_acquired, v_expires;
                RETURN QUERY SELECT true, p_holder, v_token, v_acquired, v_expires, v_now;
                RETURN;
            END IF;
            CONTINUE;
        END IF;

        IF v_holder = p_holder AND v_expires > clock_timestamp() THEN
            -- The same holder again (re-acquire, resume): renew and keep the token.
            v_now := clock_timestamp();
            UPDATE {s}.lease AS l
               SET expires_at = greatest(l.expires_at, v_now + v_ttl), metadata = p_metadata
             WHERE l.name = p_name AND l.holder = p_holder AND l.token = v_token
               AND l.expires_at > v_now
            RETURNING l.acquired_at, l.expires_at INTO v_acquired, v_expires;
            IF FOUND THEN
                RETURN QUERY SELECT true, p_holder, v_token, v_acquired, v_expires, v_now;
                RETURN;
            END IF;
            CONTINUE;
        END IF;

        IF v_expires <= clock_timestamp() THEN
            -- Expired: take it over. FOR UPDATE waits for a transaction that guards the
            -- lease (guard() holds FOR KEY SHARE on the row) to end, bounded by p_wait.
            BEGIN
                IF p_wait IS NOT NULL THEN
                    v_saved := current_setting('lock_timeout');
                    PERFORM set_config('lock_timeout',
                        greatest(1, least(ceil(p_wait * 1000), 2147483647))::bigint::text
                        || 'ms', true);
                END IF;
                SELECT l.holder, l.token, l.expires_at
                  INTO v_holder, v_token, v_expires
                  FROM {s}.lease AS l
                 WHERE l.name = p_name
                   FOR UPDATE;
                v_found := FOUND;
                IF p_wait IS NOT NULL THEN
                    PERFORM set_config('lock_timeout', v_saved, true);
                END IF;
            EXCEPTION WHEN lock_not_available THEN
                -- Still guarded when the wait ran out (the subtransaction restores the setting).
                PERFORM set_config('synchronous_commit', 'off', true);
                RETURN QUERY SELECT false, v_holder, v_token, v_acquired, v_expires,
                                    clock_timestamp();
                RETURN;
            END;
            IF NOT v_found THEN
                CONTINUE;  -- released meanwhile: insert it
            END IF;
            v_now := clock_timestamp();
            IF v_expires > v_now THEN
                CONTINUE;  -- renewed or taken by someone else meanwhile: look again
            END IF;
            UPDATE {s}.lease AS l
               SET holder = p_holder, token = nextval({seq}::regclass), acquired_at = v_now,
                   expires_at = v_now + v_ttl, metadata = p_metadata
             WHERE l.name = p_name
            RETURNING l.token, l.acquired_at, l.expires_at INTO v_token, v_acquired, v_expires;
            RETURN QUERY SELECT true, p_holder, v_token, v_acquired, v_expires, v_now;
            RETURN;
        END IF;

        -- Held by another holder. A caller that will wait marks the row, so that release()
        -- sends a NOTIFY; if the row changed meanwhile, look again.
        IF p_wait IS DISTINCT FROM 0 AND NOT v_waiters THEN
            UPDATE {s}.lease AS l
               SET waiters = true
             WHERE l.name = p_name AND l.holder = v_holder AND l.token = v_token
            RETURNING l.expires_at INTO v_expires;
            IF NOT FOUND THEN
                CONTINUE;
            END IF;
        END IF;
        -- A refused attempt changes nothing that needs a durable commit.
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN QUERY SELECT false, v_holder, v_token, v_acquired, v_expires, clock_timestamp();
        RETURN;
    END LOOP;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.extend(
    p_name text,
    p_holder text,
    p_token bigint,
    p_ttl double precision,
    p_durable boolean DEFAULT true)
RETURNS TABLE (token bigint, acquired_at timestamptz, expires_at timestamptz, metadata jsonb)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
BEGIN
    IF p_ttl IS NULL OR NOT (p_ttl > 0 AND p_ttl <= {max_ttl}) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'pglock extend: ttl must be > 0 and <= {max_ttl} seconds';
    END IF;
    IF NOT p_durable THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    -- p_token NULL: any token of this holder (resume after a restart). The expiry never
    -- moves back: a renewal that commits after a longer one cannot shorten the lease below
    -- what its holder was told.
    RETURN QUERY
    UPDATE {s}.lease AS l
       SET expires_at = greatest(l.expires_at, clock_timestamp() + make_interval(secs => p_ttl))
     WHERE l.name = p_name AND l.holder = p_holder
       AND (p_token IS NULL OR l.token = p_token)
       AND l.expires_at > clock_timestamp()
    RETURNING l.token, l.acquired_at, l.expires_at, l.metadata;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.extend_many(
    p_names text[],
    p_holders text[],
    p_tokens bigint[],
    p_ttls double precision[],
    p_durable boolean DEFAULT true,
    p_wait double precision DEFAULT NULL)
RETURNS TABLE (name text, token bigint, expires_at timestamptz)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_saved text := current_setting('lock_timeout');
BEGIN
    IF EXISTS (SELECT 1 FROM unnest(p_ttls) AS t(ttl)
                WHERE t.ttl IS NULL OR NOT (t.ttl > 0 AND t.ttl <= {max_ttl})) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'pglock extend_many: every ttl must be > 0 and <= {max_ttl} seconds';
    END IF;
    IF NOT p_durable THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    -- A renewal that cannot get its rows in time (p_wait seconds) fails rather than waits
    -- past the deadlines it is meant to push back; the keepalive retries it.
    IF p_wait IS NOT NULL THEN
        PERFORM set_config('lock_timeout',
            greatest(1, least(ceil(p_wait * 1000), 2147483647))::bigint::text || 'ms', true);
    END IF;
    -- One statement renews every lease of a keepalive round; leases no longer held by
    -- (holder, token), or already expired, are simply not returned.
    RETURN QUERY
    UPDATE {s}.lease AS l
       SET expires_at = greatest(l.expires_at, clock_timestamp() + make_interval(secs => u.ttl))
      FROM unnest(p_names, p_holders, p_tokens, p_ttls) AS u(name, holder, token, ttl)
     WHERE l.name = u.name AND l.holder = u.holder AND l.token = u.token
       AND l.expires_at > clock_timestamp()
    RETURNING l.name, l.token, l.expires_at;
    IF p_wait IS NOT NULL THEN
        PERFORM set_config('lock_timeout', v_saved, true);
    END IF;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.release(p_name text, p_holder text, p_token bigint)
RETURNS TABLE (status text, notified boolean)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
    v_waiters boolean;
BEGIN
    -- A release lost in a server crash only makes the next holder wait for the expiry, and
    -- any later grant's durable commit flushes it (WAL is sequential): no need to wait for
    -- the flush here.
    PERFORM set_config('synchronous_commit', 'off', true);
    DELETE FROM {s}.lease AS l
     WHERE l.name = p_name AND l.holder = p_holder AND l.token = p_token
    RETURNING l.expires_at, l.waiters INTO v_expires, v_waiters;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_held'::text, false;
        RETURN;
    END IF;
    IF v_waiters THEN
        PERFORM pg_notify({channel}, p_name);
    END IF;
    RETURN QUERY SELECT CASE WHEN v_expires > clock_timestamp() THEN 'released'
                             ELSE 'expired' END, v_waiters;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.guard(p_name text, p_holder text, p_token bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
BEGIN
    -- FOR KEY SHARE lasts until the caller's transaction ends. It blocks a takeover (FOR
    -- UPDATE in acquire) and a release (DELETE), but not renewals (plain UPDATEs of
    -- non-key columns), so the holder's keepalive goes on while the caller works.
    PERFORM 1
       FROM {s}.lease AS l
      WHERE l.name = p_name AND l.holder = p_holder AND l.token = p_token
        AND l.expires_at > clock_timestamp()
        FOR KEY SHARE;
    RETURN FOUND;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.info(p_name text)
RETURNS TABLE (name text, holder text, token bigint, acquired_at timestamptz,
               expires_at timestamptz, metadata jsonb, expires_in double precision)
LANGUAGE sql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
    SELECT l.name, l.holder, l.token, l.acquired_at, l.expires_at, l.metadata,
           extract(epoch FROM l.expires_at - clock_timestamp())::double precision
      FROM {s}.lease AS l
     WHERE l.name = p_name AND l.expires_at > clock_timestamp()
$pglock$;

CREATE OR REPLACE FUNCTION {s}.leases(p_prefix text DEFAULT NULL)
RETURNS TABLE (name text, holder text, token bigint, acquired_at timestamptz,
               expires_at timestamptz, metadata jsonb, expires_in double precision)
LANGUAGE sql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
    SELECT l.name, l.holder, l.token, l.acquired_at, l.expires_at, l.metadata,
           extract(epoch FROM l.expires_at - clock_timestamp())::double precision
      FROM {s}.lease AS l
     WHERE l.expires_at > clock_timestamp()
       AND (p_prefix IS NULL OR starts_with(l.name, p_prefix))
     ORDER BY l.name
$pglock$;

-- SECURITY DEFINER functions: only roles granted EXECUTE may call them (Postgres grants
-- EXECUTE on new functions to PUBLIC by default).
REVOKE ALL ON FUNCTION {s}.acquire(text, text, double precision, jsonb, double precision, boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.extend(text, text, bigint, double precision, boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.extend_many(text[], text[], bigint[], double precision[], boolean, double precision) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.release(text, text, bigint) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.guard(text, text, bigint) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.info(text) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.leases(text) FROM PUBLIC;

COMMENT ON TABLE {s}.lease IS 'pglock TTL leases: one row per name, live while expires_at > clock_timestamp()';

COMMENT ON SEQUENCE {s}.lease_token IS 'pglock fencing tokens (never cycles)';

COMMENT ON FUNCTION {s}.acquire(text, text, double precision, jsonb, double precision, boolean) IS 'pglock: take or renew a lease; one row: granted, holder, token, acquired_at, expires_at, server_time';

COMMENT ON FUNCTION {s}.guard(text, text, bigint) IS 'pglock: true if the lease is held by (holder, token); locks it against takeover until this transaction ends';

INSERT INTO {s}.schema_revision (revision) VALUES ({rev}) ON CONFLICT DO NOTHING;
