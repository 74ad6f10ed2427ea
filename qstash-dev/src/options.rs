//! Publish configuration from `Upstash-*` headers (or lower-cased query parameters).

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method};

use crate::duration::{parse_compound, parse_period};
use crate::error::ApiError;
use crate::expr::RetryDelayExpr;

/// Settings of a callback or failure-callback message.
#[derive(Clone, Debug)]
pub(crate) struct CallbackSpec {
    pub url: String,
    pub method: Method,
    pub timeout: Option<Duration>,
    pub retries: Option<u32>,
    pub retry_delay: Option<Arc<RetryDelayExpr>>,
    pub delay: Option<Duration>,
    pub forward: Vec<(HeaderName, HeaderValue)>,
}

/// Flow-control settings carried by one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FlowSpec {
    pub key: String,
    pub parallelism: Option<u32>,
    pub rate: Option<u32>,
    pub period: Duration,
}

#[derive(Default, Debug)]
struct CallbackRaw {
    url: Option<String>,
    method: Option<String>,
    timeout: Option<String>,
    retries: Option<String>,
    retry_delay: Option<String>,
    delay: Option<String>,
    forward: Vec<(HeaderName, HeaderValue)>,
}

/// Everything a publish request configures, validated.
#[derive(Debug, Default)]
pub(crate) struct PublishOptions {
    pub method: Option<Method>,
    pub delay: Option<Duration>,
    pub not_before: Option<i64>,
    pub retries: Option<u32>,
    pub retry_delay: Option<Arc<RetryDelayExpr>>,
    pub timeout: Option<Duration>,
    pub callback: Option<CallbackSpec>,
    pub failure_callback: Option<CallbackSpec>,
    pub content_type: Option<HeaderValue>,
    pub forward: Vec<(HeaderName, HeaderValue)>,
    pub dedup_id: Option<String>,
    pub content_based_dedup: bool,
    pub flow: Option<FlowSpec>,
    pub labels: Vec<String>,
    pub redact: Option<String>,
}

/// Collects raw header values before validation (later values win, so query parameters can override).
#[derive(Default, Debug)]
pub(crate) struct OptionsBuilder {
    method: Option<String>,
    delay: Option<String>,
    not_before: Option<String>,
    retries: Option<String>,
    retry_delay: Option<String>,
    timeout: Option<String>,
    callback: CallbackRaw,
    failure_callback: CallbackRaw,
    content_type: Option<HeaderValue>,
    forward: Vec<(HeaderName, HeaderValue)>,
    dedup_id: Option<String>,
    content_based_dedup: Option<String>,
    flow_key: Option<String>,
    flow_value: Option<String>,
    label: Option<String>,
    redact: Option<String>,
    header_forward: Option<String>,
    /// Non-`Upstash-*` headers, kept for `Upstash-Header-Forward: true`.
    others: Vec<(HeaderName, HeaderValue)>,
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    if s.len() >= prefix.len()
        && s.as_bytes()[..prefix.len()].eq_ignore_ascii_case(prefix.as_bytes())
    {
        Some(&s[prefix.len()..])
    } else {
        None
    }
}

fn text(name: &str, value: &[u8]) -> Result<String, ApiError> {
    std::str::from_utf8(value)
        .map(|s| s.trim().to_owned())
        .map_err(|_| ApiError::bad_request(format!("header {name} is not valid UTF-8")))
}

fn forward_pair(name: &str, value: &[u8]) -> Result<(HeaderName, HeaderValue), ApiError> {
    let n = HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| ApiError::bad_request(format!("invalid forwarded header name {name:?}")))?;
    let v = HeaderValue::from_bytes(value).map_err(|_| {
        ApiError::bad_request(format!("invalid value for forwarded header {name:?}"))
    })?;
    Ok((n, v))
}

/// Headers never forwarded by `Upstash-Header-Forward: true`.
fn is_unforwardable(name: &str) -> bool {
    const DROP: &[&str] = &[
        "authorization",
        "host",
        "content-length",
        "content-type",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "expect",
        "accept-encoding",
    ];
    DROP.iter().any(|d| d.eq_ignore_ascii_case(name))
}

