//! The `Upstash-Signature` receiver: QStash signs every delivery (and every callback) with an HS256 JWT whose
//! claims bind the token to the URL it was sent to (`sub`) and to the exact body bytes (`body` =
//! base64url(SHA-256(body))). Nothing is read from or written to the database before this check passes.
//!
//! What is checked, in this order (decision record 0020):
//!
//! 1. the token is three base64url segments, at most `MAX_TOKEN_BYTES` (`token.rs`) long;
//! 2. the protected header says `"alg":"HS256"` (so `none`, `RS256`, `HS512`… are refused before any HMAC);
//! 3. the HMAC-SHA256 of `header.payload`, keyed with the **bytes of the signing-key string** (the `sig_`
//!    prefix included, no base64 decoding), equals the signature under the **current** key, else under the
//!    **next** key — compared in constant time;
//! 4. `iss == "Upstash"`;
//! 5. `exp` is present and `exp > now - tolerance`;
//! 6. `nbf`, when present, is `<= now + tolerance` — parsed as `i64`: QStash sends `-62135596800` since 2024;
//! 7. `sub` equals the URL this request was sent to ([`request_url`]), exactly (constant time);
//! 8. `body` equals base64url(SHA-256(raw body bytes)), with trailing `=` ignored on both sides (constant time).
//!
//! Each failure is a [`VerifyError`] that names the failed check and never includes a key. The clock is
//! injectable ([`Clock`]) so the real QStash tokens in the tests verify years after they expired.
//!
//! **Key rotation without redeploy:** [`KeyRing`] holds the keys and, when a token matches neither, re-reads the
//! secret (at most once per `SECRET_REFRESH_INTERVAL_SECS`, default 60) and tries again.
//!
//! **The URL (`sub`) is never chosen by the client** (decision record 0021): QStash signs the URL it was *told*
//! to call. Without `PUBLIC_BASE_URL` the receiver rebuilds it from what AWS sets on the function-URL event
//! (`requestContext.domainName`), not from client-sent `Host` or `X-Forwarded-*` headers — otherwise a token
//! issued for another host could be replayed here. Behind CloudFront, API Gateway, a custom domain or `cargo
//! lambda watch` the function sees another host or path than the public one: set `PUBLIC_BASE_URL` (the
//! scheme+host[+prefix] QStash calls), or `TRUST_FORWARDED_HEADERS=true` when the proxy in front sets them.
//!
//! | file | what |
//! |---|---|
//! | `verify.rs` | [`verify`]: the checks above, pure (no I/O), and [`VerifyError`], [`Claims`], [`Clock`] |
//! | `keys.rs` | [`SigningKeys`] and the [`KeyRing`] that re-reads them when QStash rotates |
//! | `url.rs` | [`request_url`]: the URL QStash called, from a [`UrlSource`] |
//! | `state.rs` | [`ReceiverState`]: config, pool, keys — what a receiver function holds for its lifetime |
//! | `http.rs` | what both receivers answer with: JSON, QStash's 489 "do not retry" ([`STATUS_NONRETRYABLE`]) |
//! | `testing.rs` | feature `testing` only: `sign` like QStash, the dev keys, re-signing `events/` fixtures |
//!
//! `request.rs`: [`verify_request`] puts them together for one request.

pub(crate) mod http;
mod keys;
mod request;
mod signing_keys;
mod state;
#[cfg(any(test, feature = "testing"))]
mod testing;
mod token;
mod url;
mod verify;

pub use keys::{KeyRing, RECEIVER_SECRETS};
pub(crate) use request::verify_request;

pub use signing_keys::SigningKeys;
pub use state::{Receiver, ReceiverState};
#[cfg(any(test, feature = "testing"))]
#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for `crate::internals`
pub use testing::{DEV_SIGNING_KEYS, decode_unverified, resign_function_url_event, sign};
#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for `crate::internals`
pub use url::{UrlSource, request_url};
#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for `crate::internals`
pub use verify::{Claims, Clock, KeyUsed, VerifyError, VerifyOptions, body_hash, verify};
