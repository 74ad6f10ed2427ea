-- A third way a dead letter turns out resolved: 'withdrawn'. QStash gave up on a copy for a named subscriber whose
-- outbox row no longer exists: the subscriber's removal deleted it while QStash still held its message (decision
-- record 0070). That copy was not owed any more; recording its failure open would page an operator for an event
-- with nothing left to do. The failure is kept, resolved, for the record.
-- Widened without a long lock: the new constraint is added NOT VALID (no scan under the ACCESS EXCLUSIVE lock),
-- then validated under a lock that lets reads and writes go on.
ALTER TABLE dead_letters DROP CONSTRAINT dead_letters_resolution;
ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_resolution
    CHECK (resolution IN ('delivered', 'applied', 'withdrawn')) NOT VALID;
ALTER TABLE dead_letters VALIDATE CONSTRAINT dead_letters_resolution;
