-- Fairness keys (decision record 0076): the producer may name who an event belongs to (a tenant), and the relay
-- shares each claim among the keys with waiting events, so one tenant's flood does not delay everyone else's.
--
-- '' is "no key": every row written before this migration and every event enqueued without one. A column with a
-- constant default is added without rewriting the table, so the upgrade takes no long lock; a relay of the
-- previous version ignores the column and a producer of the previous version writes ''.
-- Byte order ("C"): the relay walks the keys from a cursor, and its next cursor is the last key visited plus the
-- smallest character (keys hold no control characters, the producer checks that).
ALTER TABLE outbox ADD COLUMN fairness_key text COLLATE "C" NOT NULL DEFAULT '';

-- The fair claim: one probe per key to find the keys with waiting unordered events (a loose index scan), then each
-- key's oldest due rows. Partial, like outbox_claim_idx: only rows the relay can still act on.
CREATE INDEX outbox_fair_claim_idx ON outbox (fairness_key, available_at, id)
    WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL AND seq IS NULL;

-- Paused tenants: their events wait in the outbox (unordered ones with available_at = 'infinity' until resumed,
-- ordered heads are not claimed); logged in outbox_console_actions like the console's other actions.
CREATE TABLE outbox_paused_keys (
    fairness_key text COLLATE "C" PRIMARY KEY CHECK (fairness_key <> ''),
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text NOT NULL,
    reason text
);