impl OptionsBuilder {
    /// Feeds one header (any case) or query parameter.
    pub fn add(&mut self, name: &str, value: &[u8]) -> Result<(), ApiError> {
        if name.eq_ignore_ascii_case("content-type") {
            let v = HeaderValue::from_bytes(value)
                .map_err(|_| ApiError::bad_request("invalid Content-Type"))?;
            self.content_type = Some(v);
            return Ok(());
        }
        let Some(rest) = strip_prefix_ci(name, "upstash-") else {
            if !is_unforwardable(name)
                && let Ok(pair) = forward_pair(name, value)
            {
                self.others.push(pair);
            }
            return Ok(());
        };
        if let Some(h) = strip_prefix_ci(rest, "forward-") {
            self.forward.push(forward_pair(h, value)?);
            return Ok(());
        }
        if let Some(cb) = strip_prefix_ci(rest, "failure-callback") {
            return Self::add_callback(&mut self.failure_callback, name, cb, value);
        }
        if let Some(cb) = strip_prefix_ci(rest, "callback") {
            return Self::add_callback(&mut self.callback, name, cb, value);
        }
        let is = |n: &str| rest.eq_ignore_ascii_case(n);
        let slot = if is("method") {
            &mut self.method
        } else if is("delay") {
            &mut self.delay
        } else if is("not-before") {
            &mut self.not_before
        } else if is("retries") {
            &mut self.retries
        } else if is("retry-delay") {
            &mut self.retry_delay
        } else if is("timeout") {
            &mut self.timeout
        } else if is("deduplication-id") {
            &mut self.dedup_id
        } else if is("content-based-deduplication") {
            &mut self.content_based_dedup
        } else if is("flow-control-key") {
            &mut self.flow_key
        } else if is("flow-control-value") {
            &mut self.flow_value
        } else if is("label") {
            &mut self.label
        } else if is("redact-fields") {
            &mut self.redact
        } else if is("header-forward") {
            &mut self.header_forward
        } else {
            // Telemetry and anything unknown: ignored, never forwarded.
            return Ok(());
        };
        *slot = Some(text(name, value)?);
        Ok(())
    }

    fn add_callback(
        raw: &mut CallbackRaw,
        full: &str,
        rest: &str,
        value: &[u8],
    ) -> Result<(), ApiError> {
        if rest.is_empty() {
            raw.url = Some(text(full, value)?);
            return Ok(());
        }
        let Some(rest) = rest.strip_prefix('-') else {
            return Ok(());
        };
        if let Some(h) = strip_prefix_ci(rest, "forward-") {
            raw.forward.push(forward_pair(h, value)?);
            return Ok(());
        }
        let lower = rest.to_ascii_lowercase();
        let slot = match lower.as_str() {
            "method" => &mut raw.method,
            "timeout" => &mut raw.timeout,
            "retries" => &mut raw.retries,
            "retry-delay" => &mut raw.retry_delay,
            "delay" => &mut raw.delay,
            // The Python SDK sends `callback_headers={"X": "v"}` as `Upstash-Callback-X: v`.
            _ => {
                raw.forward.push(forward_pair(rest, value)?);
                return Ok(());
            }
        };
        *slot = Some(text(full, value)?);
        Ok(())
    }

    /// Validates everything. `query` config (already fed) has overridden headers.
    pub fn build(self) -> Result<PublishOptions, ApiError> {
        let method = self.method.as_deref().map(parse_method).transpose()?;
        let delay = self
            .delay
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| {
                parse_compound(s)
                    .map_err(|e| ApiError::bad_request(format!("invalid Upstash-Delay: {e}")))
            })
            .transpose()?;
        let not_before = self
            .not_before
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<i64>().map_err(|_| {
                    ApiError::bad_request(format!(
                        "invalid Upstash-Not-Before: {s:?} is not a unix timestamp in seconds"
                    ))
                })
            })
            .transpose()?;
        let retries = self
            .retries
            .as_deref()
            .map(|s| parse_retries("Upstash-Retries", s))
            .transpose()?;
        let retry_delay = self
            .retry_delay
            .as_deref()
            .map(|s| parse_expr("Upstash-Retry-Delay", s))
            .transpose()?;
        let timeout = self
            .timeout
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| {
                parse_compound(s)
                    .map_err(|e| ApiError::bad_request(format!("invalid Upstash-Timeout: {e}")))
            })
            .transpose()?;
        let callback = build_callback("Upstash-Callback", self.callback)?;
        let failure_callback = build_callback("Upstash-Failure-Callback", self.failure_callback)?;
        if let Some(id) = &self.dedup_id
            && id.contains(':')
        {
            return Err(ApiError::bad_request("DeduplicationId cannot contain ':'"));
        }
        let content_based_dedup = match self.content_based_dedup.as_deref() {
            None => false,
            Some(s) => parse_go_bool(s).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "invalid Upstash-Content-Based-Deduplication: {s:?}"
                ))
            })?,
        };
        let flow = match (self.flow_key, self.flow_value) {
            (None, None) => None,
            (Some(k), _) if k.is_empty() => {
                return Err(ApiError::bad_request(
                    "Upstash-Flow-Control-Key must not be empty",
                ));
            }
            (Some(key), Some(value)) => Some(parse_flow_value(key, &value)?),
            (Some(_), None) => {
                return Err(ApiError::bad_request(FLOW_VALUE_ERROR));
            }
            (None, Some(_)) => {
                return Err(ApiError::bad_request(
                    "Upstash-Flow-Control-Key is required when Upstash-Flow-Control-Value is set",
                ));
            }
        };
        let labels = self
            .label
            .map(|l| {
                l.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        let header_forward = match self.header_forward.as_deref() {
            None => false,
            Some(s) => parse_go_bool(s).ok_or_else(|| {
                ApiError::bad_request(format!("invalid Upstash-Header-Forward: {s:?}"))
            })?,
        };
        let mut forward = Vec::new();
        if header_forward {
            forward.extend(self.others);
        }
        forward.extend(self.forward);
        Ok(PublishOptions {
            method,
            delay,
            not_before,
            retries,
            retry_delay,
            timeout,
            callback,
            failure_callback,
            content_type: self.content_type,
            forward,
            dedup_id: self.dedup_id.filter(|s| !s.is_empty()),
            content_based_dedup,
            flow,
            labels,
            redact: self.redact,
        })
    }
}

