//! Duration formats used by QStash: compound `1d10h30m` (delay, timeout, flow-control period),
//! Go durations (`6m5s`, `1.5h`, `300ms`) and `Retry-After`-style values.

use std::time::{Duration, SystemTime};

/// Parses a QStash compound duration: one or more `<integer><unit>` groups with units `d`, `h`, `m`, `s`
/// (and `ms`), e.g. `1d10h30m`, `50s`. A bare integer is taken as seconds (what a few clients send).
pub fn parse_compound(input: &str) -> Result<Duration, String> {
    let s = input.trim();
    if s.is_empty() {
        return Err("empty duration".into());
    }
    if s.bytes().all(|b| b.is_ascii_digit()) {
        let secs: u64 = s
            .parse()
            .map_err(|_| format!("invalid duration {input:?}"))?;
        return Ok(Duration::from_secs(secs));
    }
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut total = Duration::ZERO;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if start == i {
            return Err(format!("invalid duration {input:?}: expected a number"));
        }
        let n: u64 = s[start..i]
            .parse()
            .map_err(|_| format!("invalid duration {input:?}: number too large"))?;
        let ustart = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let unit_ms: u64 = match &s[ustart..i] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "" => return Err(format!("invalid duration {input:?}: missing unit")),
            other => {
                return Err(format!(
                    "invalid duration {input:?}: unknown unit {other:?}"
                ));
            }
        };
        let ms = n
            .checked_mul(unit_ms)
            .ok_or_else(|| format!("invalid duration {input:?}: too large"))?;
        total = total
            .checked_add(Duration::from_millis(ms))
            .ok_or_else(|| format!("invalid duration {input:?}: too large"))?;
    }
    Ok(total)
}

/// Parses a Go `time.ParseDuration` string: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+`, units ns us µs ms s m h,
/// or `0`. Negative durations are rejected (they mean nothing as a wait).
pub fn parse_go_duration(input: &str) -> Option<Duration> {
    let mut s = input.trim();
    if let Some(rest) = s.strip_prefix('+') {
        s = rest;
    }
    if s == "0" {
        return Some(Duration::ZERO);
    }
    if s.is_empty() || s.starts_with('-') {
        return None;
    }
    let mut total_ns: f64 = 0.0;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let num: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit_ns: f64 = match &rest[..unit_len] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total_ns += num * unit_ns;
    }
    if !total_ns.is_finite() || total_ns < 0.0 {
        return None;
    }
    Duration::try_from_secs_f64(total_ns / 1e9).ok()
}

/// Parses a `Retry-After` / `X-RateLimit-Reset*` value: integer (or decimal) seconds, an RFC 1123 HTTP date,
/// or a Go duration. Returns the wait from `now`; a date in the past gives zero.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let v = value.trim();
    if v.is_empty() {
        return None;
    }
    if v.bytes().all(|b| b.is_ascii_digit()) {
        return v.parse::<u64>().ok().map(Duration::from_secs);
    }
    if v.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        let secs: f64 = v.parse().ok()?;
        return Duration::try_from_secs_f64(secs).ok();
    }
    if let Ok(date) = httpdate::parse_http_date(v) {
        return Some(date.duration_since(now).unwrap_or(Duration::ZERO));
    }
    parse_go_duration(v)
}

/// Parses a flow-control `period`: a compound duration (`1m`, `1d`, `1h30m`) or bare seconds.
pub fn parse_period(input: &str) -> Result<Duration, String> {
    parse_compound(input)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compound() {
        assert_eq!(
            parse_compound("1d10h30m").unwrap(),
            Duration::from_secs(86400 + 36000 + 1800)
        );
        assert_eq!(parse_compound("50s").unwrap(), Duration::from_secs(50));
        assert_eq!(parse_compound("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_compound("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_compound("").is_err());
        assert!(parse_compound("10x").is_err());
        assert!(parse_compound("h").is_err());
        assert!(parse_compound("10s5").is_err());
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("6m5s"), Some(Duration::from_secs(365)));
        assert_eq!(parse_go_duration("1.5h"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_go_duration("300ms"), Some(Duration::from_millis(300)));
        assert_eq!(parse_go_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_go_duration("-1s"), None);
        assert_eq!(parse_go_duration("5"), None);
        assert_eq!(parse_go_duration("5d"), None);
    }

    #[test]
    fn retry_after() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now),
            Some(Duration::ZERO)
        );
        let later = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_700);
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", later),
            Some(Duration::from_secs(77))
        );
        assert_eq!(parse_retry_after("2m", now), Some(Duration::from_secs(120)));
        assert_eq!(parse_retry_after("soon", now), None);
    }
}
