-- Fan-out (decision record 0068): a subscriber's replay is delivered under a flow-control key of its own, at
-- QSTASH_REPLAY_PARALLELISM messages at once. A consumer that can take more (or less) than the relay's setting
-- gets its own value here (`outbox subscribers add|replay --replay-parallelism N`); NULL = the relay's setting.

ALTER TABLE outbox_subscribers
    ADD COLUMN replay_parallelism integer
        CONSTRAINT outbox_subscribers_replay_parallelism CHECK (replay_parallelism BETWEEN 1 AND 1000);
