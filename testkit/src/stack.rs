//! The local pipeline as a library: the QStash-compatible dev server (in process), the consumer and the
//! failure/delivery-callback handlers served on local ports through [`outbox::local`] (the same handler
//! functions the Lambdas run, called through the function-URL event), and the relay running simulated
//! invocations through its Lambda handler. `outbox-dev dev` and the whole-system tests build on it; by default it
//! runs the example application (`orders_example`), and any other registry and migrations can take its place
//! ([`StackOptions::registry`], [`StackOptions::migrators`]).

mod listeners;
mod options;
mod recording;
mod running;
mod start;

pub use options::{StackOptions, SubscriberOptions};
pub use recording::{Receiver, RecordedRequest};
pub use running::LocalStack;
