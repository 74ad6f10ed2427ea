//! [`verify_request`]: the signature check of one request, from its header, body and URL.

use super::keys::KeyRing;
use super::token::SIGNATURE_HEADER;
use super::url::{UrlSource, request_url};
use super::verify::{Claims, VerifyError, VerifyOptions};

/// Reads the `Upstash-Signature` header of `req` and verifies it against the body and [`request_url`].
pub async fn verify_request(
    keys: &KeyRing,
    req: &lambda_http::Request,
    source: UrlSource<'_>,
    opts: VerifyOptions,
) -> Result<Claims, VerifyError> {
    let token = match req.headers().get(SIGNATURE_HEADER) {
        None => return Err(VerifyError::MissingHeader),
        Some(v) => v.to_str().map_err(|_| {
            VerifyError::Malformed("Upstash-Signature header is not visible ASCII".into())
        })?,
    };
    let url = request_url(req, source);
    keys.verify(token, req.body().as_ref(), &url, opts).await
}
