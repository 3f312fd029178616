-- pglock_0004 upgrade: the lease waiter queue (one row per waiter, first in first out) and the
-- _v4 lease functions that hand a released or expired lease to the head of that queue in the
-- same transaction. The 0001 functions stay as they were (older clients call them); the
-- token_epoch trigger puts every token, theirs too, above the WAL timeline's floor.
-- Placeholders are filled by pglock/migrations/versions/0004_lease_queue.py; docs/leases.md
-- ("Waiting: a queue in the database") and docs/how-it-works.md describe the design.

SELECT pg_catalog.pg_advisory_xact_lock({lock});

CREATE TABLE IF NOT EXISTS {s}.lease_waiter (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text COLLATE "C" NOT NULL CHECK (name <> ''),
    holder text NOT NULL CHECK (holder <> ''),
    ttl double precision NOT NULL,
    metadata jsonb,
    durable boolean NOT NULL DEFAULT true,
    alive_until timestamptz NOT NULL,
    enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (name, holder)
);

CREATE INDEX IF NOT EXISTS lease_waiter_name_id ON {s}.lease_waiter (name, id);

-- Fencing tokens carry the server's WAL timeline in their high bits: every token granted on
-- timeline T is at least T << 40. A promotion starts a new timeline, so a new primary's first
-- grant jumps above every token the old one could have handed out, including grants an
-- asynchronous standby never received (docs/production.md, "Failover"). Every grant writes
-- token = nextval(lease_token) (here and in 0001's functions); this trigger raises a token
-- below the floor. Under one advisory lock, the first grant below the floor moves the sequence
-- to it; grants racing with it draw again under the lock, so no two get the same token. The
-- guarantee holds while fewer than 2^40 tokens are granted on one timeline.
CREATE OR REPLACE FUNCTION {s}.token_epoch_v4()
RETURNS trigger
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
DECLARE
    v_timeline bigint;
    v_floor bigint;
BEGIN
    -- The insertion timeline: the first 8 hex digits of the current WAL segment's file name.
    v_timeline := ('x' || lpad(substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8), 16, '0'))
                  ::bit(64)::bigint;
    IF v_timeline >= 4194304 THEN  -- 2^22: T << 40 must stay below 2^62
        RAISE EXCEPTION USING ERRCODE = '22003', MESSAGE = format('pglock: WAL timeline %s '
            'is too large for fencing tokens with a timeline epoch', v_timeline);
    END IF;
    v_floor := v_timeline << 40;
    IF NEW.token < v_floor THEN
        PERFORM pg_advisory_xact_lock({epoch_lock});
        NEW.token := nextval({seq}::regclass);
        IF NEW.token < v_floor THEN
            PERFORM setval({seq}::regclass, v_floor);
            NEW.token := nextval({seq}::regclass);
        END IF;
    END IF;
    RETURN NEW;
END
$pglock$;

DROP TRIGGER IF EXISTS token_epoch ON {s}.lease;

CREATE TRIGGER token_epoch BEFORE UPDATE OF token ON {s}.lease
    FOR EACH ROW WHEN (NEW.token IS DISTINCT FROM OLD.token AND NEW.token > 0)
    EXECUTE FUNCTION {s}.token_epoch_v4();

-- Internal: with the lease row of p_name locked by the caller's transaction (any holder, or a
-- placeholder it just inserted), hand the lease to the first live waiter: a new token drawn
-- now (after the row lock, so tokens rise in grant order), an expiry of least(ttl, p_window)
-- (the waiter may have died within its last liveness window; its keepalive extends the grant),
-- its waiter row deleted, and a NOTIFY that carries the grant. Waiters past their liveness
-- deadline are deleted on the way. No row: nobody live is queued (the lease row is untouched).
CREATE OR REPLACE FUNCTION {s}.hand_over_v4(p_name text, p_window double precision)
RETURNS TABLE (holder text, token bigint, waiter bigint, acquired_at timestamptz,
               expires_at timestamptz, durable boolean)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_id bigint;
    v_w {s}.lease_waiter;
    v_now timestamptz;
    v_token bigint;
    v_expires timestamptz;
