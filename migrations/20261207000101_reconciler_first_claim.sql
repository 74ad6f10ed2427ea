-- The reconciler never causes a second application (decision record 0015). It may publish an event QStash lost
-- again only while a dedupe row written by an earlier application of it would outlive every delivery of the new
-- message; the earliest such application follows the event's FIRST claim, not its latest dispatch (every republish
-- and redrive dispatches it anew).

-- When a relay first claimed the event to publish it: the earliest time QStash can have accepted it (a publish
-- answered with an error, or whose relay died before recording it, may have been accepted), and so the earliest
-- time a consumer can have applied it. Set by the claim statements, kept by republishes and redrives.
-- '-infinity' on a row a redrive re-inserted after its row was pruned: when it was first published is unknown.
-- NULL: never claimed (or claimed by a relay older than this column: the reconciler then falls back on created_at).
ALTER TABLE outbox ADD COLUMN first_claimed_at timestamptz;

-- Set by the reconciler when it puts an event back to pending to be published again: the latest time the relay may
-- still publish it. A row still pending after it (QStash down, say) becomes an "unaccounted" dead letter instead.
-- Cleared when the event is dispatched or dies.
ALTER TABLE outbox ADD COLUMN republish_by timestamptz;
CREATE INDEX outbox_republish_by_idx ON outbox (republish_by) WHERE republish_by IS NOT NULL;

-- Events that may have been published before this migration: they count from their creation, which is earlier
-- than any claim (pending rows never claimed keep NULL and get their first claim's time).
UPDATE outbox SET first_claimed_at = created_at
WHERE delivered_at IS NULL
  AND (attempts > 0 OR dispatched_at IS NOT NULL OR dead_lettered_at IS NOT NULL
       OR redrive_count > 0 OR republish_count > 0);
