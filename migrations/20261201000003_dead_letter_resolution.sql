-- How a dead letter turned out resolved: 'delivered' (delivery evidence arrived after it was recorded) or 'applied'
-- (QStash gave up, but the consumer's dedupe row shows it applied the event: every response was lost on the way
-- back). A resolved dead letter needs no operator and does not block its key.
ALTER TABLE dead_letters ADD COLUMN resolution text;
UPDATE dead_letters SET resolution = 'delivered' WHERE resolved_at IS NOT NULL;
ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_resolution CHECK (resolution IN ('delivered', 'applied'));
