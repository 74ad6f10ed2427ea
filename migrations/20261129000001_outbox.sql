-- The transactional outbox. Starts from the seed article's schema; additions are marked (+) and explained in
-- docs/decisions/0002-outbox-schema.md.

CREATE TABLE outbox (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic             text        NOT NULL,
    partition_key     text        NOT NULL,
    seq               bigint,                                  -- (+) per-key sequence; NULL for unordered topics
    payload           jsonb       NOT NULL,
    headers           jsonb       NOT NULL DEFAULT '{}'::jsonb, -- traceparent, correlation id, schema version
    created_at        timestamptz NOT NULL DEFAULT now(),
    available_at      timestamptz NOT NULL DEFAULT now(),      -- delay, backoff, and the lease (see below)
    dispatched_at     timestamptz,                             -- accepted by QStash
    delivered_at      timestamptz,                             -- (+) delivery evidence (QStash callback, 2xx)
    dead_lettered_at  timestamptz,
    attempts          integer     NOT NULL DEFAULT 0,          -- counted at claim time
    locked_until      timestamptz,                             -- lease end while a relay holds the row
    lease_token       bigint,                                  -- (+) fencing token of the current lease
    last_error        text,
    qstash_message_id text,                                    -- (+) last message id QStash gave us
    redrive_count     integer     NOT NULL DEFAULT 0,          -- (+) bumped by a redrive: fresh QStash dedup id
    CONSTRAINT outbox_topic_not_empty CHECK (topic <> ''),
    CONSTRAINT outbox_key_not_empty   CHECK (partition_key <> ''),
    CONSTRAINT outbox_seq_positive    CHECK (seq IS NULL OR seq > 0)
) WITH (fillfactor = 85);  -- room on each page for updates that touch no indexed column (HOT)

-- The unordered claim path. A lease is taken by pushing available_at past the lease end, so one index serves
-- "due", "not leased" and "backoff" at once and rows in flight sort to the end. Covers only rows the relay can
-- still act on; dispatched and dead rows leave it.
CREATE INDEX outbox_claim_idx ON outbox (available_at, id)
    WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL AND seq IS NULL;

-- Ordered topics: the head of a key is found by (topic, partition_key, seq); the uniqueness also proves that
-- sequence allocation never hands out a number twice.
CREATE UNIQUE INDEX outbox_key_seq_idx ON outbox (topic, partition_key, seq) WHERE seq IS NOT NULL;

-- "Oldest pending age" (the number to alarm on) without scanning the backlog.
CREATE INDEX outbox_pending_created_idx ON outbox (created_at)
    WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL;

-- Throughput per minute and retention: BRIN is nearly free to maintain on an append-mostly table.
CREATE INDEX outbox_dispatched_brin ON outbox USING brin (dispatched_at);

-- One token per claim statement; every later write about a claimed row is fenced on it.
CREATE SEQUENCE outbox_lease_token_seq;

-- (+) Per-key sequence for ordered topics, written only by producers. The row lock taken by the
-- INSERT .. ON CONFLICT DO UPDATE is held until the producer commits, so a second producer on the same key
-- waits: sequence order is commit order.
CREATE TABLE outbox_sequences (
    topic         text   NOT NULL,
    partition_key text   NOT NULL,
    last_seq      bigint NOT NULL,
    PRIMARY KEY (topic, partition_key)
);

-- (+) Relay-side state of each active ordered key (one row while the key has work). Producers only ever insert
-- a missing row (ON CONFLICT DO NOTHING) and never lock an existing one, so a slow business transaction
-- cannot stall the relay. A relay claims a key, not a row: two relays can never hold the same key.
CREATE TABLE outbox_keys (
    topic          text        NOT NULL,
    partition_key  text        NOT NULL,
    done_seq       bigint      NOT NULL,               -- every event with seq <= done_seq is finished
    available_at   timestamptz NOT NULL DEFAULT now(), -- the head may be claimed from then on
    lease_token    bigint,
    locked_until   timestamptz,
    inflight_id    bigint,                             -- head accepted by QStash, awaiting delivery evidence
    inflight_since timestamptz,
    blocked_at     timestamptz,                        -- head is dead and the topic's policy is "block"
    blocked_id     bigint,
    blocked_reason text,
    PRIMARY KEY (topic, partition_key)
) WITH (fillfactor = 70);

CREATE INDEX outbox_keys_ready_idx ON outbox_keys (available_at) WHERE blocked_at IS NULL;

-- Consumer dedupe: the row is inserted first, in the same transaction as the side effects.
CREATE TABLE processed_messages (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX processed_messages_processed_at_brin ON processed_messages USING brin (processed_at);

-- (+) Consumer side of the ordering contract: the last sequence each consumer applied per key.
CREATE TABLE consumer_sequences (
    consumer      text        NOT NULL,
    topic         text        NOT NULL,
    partition_key text        NOT NULL,
    last_seq      bigint      NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition_key)
);

-- One queryable place for everything that did not make it: relay-side exhaustion or permanent publish errors
-- (source 'relay') and QStash failure callbacks (source 'qstash'). Idempotent on (source, natural_id).
CREATE TABLE dead_letters (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source            text        NOT NULL,
    natural_id        text        NOT NULL,  -- relay: '<outbox id>/<lease token>'; qstash: the dlqId
    outbox_id         bigint,
    topic             text,
    partition_key     text,
    seq               bigint,
    payload           jsonb,                 -- the event payload when it is JSON
    body              bytea,                 -- the raw body when it is not
    headers           jsonb,
    error             text        NOT NULL,
    status            integer,               -- HTTP status from QStash (publish) or from the consumer
    response_body     text,
    attempts          integer,
    qstash_message_id text,
    dlq_id            text,
    raw_callback      bytea,                 -- a failure-callback body that could not be parsed, kept as is
    parse_error       text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    redriven_at       timestamptz,
    resolved_at       timestamptz,           -- the event was delivered after all (late evidence)
    CONSTRAINT dead_letters_source CHECK (source IN ('relay', 'qstash')),
    CONSTRAINT dead_letters_natural UNIQUE (source, natural_id)
);
CREATE INDEX dead_letters_created_idx ON dead_letters (created_at);
CREATE INDEX dead_letters_topic_idx ON dead_letters (topic, created_at);
CREATE INDEX dead_letters_outbox_idx ON dead_letters (outbox_id) WHERE outbox_id IS NOT NULL;