BEGIN
    DELETE FROM {s}.lease_waiter AS w
     WHERE w.name = p_name AND w.alive_until <= clock_timestamp();
    FOR i IN 1..8 LOOP
        SELECT w.id INTO v_id FROM {s}.lease_waiter AS w
         WHERE w.name = p_name AND w.alive_until > clock_timestamp()
         ORDER BY w.id LIMIT 1;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        -- The DELETE locks the row and checks it again: a waiter that left (or died) meanwhile
        -- is not granted; the next round takes the one after it.
        DELETE FROM {s}.lease_waiter AS w
         WHERE w.id = v_id AND w.alive_until > clock_timestamp()
        RETURNING w.* INTO v_w;
        IF FOUND THEN
            v_now := clock_timestamp();
            UPDATE {s}.lease AS l
               SET holder = v_w.holder, token = nextval({seq}::regclass), acquired_at = v_now,
                   expires_at = v_now + make_interval(secs => least(v_w.ttl, p_window)),
                   metadata = v_w.metadata,
                   waiters = EXISTS (SELECT 1 FROM {s}.lease_waiter AS o WHERE o.name = p_name)
             WHERE l.name = p_name
            RETURNING l.token, l.expires_at INTO v_token, v_expires;
            PERFORM pg_notify({channel}, json_build_array(
                'grant', p_name, v_w.holder, v_token, v_w.id,
                (extract(epoch FROM v_now) * 1000000)::bigint,
                (extract(epoch FROM v_expires) * 1000000)::bigint)::text);
            RETURN QUERY SELECT v_w.holder, v_token, v_w.id, v_now, v_expires, v_w.durable;
            RETURN;
        END IF;
    END LOOP;
END
$pglock$;

-- Internal: the lease p_name is free or expired (as the caller saw it) and live waiters may be
-- queued: lock (or create) its row, without waiting for a guard()ing transaction, and hand it
-- to the queue's head. No row: nothing was granted (held meanwhile, guarded, or nobody live).
CREATE OR REPLACE FUNCTION {s}.take_over_v4(p_name text, p_window double precision)
RETURNS TABLE (holder text, token bigint, waiter bigint, acquired_at timestamptz,
               expires_at timestamptz, durable boolean)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
BEGIN
    -- A placeholder row (token 0, already expired) claims a free name; a concurrent grant of
    -- the name makes this wait for it, and then the insert does nothing.
    INSERT INTO {s}.lease AS l (name, holder, token, acquired_at, expires_at)
    VALUES (p_name, '-', 0, '-infinity', '-infinity')
    ON CONFLICT (name) DO NOTHING;
    IF NOT FOUND THEN
        BEGIN
            SELECT l.expires_at INTO v_expires FROM {s}.lease AS l
             WHERE l.name = p_name FOR UPDATE NOWAIT;
        EXCEPTION WHEN lock_not_available THEN
            RETURN;  -- guarded, or being released: the release hands it over itself
        END;
        IF NOT FOUND OR v_expires > clock_timestamp() THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM {s}.hand_over_v4(p_name, p_window);
    IF NOT FOUND THEN
        DELETE FROM {s}.lease AS l WHERE l.name = p_name AND l.token = 0;
    END IF;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.acquire_v4(
    p_name text,
    p_holder text,
    p_ttl double precision,
    p_metadata jsonb DEFAULT NULL,
    p_wait double precision DEFAULT NULL,
    p_durable boolean DEFAULT true,
    p_liveness double precision DEFAULT 1.0)
RETURNS TABLE (granted boolean, holder text, token bigint, acquired_at timestamptz,
               expires_at timestamptz, server_time timestamptz, waiter_id bigint)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_holder text;
    v_token bigint;
    v_acquired timestamptz;
    v_expires timestamptz;
    v_head text;
    v_id bigint;
    v_now timestamptz;
    v_handed boolean := false;
