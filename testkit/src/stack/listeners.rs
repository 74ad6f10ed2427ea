//! The local receivers' listeners: the consumer and the failure/delivery-callback handlers served on local ports
//! through [`outbox::local`], each answering 503 without reaching its handler while switched down, every request
//! recorded when asked for.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use outbox::ReceiverState;
use outbox::consumer::{ConsumerState, handle_event};
use outbox::internals::callbacks::handle_callback;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::recording::{Receiver, Recorder, recorded};

// The two listeners are spawned by plain functions so that the tasks' (deeply nested) future types are laid out
// here, in this crate, and never in the crates that await `LocalStack::start` (where they overflowed the default
// query depth limit of the test crates).

/// Serves the consumer handler on `listener` until `shutdown` turns true; while `down` is set, every delivery
/// is answered 503 without reaching it.
pub(super) fn serve_consumer(
    listener: tokio::net::TcpListener,
    state: Arc<ConsumerState>,
    recorder: Option<Recorder>,
    down: Option<Arc<AtomicBool>>,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<std::io::Result<()>> {
    tokio::spawn(outbox::local::serve(
        listener,
        move |req| {
            let (c, rec, down) = (state.clone(), recorder.clone(), down.clone());
            async move {
                recorded(rec.as_ref(), Receiver::Consumer, req, async |req| {
                    if down.as_ref().is_some_and(|d| d.load(Ordering::SeqCst)) {
                        return switched_off("consumer");
                    }
                    handle_event(&c, req).await
                })
                .await
            }
        },
        async move {
            let _ = shutdown.wait_for(|s| *s).await;
        },
    ))
}

/// Serves the failure and delivery callback handler on `listener` until `shutdown` turns true. While `down` is
/// set, every request is answered 503 without reaching the handler: the callback function throttled, or erroring
/// because its database is unreachable ([`LocalStack::set_callbacks_down`]).
///
/// [`LocalStack::set_callbacks_down`]: crate::stack::LocalStack::set_callbacks_down
pub(super) fn serve_callbacks(
    listener: tokio::net::TcpListener,
    state: Arc<ReceiverState>,
    recorder: Option<Recorder>,
    down: Arc<AtomicBool>,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<std::io::Result<()>> {
    tokio::spawn(outbox::local::serve(
        listener,
        move |req| {
            let (c, rec, down) = (state.clone(), recorder.clone(), down.clone());
            async move {
                recorded(rec.as_ref(), Receiver::Callbacks, req, async |req| {
                    if down.load(Ordering::SeqCst) {
                        return switched_off("callback function");
                    }
                    handle_callback(&c, req).await
                })
                .await
            }
        },
        async move {
            let _ = shutdown.wait_for(|s| *s).await;
        },
    ))
}

/// What a function switched off by a test answers: 503, `<who> unavailable (test switch)`.
fn switched_off(who: &str) -> lambda_http::Response<lambda_http::Body> {
    let mut r = lambda_http::Response::new(lambda_http::Body::from(format!(
        "{who} unavailable (test switch)"
    )));
    *r.status_mut() = lambda_http::http::StatusCode::SERVICE_UNAVAILABLE;
    r
}

pub(super) async fn listen() -> anyhow::Result<(tokio::net::TcpListener, String)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", l.local_addr()?);
    Ok((l, url))
}
