//! [`RelayError`]: what ends a relay invocation, and how it reaches Lambda.

/// A relay failure that ends an invocation.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A database statement failed.
    #[error("database error during {step}")]
    Database {
        /// Which step.
        step: &'static str,
        #[source]
        source: sqlx::Error,
    },
    /// The invocation cannot hold one lease plus the deadline margin, so it would claim nothing: refused rather
    /// than reported as an empty success ([`RelayConfig::check_invocation_budget`]).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// A subscriber of `OUTBOX_SUBSCRIBERS` could not be made live (a bad name or URL, or the database).
    #[error("OUTBOX_SUBSCRIBERS: {topic}:{name}: {source}")]
    Subscriber {
        topic: String,
        name: String,
        #[source]
        source: crate::subscribers::SubscriberError,
    },
    /// The relay's `CONSUMER_NAME` (the default subscriber's dedupe namespace) could not be recorded: a live named
    /// subscriber has that name, or the database.
    #[error("CONSUMER_NAME: {0}")]
    DefaultConsumer(#[source] crate::subscribers::SubscriberError),
}

pub(super) fn db(step: &'static str) -> impl FnOnce(sqlx::Error) -> RelayError {
    move |source| RelayError::Database { step, source }
}

impl From<RelayError> for lambda_runtime::Diagnostic {
    fn from(e: RelayError) -> Self {
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        lambda_runtime::Diagnostic {
            error_type: "RelayError".into(),
            error_message: message,
        }
    }
}
