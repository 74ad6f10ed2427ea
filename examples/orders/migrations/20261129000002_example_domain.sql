-- The example domain the consumer Lambda ships with (outbox::example): an `orders` topic whose events create a
-- charge and a shipment, and cancel them. Deliberately without a unique key on order_id: the consumer's dedupe
-- (processed_messages), not a business constraint, is what keeps a redelivered event from charging twice, and
-- the tests prove it by counting rows.

CREATE TABLE charges (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id     text        NOT NULL,
    customer_id  text        NOT NULL,
    amount_cents bigint      NOT NULL CHECK (amount_cents >= 0),
    currency     text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    status       text        NOT NULL DEFAULT 'captured' CHECK (status IN ('captured', 'refunded')),
    outbox_id    bigint      NOT NULL,  -- the event that created it (traceability)
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX charges_order_idx ON charges (order_id);

CREATE TABLE shipments (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id    text        NOT NULL,
    customer_id text        NOT NULL,
    items       jsonb       NOT NULL,
    status      text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'cancelled')),
    outbox_id   bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX shipments_order_idx ON shipments (order_id);

-- The unordered example topic `audit`: one row per event.
CREATE TABLE audit_log (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    outbox_id  bigint      NOT NULL,
    actor      text        NOT NULL,
    action     text        NOT NULL,
    details    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);
