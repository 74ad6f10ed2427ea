//! The fixed parts of an `Upstash-Signature` token: its header, issuer, size limit and encoding.

use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};

/// The request header carrying the token (header names are case-insensitive).
pub const SIGNATURE_HEADER: &str = "upstash-signature";
/// The only issuer accepted.
pub const ISSUER: &str = "Upstash";
/// Tokens longer than this are refused without further work (real ones are ~450 bytes).
pub const MAX_TOKEN_BYTES: usize = 4096;

/// base64url, no padding written; padding tolerated when reading.
pub(super) const B64URL: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    GeneralPurposeConfig::new()
        .with_encode_padding(false)
        .with_decode_padding_mode(DecodePaddingMode::Indifferent),
);
