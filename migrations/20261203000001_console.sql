-- The operator console (`outbox console`, docs/console.md): what it needs beyond `outbox status`.

-- Dead letters grouped by their normalised error: runs of digits become `N` (ids, amounts, counts and attempt
-- numbers differ between alike failures) and only the first 200 characters count. Stored, so that grouping and
-- the "this group" filter read a column instead of running a regular expression over every row.
ALTER TABLE dead_letters ADD COLUMN error_group text
    GENERATED ALWAYS AS (regexp_replace(left(error, 200), '[0-9]+', 'N', 'g')) STORED;
-- Grouping (count, first and last id per group) and the "this group" filter, read from the index alone: the
-- handled state is included so that counting the unhandled ones of each group never visits the table.
CREATE INDEX dead_letters_group_idx ON dead_letters (error_group, id) INCLUDE (redriven_at, resolved_at);

-- Dead letters by topic and source in each state (`outbox status`, the console's overview and topics page), read
-- from the index alone instead of grouping the whole table.
CREATE INDEX dead_letters_topic_state_idx ON dead_letters (topic, source)
    INCLUDE (redriven_at, resolved_at, resolution, created_at);

-- Purge keeps the dead letter of an event that blocks its key: one probe per dead letter (it was a scan of
-- outbox_keys per dead letter: 30 s for a purge count over 16,000 dead letters with 10,000 keys).
CREATE INDEX outbox_keys_blocked_idx ON outbox_keys (blocked_id) WHERE blocked_id IS NOT NULL;

-- Search by key (prefix) across topics; the primary key leads with the topic.
CREATE INDEX outbox_sequences_key_idx ON outbox_sequences (partition_key text_pattern_ops);

-- Every state-changing action taken through the console: who (the token's name, or `local` on a loopback
-- console without tokens), what, on which selection, and what it did.
CREATE TABLE outbox_console_actions (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at             timestamptz NOT NULL DEFAULT now(),
    actor          text        NOT NULL,
    action         text        NOT NULL,  -- redrive, redrive_bulk, purge
    dead_letter_id bigint,                -- a single-dead-letter action
    outbox_id      bigint,                -- its event
    selection      jsonb,                 -- a bulk action's filter
    outcome        jsonb       NOT NULL   -- counts, or the refusal
);
CREATE INDEX outbox_console_actions_outbox_idx ON outbox_console_actions (outbox_id) WHERE outbox_id IS NOT NULL;
