-- The default subscriber's dedupe namespace: the relay's CONSUMER_NAME, recorded by the relay when it starts
-- (decision record 0070). A named subscriber's consumer dedupes under its own name; one named like the default
-- subscriber's consumer would share its namespace, and each would take the other's events for duplicates. With the
-- name on record, `outbox subscribers add` refuses such a name, and a relay refuses to start with a CONSUMER_NAME a
-- live named subscriber has.
CREATE TABLE outbox_default_consumer (
    only_row      boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    consumer_name text        NOT NULL,
    recorded_at   timestamptz NOT NULL DEFAULT now()
);
