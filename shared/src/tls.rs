//! The process-wide TLS crypto provider: one stack (rustls with ring) for sqlx, reqwest and the AWS SDK.

/// Installs rustls' ring provider as the process default (idempotent). reqwest is built without a provider
/// so that one TLS stack (ring) serves sqlx, reqwest and the AWS SDK.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