pub(crate) const FLOW_VALUE_ERROR: &str = "Upstash-Flow-Control-Value should be either rate=X or parallelism=Y, or both as comma-separated values";

fn parse_method(s: &str) -> Result<Method, ApiError> {
    match s.to_ascii_uppercase().as_str() {
        "GET" => Ok(Method::GET),
        "POST" => Ok(Method::POST),
        "PUT" => Ok(Method::PUT),
        "PATCH" => Ok(Method::PATCH),
        "DELETE" => Ok(Method::DELETE),
        "HEAD" => Ok(Method::HEAD),
        "OPTIONS" => Ok(Method::OPTIONS),
        _ => Err(ApiError::bad_request(format!(
            "invalid Upstash-Method {s:?}: use GET, POST, PUT, PATCH or DELETE"
        ))),
    }
}

fn parse_retries(name: &str, s: &str) -> Result<u32, ApiError> {
    s.trim().parse::<u32>().map_err(|_| {
        ApiError::bad_request(format!(
            "invalid {name}: {s:?} is not a non-negative integer"
        ))
    })
}

fn parse_expr(name: &str, s: &str) -> Result<Arc<RetryDelayExpr>, ApiError> {
    RetryDelayExpr::parse(s)
        .map(Arc::new)
        .map_err(|e| ApiError::bad_request(format!("invalid {name} expression {s:?}: {e}")))
}

/// Go's `strconv.ParseBool`.
pub(crate) fn parse_go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

thread_local! {
    /// The last few URLs that passed [`check_url`] on this thread: publishers repeat the same destination and
    /// callback URLs, and parsing a URL was the most expensive step of accepting a message. Validity depends
    /// only on the string, so a hit answers exactly what parsing would.
    static RECENT_VALID_URLS: std::cell::RefCell<(usize, [Option<String>; 4])> =
        const { std::cell::RefCell::new((0, [None, None, None, None])) };
}

/// Validates an absolute http(s) URL; `what` names it in the error (built only when there is one).
pub(crate) fn check_url(what: &dyn Fn() -> String, s: &str) -> Result<(), ApiError> {
    if RECENT_VALID_URLS.with_borrow(|(_, urls)| urls.iter().flatten().any(|u| u == s)) {
        return Ok(());
    }
    let has =
        |p: &str| s.len() >= p.len() && s.as_bytes()[..p.len()].eq_ignore_ascii_case(p.as_bytes());
    if !(has("http://") || has("https://")) {
        return Err(ApiError::bad_request(format!(
            "invalid {} url: endpoint has invalid scheme, add http:// or https://",
            what()
        )));
    }
    match url::Url::parse(s) {
        Ok(u) if u.host().is_some() => {
            RECENT_VALID_URLS.with_borrow_mut(|(next, urls)| {
                urls[*next] = Some(s.to_owned());
                *next = (*next + 1) % urls.len();
            });
            Ok(())
        }
        _ => Err(ApiError::bad_request(format!(
            "invalid {} url: {s:?}",
            what()
        ))),
    }
}

