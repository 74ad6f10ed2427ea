-- The producer side of the example domain: the order service's own table. The demo producer (`outbox dev`)
-- inserts an order and enqueues its `orders` event in the same transaction.
CREATE TABLE orders (
    id           text        PRIMARY KEY,
    customer_id  text        NOT NULL,
    amount_cents bigint      NOT NULL,
    currency     text        NOT NULL,
    status       text        NOT NULL DEFAULT 'placed' CHECK (status IN ('placed', 'cancelled')),
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
