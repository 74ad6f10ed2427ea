//! Logging and tracing setup shared by every binary.
//!
//! - [`logs`]: JSON lines through `tracing` (CloudWatch reads the top-level `level`), level from
//!   `AWS_LAMBDA_LOG_LEVEL` or `RUST_LOG` (default `info`). Secrets are never logged: they are
//!   [`secrecy::SecretString`] values whose `Debug` is redacted, and no code path formats them.
//! - `export`: spans exported by OTLP (HTTP/protobuf) when the standard `OTEL_*` variables say so, nothing
//!   otherwise; [`flush`] sends them within a bound before a Lambda invocation returns.
//! - `spans`: the messaging spans of the producer, the relay and the consumer.

pub(crate) mod export;
mod logs;
pub(crate) mod spans;

pub use export::{ExportStats, flush, stats};
pub(crate) use logs::error_chain;
pub use logs::{LogFormat, filter_from, init, init_from_env, trace_layer};