fn build_callback(name: &str, raw: CallbackRaw) -> Result<Option<CallbackSpec>, ApiError> {
    let Some(url) = raw.url.filter(|u| !u.is_empty()) else {
        return Ok(None);
    };
    check_url(&|| name.to_ascii_lowercase().replace("upstash-", ""), &url)?;
    let method = raw
        .method
        .as_deref()
        .map(parse_method)
        .transpose()?
        .unwrap_or(Method::POST);
    let timeout = raw
        .timeout
        .as_deref()
        .map(|s| {
            parse_compound(s)
                .map_err(|e| ApiError::bad_request(format!("invalid {name}-Timeout: {e}")))
        })
        .transpose()?;
    let retries = raw
        .retries
        .as_deref()
        .map(|s| parse_retries(&format!("{name}-Retries"), s))
        .transpose()?;
    let retry_delay = raw
        .retry_delay
        .as_deref()
        .map(|s| parse_expr(&format!("{name}-Retry-Delay"), s))
        .transpose()?;
    let delay = raw
        .delay
        .as_deref()
        .map(|s| {
            parse_compound(s)
                .map_err(|e| ApiError::bad_request(format!("invalid {name}-Delay: {e}")))
        })
        .transpose()?;
    Ok(Some(CallbackSpec {
        url,
        method,
        timeout,
        retries,
        retry_delay,
        delay,
        forward: raw.forward,
    }))
}

/// Parses `parallelism=P, rate=R, period=T` (any order, whitespace trimmed).
pub(crate) fn parse_flow_value(key: String, value: &str) -> Result<FlowSpec, ApiError> {
    let mut spec = FlowSpec {
        key,
        parallelism: None,
        rate: None,
        period: Duration::from_secs(1),
    };
    for part in value.split(',') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| ApiError::bad_request(FLOW_VALUE_ERROR))?;
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        match k.as_str() {
            "parallelism" => {
                let p: u32 = v
                    .parse()
                    .map_err(|_| ApiError::bad_request(FLOW_VALUE_ERROR))?;
                if p == 0 {
                    return Err(ApiError::bad_request("parallelism must be at least 1"));
                }
                spec.parallelism = Some(p);
            }
            "rate" => {
                let r: u32 = v
                    .parse()
                    .map_err(|_| ApiError::bad_request(FLOW_VALUE_ERROR))?;
                if r == 0 {
                    return Err(ApiError::bad_request("rate must be at least 1"));
                }
                spec.rate = Some(r);
            }
            "period" => {
                let p = parse_period(v).map_err(|e| {
                    ApiError::bad_request(format!("invalid flow-control period: {e}"))
                })?;
                if p.is_zero() || p > Duration::from_secs(7 * 86_400) {
                    return Err(ApiError::bad_request(
                        "flow-control period must be between 1s and 1 week",
                    ));
                }
                spec.period = p;
            }
            _ => return Err(ApiError::bad_request(FLOW_VALUE_ERROR)),
        }
    }
    if spec.parallelism.is_none() && spec.rate.is_none() {
        return Err(ApiError::bad_request(FLOW_VALUE_ERROR));
    }
    Ok(spec)
}

