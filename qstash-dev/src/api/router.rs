//! The QStash API's routes, each to its handler in the file of its section.

use std::sync::Arc;

use axum::Router;
use axum::routing::{delete, get, post};

use super::{dlq, flow, keys, messages, publish, queues};
use crate::state::Shared;

/// The QStash API's routes, to be put behind the gate ([`guarded`](super::guarded)).
pub(crate) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v2/publish/{*destination}", post(publish::publish))
        .route("/v2/enqueue/{queue}/{*destination}", post(publish::enqueue))
        .route("/v2/batch", post(publish::batch))
        .route("/v2/messages", delete(messages::cancel_messages))
        .route(
            "/v2/messages/{id}",
            get(messages::get_message).delete(messages::cancel_message),
        )
        .route("/v2/dlq", get(dlq::list_dlq).delete(dlq::delete_dlq_bulk))
        .route("/v2/dlq/retry", post(dlq::retry_dlq_bulk))
        .route("/v2/dlq/retry/{id}", post(dlq::retry_dlq_one))
        .route(
            "/v2/dlq/{id}",
            get(dlq::get_dlq).delete(dlq::delete_dlq_one),
        )
        .route(
            "/v2/queues",
            post(queues::upsert_queue).get(queues::list_queues),
        )
        .route(
            "/v2/queues/{name}",
            get(queues::get_queue).delete(queues::delete_queue),
        )
        .route("/v2/queues/{name}/pause", post(queues::pause_queue))
        .route("/v2/queues/{name}/resume", post(queues::resume_queue))
        .route("/v2/flowControl", get(flow::list_flows))
        .route("/v2/flowControl/{key}", get(flow::get_flow))
        .route("/v2/flowControl/{key}/{action}", post(flow::flow_action))
        .route("/v2/globalParallelism", get(flow::global_parallelism))
        .route("/v2/keys", get(keys::get_keys))
        .route("/v2/keys/rotate", post(keys::rotate_keys))
}
