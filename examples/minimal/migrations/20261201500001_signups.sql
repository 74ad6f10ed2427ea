-- The minimal example's one table: a signup (the business row the producer writes) and when it was welcomed
-- (what the handler does). Its version must not be one of the outbox's (migrations/), which share the
-- _sqlx_migrations table: 20261201000001 became the library's relay_outage, so the example moved to 500001.
CREATE TABLE signups (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant      text        NOT NULL,                 -- travels to the handler as the event's `tenant` header
    email       text        NOT NULL,
    welcomed_at timestamptz
);
