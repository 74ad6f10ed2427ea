-- A QStash outage, shared by every relay (decision record 0012): one row, always present. `since IS NULL` means
-- no outage. While `next_probe_at` lies in the future no relay claims anything; when it is due, the one relay
-- whose conditional UPDATE moves it forward (the probe lease) publishes a small claim to find out whether
-- QStash is back.
CREATE TABLE outbox_relay_outage (
    id            boolean     PRIMARY KEY DEFAULT true CHECK (id),  -- a single row
    since         timestamptz,                                      -- first failed cycle of this outage
    last_error    text,
    failures      integer     NOT NULL DEFAULT 0,                   -- consecutive failed cycles / probes
    next_probe_at timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
INSERT INTO outbox_relay_outage (id) VALUES (true);