BEGIN
    IF p_name IS NULL OR p_name = '' OR p_holder IS NULL OR p_holder = ''
       OR p_ttl IS NULL OR NOT (p_ttl > 0 AND p_ttl <= {max_ttl}) OR p_wait < 0
       OR p_liveness IS NULL OR NOT (p_liveness > 0 AND p_liveness <= 60) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'pglock acquire_v4: invalid argument '
            '(name and holder must be non-empty, 0 < ttl <= {max_ttl} seconds, wait >= 0, '
            '0 < liveness <= 60 seconds)';
    END IF;
    FOR i IN 1..4 LOOP
        IF NOT EXISTS (SELECT 1 FROM {s}.lease_waiter AS w WHERE w.name = p_name) THEN
            -- Nobody queued, live or dead: 0001's acquire of a free name, inline, tried first
            -- (a name held by anyone makes the insert do nothing). Its comments say why the
            -- token and the clock are read only once the row is ours: the insert may wait for
            -- a concurrent grant or release of the name. A waiter that queues meanwhile,
            -- unseen here, is handed the lease by its heartbeat's takeover once this grant ends.
            INSERT INTO {s}.lease AS l (name, holder, token, acquired_at, expires_at, metadata)
            VALUES (p_name, p_holder, 0, '-infinity', '-infinity', p_metadata)
            ON CONFLICT (name) DO NOTHING;
            IF FOUND THEN
                IF NOT p_durable THEN
                    PERFORM set_config('synchronous_commit', 'off', true);
                END IF;
                v_now := clock_timestamp();
                UPDATE {s}.lease AS l
                   SET token = nextval({seq}::regclass), acquired_at = v_now,
                       expires_at = v_now + make_interval(secs => p_ttl)
                 WHERE l.name = p_name
                RETURNING l.token, l.expires_at INTO v_token, v_expires;
                RETURN QUERY SELECT true, p_holder, v_token, v_now, v_expires, v_now,
                                    NULL::bigint;
                RETURN;
            END IF;
        END IF;
        SELECT l.holder, l.token, l.expires_at INTO v_holder, v_token, v_expires
          FROM {s}.lease AS l WHERE l.name = p_name;
        IF NOT FOUND OR v_expires <= clock_timestamp() OR v_holder = p_holder THEN
            SELECT w.holder INTO v_head FROM {s}.lease_waiter AS w
             WHERE w.name = p_name AND w.alive_until > clock_timestamp() ORDER BY w.id LIMIT 1;
            IF v_head IS NULL OR v_head = p_holder
               OR (v_holder = p_holder AND v_expires > clock_timestamp()) THEN
                -- Nobody live queued ahead (or this holder holds it): as 0001's acquire does.
                -- Its own waiter row goes, and dead ones too (a release hands over only when
                -- the row's waiters flag says someone queued: set it for those still behind).
                DELETE FROM {s}.lease_waiter AS w
                 WHERE w.name = p_name
                   AND (w.holder = p_holder OR w.alive_until <= clock_timestamp());
                RETURN QUERY SELECT a.*, NULL::bigint
                  FROM {s}.acquire(p_name, p_holder, p_ttl, p_metadata, p_wait, p_durable) AS a;
                UPDATE {s}.lease AS l SET waiters = true
                 WHERE l.name = p_name AND l.holder = p_holder AND NOT l.waiters
                   AND EXISTS (SELECT 1 FROM {s}.lease_waiter AS w WHERE w.name = p_name);
                RETURN;
            END IF;
            -- FIFO: the live head goes first, this caller queues behind it.
            IF EXISTS (SELECT 1 FROM {s}.take_over_v4(p_name, p_liveness)) THEN
                v_handed := true;
                CONTINUE;
            END IF;
        END IF;
        EXIT;
    END LOOP;
    IF NOT v_handed THEN
        PERFORM set_config('synchronous_commit', 'off', true);  -- nothing granted here
    END IF;
    IF p_wait IS DISTINCT FROM 0 THEN
        INSERT INTO {s}.lease_waiter AS w (name, holder, ttl, metadata, durable, alive_until)
        VALUES (p_name, p_holder, p_ttl, p_metadata, p_durable,
                clock_timestamp() + make_interval(secs => p_liveness))
        ON CONFLICT (name, holder) DO UPDATE
           SET ttl = excluded.ttl, metadata = excluded.metadata, durable = excluded.durable,
               alive_until = excluded.alive_until
        RETURNING w.id INTO v_id;
        -- A release by an 0001 client then sends its NOTIFY, and the queue looks at once.
        UPDATE {s}.lease AS l SET waiters = true WHERE l.name = p_name AND NOT l.waiters;
    END IF;
    SELECT l.holder, l.acquired_at, l.expires_at INTO v_holder, v_acquired, v_expires
      FROM {s}.lease AS l WHERE l.name = p_name;
    RETURN QUERY SELECT false, v_holder, NULL::bigint, v_acquired, v_expires, clock_timestamp(),
                        v_id;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.release_v4(p_name text, p_holder text, p_token bigint)
RETURNS TABLE (status text, notified boolean, next_holder text, next_token bigint,
               next_waiter bigint, next_acquired_at timestamptz, next_expires_at timestamptz)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
    v_waiters boolean;
    v_status text;
    v_next record;
BEGIN
    -- Nobody queued (a waiter sets the row's waiters flag in the transaction that queues it,
    -- and a handover sets it while others wait): as 0001's release, one statement.
    DELETE FROM {s}.lease AS l
     WHERE l.name = p_name AND l.holder = p_holder AND l.token = p_token AND NOT l.waiters
    RETURNING l.expires_at INTO v_expires;
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN QUERY SELECT CASE WHEN v_expires > clock_timestamp() THEN 'released'
                                 ELSE 'expired' END, false, NULL::text, NULL::bigint,
                            NULL::bigint, NULL::timestamptz, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT l.expires_at, l.waiters INTO v_expires, v_waiters FROM {s}.lease AS l
     WHERE l.name = p_name AND l.holder = p_holder AND l.token = p_token
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN QUERY SELECT 'not_held'::text, false, NULL::text, NULL::bigint, NULL::bigint,
                            NULL::timestamptz, NULL::timestamptz;
        RETURN;
    END IF;
    v_status := CASE WHEN v_expires > clock_timestamp() THEN 'released' ELSE 'expired' END;
    SELECT * INTO v_next FROM {s}.hand_over_v4(p_name, {window});
    IF FOUND THEN
        -- A handoff is a grant: this commit stays durable (unless that waiter asked otherwise),
        -- and the new holder acts only after it (the NOTIFY is delivered at commit).
        IF NOT v_next.durable THEN
            PERFORM set_config('synchronous_commit', 'off', true);
        END IF;
        RETURN QUERY SELECT v_status, true, v_next.holder, v_next.token, v_next.waiter,
                            v_next.acquired_at, v_next.expires_at;
        RETURN;
    END IF;
    -- Nobody to hand it to: as 0001's release (a lost release only delays the next holder).
    PERFORM set_config('synchronous_commit', 'off', true);
    DELETE FROM {s}.lease AS l WHERE l.name = p_name;
    IF v_waiters THEN
        PERFORM pg_notify({channel}, p_name);
    END IF;
    RETURN QUERY SELECT v_status, v_waiters, NULL::text, NULL::bigint, NULL::bigint,
                        NULL::timestamptz, NULL::timestamptz;
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.wait_v4(
    p_name text, p_holder text, p_waiter bigint, p_liveness double precision DEFAULT 1.0)
RETURNS TABLE (state text, ahead bigint, token bigint, acquired_at timestamptz,
               expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
    v_handed boolean := false;
    v_lease {s}.lease;
BEGIN
    IF p_liveness IS NULL OR NOT (p_liveness > 0 AND p_liveness <= 60) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'pglock wait_v4: liveness must be > 0 and <= 60 seconds';
    END IF;
    -- Expiry takeover: a lease free or expired while live waiters queue goes to the head.
    SELECT l.expires_at INTO v_expires FROM {s}.lease AS l WHERE l.name = p_name;
    IF NOT FOUND OR v_expires <= clock_timestamp() THEN
        v_handed := EXISTS (SELECT 1 FROM {s}.take_over_v4(p_name, p_liveness));
    END IF;
    IF NOT v_handed THEN
        PERFORM set_config('synchronous_commit', 'off', true);  -- a heartbeat only
    END IF;
    UPDATE {s}.lease_waiter AS w
       SET alive_until = clock_timestamp() + make_interval(secs => p_liveness)
     WHERE w.id = p_waiter AND w.name = p_name AND w.holder = p_holder
       AND w.alive_until > clock_timestamp();
    IF FOUND THEN
        RETURN QUERY SELECT 'waiting'::text,
            (SELECT count(*) FROM {s}.lease_waiter AS o
              WHERE o.name = p_name AND o.id < p_waiter AND o.alive_until > clock_timestamp()),
            NULL::bigint, NULL::timestamptz, NULL::timestamptz, clock_timestamp();
        RETURN;
    END IF;
    SELECT * INTO v_lease FROM {s}.lease AS l
     WHERE l.name = p_name AND l.holder = p_holder AND l.expires_at > clock_timestamp();
    IF FOUND THEN
        RETURN QUERY SELECT 'granted'::text, 0::bigint, v_lease.token, v_lease.acquired_at,
                            v_lease.expires_at, clock_timestamp();
        RETURN;
    END IF;
    -- Skipped as dead (or never queued): the caller queues again, at the tail.
    DELETE FROM {s}.lease_waiter AS w WHERE w.id = p_waiter AND w.holder = p_holder;
    RETURN QUERY SELECT 'gone'::text, NULL::bigint, NULL::bigint, NULL::timestamptz,
                        NULL::timestamptz, clock_timestamp();
END
$pglock$;

CREATE OR REPLACE FUNCTION {s}.leave_v4(p_name text, p_holder text, p_waiter bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {s}, pg_temp
AS $pglock$
DECLARE
    v_token bigint;
BEGIN
    DELETE FROM {s}.lease_waiter AS w
     WHERE w.id = p_waiter AND w.name = p_name AND w.holder = p_holder;
    IF FOUND THEN
        -- Durable: the caller's acquire() returns False on this answer. A leave lost in a
        -- crash would bring the row back and the queue would hand a grant nobody believes
        -- (found by T35 under an immediate restart). One flush per timed-out wait only.
        RETURN true;
    END IF;
    -- Handed the lease as it gave up: pass it on (or free it) rather than let it stall a TTL.
    SELECT l.token INTO v_token FROM {s}.lease AS l
     WHERE l.name = p_name AND l.holder = p_holder AND l.expires_at > clock_timestamp();
    IF FOUND THEN
        PERFORM {s}.release_v4(p_name, p_holder, v_token);  -- durable if it hands over
    ELSE
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN false;
END
$pglock$;

REVOKE ALL ON TABLE {s}.lease_waiter FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.token_epoch_v4() FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.hand_over_v4(text, double precision) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.take_over_v4(text, double precision) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.acquire_v4(text, text, double precision, jsonb, double precision, boolean, double precision) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.release_v4(text, text, bigint) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.wait_v4(text, text, bigint, double precision) FROM PUBLIC;

REVOKE ALL ON FUNCTION {s}.leave_v4(text, text, bigint) FROM PUBLIC;

COMMENT ON TABLE {s}.lease_waiter IS 'pglock lease waiters: one row per waiter, served in id order while alive_until > clock_timestamp()';

COMMENT ON FUNCTION {s}.acquire_v4(text, text, double precision, jsonb, double precision, boolean, double precision) IS 'pglock: take or renew a lease, or queue for it (waiter_id); granted, holder, token, acquired_at, expires_at, server_time, waiter_id';

COMMENT ON FUNCTION {s}.release_v4(text, text, bigint) IS 'pglock: release a lease, handing it to the first live waiter in the same transaction';

COMMENT ON FUNCTION {s}.wait_v4(text, text, bigint, double precision) IS 'pglock: a queued waiter''s heartbeat: waiting (ahead), granted or gone; takes over an expired lease for the queue head';

INSERT INTO {s}.schema_revision (revision) VALUES ({rev}) ON CONFLICT DO NOTHING;
