-- The console logs an action before it runs and completes the row with the outcome afterwards (docs/console.md):
-- a failure half-way (a database error, a statement timeout, the console stopped) still leaves a record of what
-- was started, and of what was done before it failed. A row without finished_at never reported back.
ALTER TABLE outbox_console_actions ALTER COLUMN outcome DROP NOT NULL;
ALTER TABLE outbox_console_actions ADD COLUMN finished_at timestamptz;
-- Rows written before this migration were written once the action had finished.
UPDATE outbox_console_actions SET finished_at = at;
