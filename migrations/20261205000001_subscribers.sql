-- Fan-out (decision record 0068): a topic has one or more named subscribers, each with its own destination, and
-- every event is written once per subscriber of its topic (a "copy", an outbox row of its own) by the producer's
-- one statement. Each copy has its own state (lease, attempts, delivery evidence, dead letter, redrive), so
-- subscribers are isolated by construction; an ordered topic's per-key state is kept per (topic, key, subscriber).
--
-- The subscriber named '' is the default one: the relay's CONSUMER_URL and CONSUMER_NAME. Every existing row,
-- key and dead letter belongs to it, so an existing deployment changes nothing. A topic has the default
-- subscriber unless a row (topic, '') here says it was removed.

CREATE TABLE outbox_subscribers (
    topic        text        NOT NULL,
    name         text        NOT NULL,  -- '' = the default subscriber (CONSUMER_URL / CONSUMER_NAME)
    url          text,                  -- the consumer's base URL: deliveries go to {url}/events/{topic}; NULL for ''
    added_at     timestamptz NOT NULL DEFAULT now(),
    removed_at   timestamptz,
    -- Replay of retained history (`outbox subscribers add --from`): the retained events of the topic with an
    -- event id from replay_from up to replay_to (the last id written before every producer saw the subscriber)
    -- that have no copy for it are copied, a chunk per transaction, in event id order; replayed_to is how far
    -- it got (copies and cursor move in one transaction). Until replay_done_at, the subscriber's ordered keys
    -- wait (their lane's available_at is 'infinity'), so a key's live events never overtake its replayed ones.
    replay_from    bigint,
    replay_to      bigint,
    replayed_to    bigint,
    replayed       bigint      NOT NULL DEFAULT 0,  -- events copied by the replay so far
    replay_done_at timestamptz,
    PRIMARY KEY (topic, name),
    CONSTRAINT outbox_subscribers_name CHECK (name ~ '^([a-z0-9][a-z0-9_.-]{0,62})?$'),
    CONSTRAINT outbox_subscribers_url CHECK (name = '' OR url IS NOT NULL)
);

-- Which subscriber a copy is for, and the event it is a copy of (NULL: the row is the event's first copy, the
-- event id is its own id). Metadata-only changes: no table rewrite.
ALTER TABLE outbox ADD COLUMN subscriber text NOT NULL DEFAULT '';
ALTER TABLE outbox ADD COLUMN event_id bigint;

-- An ordered key's relay state is per subscriber: one subscriber's dead head or slow consumer never holds back
-- another's.
ALTER TABLE outbox_keys ADD COLUMN subscriber text NOT NULL DEFAULT '';
ALTER TABLE outbox_keys DROP CONSTRAINT outbox_keys_pkey;
ALTER TABLE outbox_keys ADD PRIMARY KEY (topic, partition_key, subscriber);

-- The head of a key's lane is found by (topic, key, subscriber, seq).
DROP INDEX outbox_key_seq_idx;
CREATE INDEX outbox_key_seq_idx ON outbox (topic, partition_key, subscriber, seq) WHERE seq IS NOT NULL;

-- Replay reads the retained copies of a topic's events in event id order.
CREATE INDEX outbox_event_idx ON outbox (topic, (coalesce(event_id, id)));

-- Dead letters say whose delivery failed.
ALTER TABLE dead_letters ADD COLUMN subscriber text NOT NULL DEFAULT '';
