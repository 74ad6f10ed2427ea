//! Which `Host` values the server answers to (protection against DNS rebinding, decision record 0113).
//!
//! A web page on `http://evil.example` can point `evil.example` at 127.0.0.1 and then call the dev server from
//! the browser: the request reaches the loopback port, but its `Host` header still says `evil.example`. So only
//! names an attacker's page cannot send are accepted.

use std::net::{IpAddr, SocketAddr};

/// Loopback names accepted with any port (or none): a browser sends them only for pages loaded from this
/// machine under that very name, never for a rebound domain. Any port, because port forwarding (Docker,
/// SSH) changes the port the client sees.
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// Splits `host[:port]` (`[v6]:port` for IPv6); `None` when it is not of that shape.
fn split(authority: &str) -> Option<(&str, Option<u16>)> {
    let (host, port) = if authority.starts_with('[') {
        let end = authority.find(']')? + 1;
        let (host, rest) = authority.split_at(end);
        match rest {
            "" => (host, None),
            _ => (host, Some(rest.strip_prefix(':')?)),
        }
    } else {
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return None;
    }
    let port = match port {
        None => None,
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse().ok()?),
        Some(_) => return None,
    };
    Some((host, port))
}

/// `host` (a `Host` header value, or the authority of an absolute request target) names this server: one of
/// [`LOOPBACK_NAMES`] (any port), or the IP address and port the server is bound to or that this
/// connection arrived on (`local`; what counts when bound to 0.0.0.0 or ::). Names compare case-insensitively;
/// IPv4-mapped IPv6 addresses equal their IPv4 form.
pub(crate) fn allowed(host: &str, bound: SocketAddr, local: SocketAddr) -> bool {
    let Some((name, port)) = split(host) else {
        return false;
    };
    if LOOPBACK_NAMES.iter().any(|n| n.eq_ignore_ascii_case(name)) {
        return true;
    }
    let literal = name
        .strip_prefix('[')
        .and_then(|n| n.strip_suffix(']'))
        .unwrap_or(name);
    let Ok(ip) = literal.parse::<IpAddr>() else {
        return false;
    };
    let port = port.unwrap_or(80);
    [bound, local]
        .iter()
        .any(|a| a.port() == port && a.ip().to_canonical() == ip.to_canonical())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(host: &str) -> bool {
        allowed(
            host,
            "127.0.0.1:8080".parse().unwrap(),
            "127.0.0.1:8080".parse().unwrap(),
        )
    }

    #[test]
    fn loopback_names_with_any_port() {
        for h in [
            "localhost",
            "localhost:8080",
            "LocalHost:9999",
            "127.0.0.1",
            "127.0.0.1:8080",
            "127.0.0.1:1",
            "[::1]",
            "[::1]:8080",
        ] {
            assert!(ok(h), "{h}");
        }
    }

    #[test]
    fn other_names_and_malformed_values_are_refused() {
        for h in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example:8080",
            "127.0.0.1.nip.io:8080",
            "user@localhost:8080",
            "localhost:",
            "localhost:80a",
            "localhost:99999",
            "[::1",
            "[::1]x",
            "::1",
            "",
            ":8080",
            "127.0.0.2:8080",
        ] {
            assert!(!ok(h), "{h}");
        }
    }

    #[test]
    fn bound_and_local_addresses_need_their_port() {
        let any: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let local: SocketAddr = "192.168.1.5:8080".parse().unwrap();
        let ok = |h| allowed(h, any, local);
        assert!(ok("192.168.1.5:8080"));
        assert!(ok("0.0.0.0:8080"), "the URL the server prints");
        assert!(!ok("192.168.1.5:8081"));
        assert!(!ok("192.168.1.5"), "no port means 80");
        assert!(!ok("192.168.1.6:8080"));
        // Dual-stack socket: an IPv4 client's local address is IPv4-mapped.
        let mapped: SocketAddr = "[::ffff:192.168.1.5]:8080".parse().unwrap();
        assert!(allowed(
            "192.168.1.5:8080",
            "[::]:8080".parse().unwrap(),
            mapped
        ));
        let v6: SocketAddr = "[fd00::5]:8080".parse().unwrap();
        assert!(allowed("[fd00::5]:8080", any, v6,));
        assert!(allowed("[FD00::5]:8080", any, v6,));
    }
}
