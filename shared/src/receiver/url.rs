//! The URL QStash called, which the token's `sub` must equal (decision record 0021): never chosen by the client.

use lambda_http::RequestExt;

/// How a receiver learns the URL QStash called (the `sub` it compares).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum UrlSource<'a> {
    /// `PUBLIC_BASE_URL`: that base + the raw path (+ `?` + raw query).
    Public(&'a str),
    /// What AWS sets on a function-URL event: `https://` + `requestContext.domainName` + raw path (+ query).
    /// Client-sent `Host` and `X-Forwarded-*` headers are ignored.
    #[default]
    FunctionUrl,
    /// `TRUST_FORWARDED_HEADERS=true`, for a proxy in front that sets them: `X-Forwarded-Proto` (default
    /// `https`) `://` `X-Forwarded-Host`, else `Host`, else the function URL's domain name.
    Forwarded,
}

impl<'a> UrlSource<'a> {
    /// The source for a receiver's settings.
    pub fn from_config(public_base_url: Option<&'a str>, trust_forwarded_headers: bool) -> Self {
        match (public_base_url, trust_forwarded_headers) {
            (Some(base), _) => UrlSource::Public(base),
            (None, true) => UrlSource::Forwarded,
            (None, false) => UrlSource::FunctionUrl,
        }
    }
}

/// The URL QStash called, for the `sub` check (decision record 0021), from `source` ([`UrlSource`]).
///
/// The raw path is the function URL's `rawPath` (`RequestExt::raw_http_path`), falling back to the URI path for
/// requests built without it (local adapters); the query is `rawQueryString` verbatim (lambda_http appends it
/// unchanged to the URI). Without a function-URL context (a request not built from a Lambda event), the URI's
/// authority stands in for the domain name.
pub fn request_url<B>(req: &http::Request<B>, source: UrlSource<'_>) -> String {
    let raw_path = req.raw_http_path();
    let path = if raw_path.is_empty() {
        req.uri().path()
    } else {
        raw_path
    };
    let context_host = || -> Option<&str> {
        match req.request_context_ref() {
            Some(lambda_http::request::RequestContext::ApiGatewayV2(c)) => c.domain_name.as_deref(),
            Some(_) => None,
            None => req.uri().authority().map(|a| a.as_str()),
        }
    };
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(',').next())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    let mut url = match source {
        UrlSource::Public(base) => format!("{}{path}", base.trim_end_matches('/')),
        UrlSource::FunctionUrl => {
            format!("https://{}{path}", context_host().unwrap_or("localhost"))
        }
        UrlSource::Forwarded => {
            let proto = header("x-forwarded-proto").unwrap_or("https");
            let host = header("x-forwarded-host")
                .or_else(|| header("host"))
                .or_else(context_host)
                .unwrap_or("localhost");
            format!("{proto}://{host}{path}")
        }
    };
    if let Some(q) = req.uri().query().filter(|q| !q.is_empty()) {
        url.push('?');
        url.push_str(q);
    }
    url
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_url_prefers_the_public_base() {
        let req = http::Request::builder()
            .uri("https://internal.example/events/invoices?a=1&b=x%20y")
            .header("host", "internal.example")
            .header("x-forwarded-host", "proxy.example")
            .header("x-forwarded-proto", "http")
            .body(())
            .unwrap();
        assert_eq!(
            request_url(&req, UrlSource::Public("https://public.example/")),
            "https://public.example/events/invoices?a=1&b=x%20y"
        );
        assert_eq!(
            request_url(&req, UrlSource::Forwarded),
            "http://proxy.example/events/invoices?a=1&b=x%20y"
        );
        // Without the setting that trusts a proxy, forwarded headers are ignored.
        assert_eq!(
            request_url(&req, UrlSource::FunctionUrl),
            "https://internal.example/events/invoices?a=1&b=x%20y"
        );
        let req = http::Request::builder()
            .uri("/failure")
            .header("host", "cb.example")
            .body(())
            .unwrap();
        assert_eq!(
            request_url(&req, UrlSource::Forwarded),
            "https://cb.example/failure"
        );
        assert_eq!(
            request_url(&req, UrlSource::FunctionUrl),
            "https://localhost/failure"
        );
    }
}