/// Splits a publish query string: `qstash_token` is dropped, `upstash-*` keys are config (returned decoded),
/// everything else stays raw and is appended to the destination.
pub(crate) fn split_query(query: &str) -> (Vec<(String, Vec<u8>)>, Vec<&str>) {
    let mut config = Vec::new();
    let mut keep = Vec::new();
    for pair in query.split('&') {
        if pair.is_empty() {
            continue;
        }
        let raw_key = pair.split('=').next().unwrap_or("");
        let key: String = url::form_urlencoded::parse(raw_key.as_bytes())
            .next()
            .map(|(k, _)| k.into_owned())
            .unwrap_or_default();
        if key == "qstash_token" {
            continue;
        }
        if strip_prefix_ci(&key, "upstash-").is_some() {
            let value = url::form_urlencoded::parse(pair.as_bytes())
                .next()
                .map(|(_, v)| v.into_owned().into_bytes())
                .unwrap_or_default();
            config.push((key, value));
        } else {
            keep.push(pair);
        }
    }
    (config, keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(pairs: &[(&str, &str)]) -> Result<PublishOptions, ApiError> {
        let mut b = OptionsBuilder::default();
        for (k, v) in pairs {
            b.add(k, v.as_bytes())?;
        }
        b.build()
    }

    #[test]
    fn headers_case_insensitive_and_forwarding() {
        let o = build(&[
            ("UPSTASH-RETRIES", "2"),
            ("upstash-forward-x-custom", "abc"),
            ("Upstash-Callback", "http://127.0.0.1:1/cb"),
            ("Upstash-Callback-Forward-X-A", "1"),
            ("Upstash-Callback-X-B", "2"),
            ("Upstash-Failure-Callback", "http://127.0.0.1:1/f"),
            ("Upstash-Failure-Callback-Retries", "0"),
            ("upstash-telemetry-sdk", "x"),
            ("x-other", "not forwarded"),
            ("Content-Type", "text/plain"),
        ])
        .unwrap();
        assert_eq!(o.retries, Some(2));
        assert_eq!(o.forward.len(), 1);
        assert_eq!(o.forward[0].0.as_str(), "x-custom");
        let cb = o.callback.unwrap();
        assert_eq!(cb.forward.len(), 2);
        assert_eq!(o.failure_callback.unwrap().retries, Some(0));
        assert_eq!(o.content_type.unwrap(), "text/plain");
    }

    #[test]
    fn header_forward_all() {
        let o = build(&[
            ("Upstash-Header-Forward", "true"),
            ("X-Webhook", "1"),
            ("Authorization", "Bearer t"),
        ])
        .unwrap();
        assert_eq!(o.forward.len(), 1);
        assert_eq!(o.forward[0].0.as_str(), "x-webhook");
    }

    #[test]
    fn flow_control_values() {
        let f = parse_flow_value("k".into(), "parallelism=3, rate=5, period=1m").unwrap();
        assert_eq!(
            (f.parallelism, f.rate, f.period),
            (Some(3), Some(5), Duration::from_secs(60))
        );
        let f = parse_flow_value("k".into(), "rate=10,period=1d").unwrap();
        assert_eq!(
            (f.parallelism, f.rate, f.period),
            (None, Some(10), Duration::from_secs(86400))
        );
        let e = parse_flow_value("k".into(), "period=1m").unwrap_err();
        assert_eq!(e.message, FLOW_VALUE_ERROR);
        assert!(parse_flow_value("k".into(), "burst=1").is_err());
    }

    #[test]
    fn validation_errors() {
        assert_eq!(
            build(&[("Upstash-Deduplication-Id", "a:b")])
                .unwrap_err()
                .message,
            "DeduplicationId cannot contain ':'"
        );
        assert!(build(&[("Upstash-Retry-Delay", "pow(2")]).is_err());
        assert!(build(&[("Upstash-Delay", "10x")]).is_err());
        assert!(build(&[("Upstash-Method", "BREW")]).is_err());
        assert!(build(&[("Upstash-Content-Based-Deduplication", "yes")]).is_err());
        assert!(
            build(&[("Upstash-Content-Based-Deduplication", "True")])
                .unwrap()
                .content_based_dedup
        );
        assert!(build(&[("Upstash-Callback", "ftp://x")]).is_err());
    }

    #[test]
    fn url_checks_remembered_only_when_valid() {
        let dest = || "destination".to_owned();
        for _ in 0..2 {
            // the second round answers from the per-thread memory of valid URLs
            check_url(&dest, "https://example.com/a").unwrap();
            check_url(&dest, "http://127.0.0.1:9/b?x=1").unwrap();
        }
        // a near miss of a remembered URL is still parsed and refused
        let e = check_url(&dest, "https://").unwrap_err();
        assert_eq!(e.message, "invalid destination url: \"https://\"");
        assert!(check_url(&dest, "").is_err());
        for i in 0..10 {
            check_url(&dest, &format!("https://h{i}.example/")).unwrap();
        }
        assert!(check_url(&dest, "ftp://example.com/a").is_err());
        // the failing header is named in the message
        let e = build(&[("Upstash-Failure-Callback", "https:// bad")]).unwrap_err();
        assert!(
            e.message.starts_with("invalid failure-callback url"),
            "{}",
            e.message
        );
    }

    #[test]
    fn query_split() {
        let (cfg, keep) =
            split_query("a=1&qstash_token=t&upstash-retries=3&upstash-delay=10s&b=x%20y");
        assert_eq!(keep, vec!["a=1", "b=x%20y"]);
        assert_eq!(cfg.len(), 2);
        assert_eq!(cfg[0], ("upstash-retries".to_string(), b"3".to_vec()));
    }
}
