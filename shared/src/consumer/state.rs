//! [`ConsumerState`]: the consumer function's state, built once per process.

use crate::config::ConfigError;
use crate::receiver::{Receiver, ReceiverState};

use super::registry::Registry;

/// The consumer function's state: the receiver state plus the topic handlers.
#[derive(Debug)]
pub struct ConsumerState {
    /// Pool, keys, config.
    pub receiver: ReceiverState,
    /// The topic handlers.
    pub registry: Registry,
}

impl ConsumerState {
    /// Combines the parts.
    pub fn new(receiver: ReceiverState, registry: Registry) -> Self {
        ConsumerState { receiver, registry }
    }

    /// [`ReceiverState::from_env`] for [`Receiver::Consumer`], plus `registry`.
    pub async fn from_env(registry: Registry) -> Result<Self, ConfigError> {
        Ok(ConsumerState {
            receiver: ReceiverState::from_env(Receiver::Consumer).await?,
            registry,
        })
    }
}
