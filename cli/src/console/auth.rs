//! Who may use the console and how a request proves it: named tokens, the session cookie, the CSRF token on
//! every form, and the `Host`/`Origin` checks (docs/console.md, "Security model").
//!
//! * **Tokens** are `name:secret` lines in a file (`--token-file`). A console bound to anything but loopback
//!   refuses to start without one. A secret is compared in constant time (SHA-256 of both sides, then
//!   `subtle`), and the name is what the action log records.
//! * **Sessions.** Logging in with a token (or, on a loopback console without tokens, the first visit) sets an
//!   `HttpOnly`, `SameSite=Strict` cookie `<session id>.<expiry>.<name in hex>.<mac>`, where the MAC is an HMAC-SHA256
//!   under a key drawn at start: only this process can issue one, and a restart ends every session.
//! * **CSRF.** Every form carries `csrf` = HMAC(key, session id); a POST whose field does not match its own
//!   session's cookie is refused. A page on another site can neither read the cookie nor compute the MAC, and
//!   `SameSite=Strict` keeps the cookie off cross-site requests anyway.
//! * **Host and Origin.** A request whose `Host` does not name this console (loopback names with any port, the
//!   bound or local `ip:port`, or an `--allow-host` name) is refused (DNS rebinding), and so is one whose
//!   `Origin` names another site.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use anyhow::{Context, bail};
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The actor of a loopback console without tokens.
pub const LOCAL: &str = "local";

/// The session cookie's name.
pub const COOKIE: &str = "outbox_console";

/// How long a session lasts.
const SESSION_SECS: i64 = 12 * 3600;

/// The shortest secret accepted.
const MIN_SECRET: usize = 16;

/// One named token.
#[derive(Clone)]
pub struct Token {
    /// Who (the action log's actor).
    pub name: String,
    digest: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Token {
    /// `name:secret`; the name is letters, digits, `-`, `_`, `.`, `@` (it goes into a cookie and the action
    /// log); the secret at least 16 characters.
    pub fn parse(line: &str) -> anyhow::Result<Token> {
        let Some((name, secret)) = line.split_once(':') else {
            bail!("a console token is `name:secret` (the name is what the action log records)");
        };
        let name = name.trim();
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b))
        {
            bail!(
                "console token name {:?}: use 1 to 64 letters, digits, '-', '_', '.', '@'",
                crate::util::printable(name)
            );
        }
        if secret.chars().count() < MIN_SECRET {
            bail!("the secret of console token {name:?} is shorter than {MIN_SECRET} characters");
        }
        Ok(Token {
            name: name.to_owned(),
            digest: Sha256::digest(secret.as_bytes()).into(),
        })
    }

    /// Reads a token file: one `name:secret` per line; blank lines and `#` comments are skipped.
    pub fn read_file(path: &Path) -> anyhow::Result<Vec<Token>> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the console token file {}", path.display()))?;
        let mut tokens: Vec<Token> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let t =
                Token::parse(line).with_context(|| format!("{} line {}", path.display(), i + 1))?;
            if tokens.iter().any(|o| o.name == t.name) {
                bail!(
                    "{} line {}: token name {:?} appears twice",
                    path.display(),
                    i + 1,
                    t.name
                );
            }
            tokens.push(t);
        }
        if tokens.is_empty() {
            bail!("the console token file {} holds no token", path.display());
        }
        Ok(tokens)
    }
}

/// The name of the token `presented` (`name:secret`) matches, if any. Every token is compared, each in
/// constant time, so the time taken says nothing about which part was wrong.
pub fn check_token(tokens: &[Token], presented: &str) -> Option<String> {
    let (name, secret) = presented.trim().split_once(':')?;
    let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
    let mut found = None;
    for t in tokens {
        let same = t.digest.ct_eq(&digest) & t.name.as_bytes().ct_eq(name.trim().as_bytes());
        if bool::from(same) {
            found = Some(t.name.clone());
        }
    }
    found
}

/// The process's key for session cookies and CSRF tokens, drawn at start.
pub struct Keys {
    key: [u8; 32],
}

/// A valid session: its id and who it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub id: String,
    pub actor: String,
}

impl Keys {
    /// A fresh random key.
    pub fn random() -> Keys {
        let mut key = [0u8; 32];
        rand::rng().fill_bytes(&mut key);
        Keys { key }
    }

    fn mac(&self, parts: &[&str]) -> String {
        // HMAC accepts keys of any length.
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.key).expect("HMAC takes any key length");
        for p in parts {
            m.update(p.as_bytes());
            m.update(b"\0");
        }
        hex(&m.finalize().into_bytes())
    }

    /// A new session cookie value for `actor`, valid from `now` (unix seconds) for 12 hours.
    pub fn issue(&self, actor: &str, now: i64) -> (Session, String) {
        let mut id = [0u8; 16];
        rand::rng().fill_bytes(&mut id);
        let id = hex(&id);
        let exp = (now + SESSION_SECS).to_string();
        // The name in hex: a token name may hold '.', the cookie's separator.
        let name = hex(actor.as_bytes());
        let mac = self.mac(&["session", &id, &exp, &name]);
        let value = format!("{id}.{exp}.{name}.{mac}");
        (
            Session {
                id,
                actor: actor.to_owned(),
            },
            value,
        )
    }

    /// The session a cookie value stands for, if this process issued it and it has not expired.
    pub fn verify(&self, value: &str, now: i64) -> Option<Session> {
        let mut parts = value.split('.');
        let (id, exp, name, mac) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let want = self.mac(&["session", id, exp, name]);
        if !bool::from(want.as_bytes().ct_eq(mac.as_bytes())) {
            return None;
        }
        if exp.parse::<i64>().ok()? <= now {
            return None;
        }
        Some(Session {
            id: id.to_owned(),
            actor: String::from_utf8(unhex(name)?).ok()?,
        })
    }

    /// The CSRF token of a session (what its forms carry).
    pub fn csrf(&self, session: &Session) -> String {
        self.mac(&["csrf", &session.id])
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The value of cookie `name` in a `Cookie` header.
pub fn cookie<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').find_map(|c| {
        let (k, v) = c.trim().split_once('=')?;
        (k == name).then_some(v)
    })
}

/// Loopback names accepted in `Host` with any port: a browser sends them only for pages it loaded under that
/// very name, never for a rebound domain.
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// Which `Host` values name this console.
#[derive(Debug, Clone)]
pub struct HostCheck {
    /// The address the listener is bound to.
    pub bound: SocketAddr,
    /// Extra names (`--allow-host`), `name` or `name:port`, compared case-insensitively.
    pub allowed: Vec<String>,
}

impl HostCheck {
    /// `authority` (`host[:port]`) names this console, reached on `local`.
    pub fn allows(&self, authority: &str, local: SocketAddr) -> bool {
        let Some((name, port)) = split_authority(authority) else {
            return false;
        };
        if LOOPBACK_NAMES.iter().any(|n| n.eq_ignore_ascii_case(name)) {
            return true;
        }
        if self
            .allowed
            .iter()
            .any(|a| a.eq_ignore_ascii_case(authority) || a.eq_ignore_ascii_case(name))
        {
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
        [self.bound, local]
            .iter()
            .any(|a| a.port() == port && a.ip().to_canonical() == ip.to_canonical())
    }

    /// An `Origin` header value names this console (`http://` or `https://` and an allowed authority).
    pub fn allows_origin(&self, origin: &str, local: SocketAddr) -> bool {
        let Some(authority) = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
        else {
            return false;
        };
        self.allows(authority.trim_end_matches('/'), local)
    }
}

/// `host[:port]` (`[v6]:port` for IPv6); `None` when it is not of that shape.
fn split_authority(authority: &str) -> Option<(&str, Option<u16>)> {
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
    if host.is_empty() || host.contains(['@', '/', ' ']) {
        return None;
    }
    let port = match port {
        None => None,
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse().ok()?),
        Some(_) => return None,
    };
    Some((host, port))
}

/// Whether `addr` is a loopback address (a console there may run without tokens).
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_by_name_and_secret() {
        let tokens = vec![
            Token::parse("alice:0123456789abcdef").unwrap(),
            Token::parse("bob:fedcba9876543210xyz").unwrap(),
        ];
        assert_eq!(
            check_token(&tokens, "alice:0123456789abcdef").as_deref(),
            Some("alice")
        );
        assert_eq!(
            check_token(&tokens, "bob:fedcba9876543210xyz").as_deref(),
            Some("bob")
        );
        assert_eq!(
            check_token(&tokens, "bob:0123456789abcdef"),
            None,
            "another's secret"
        );
        assert_eq!(check_token(&tokens, "alice:0123456789abcdeF"), None);
        assert_eq!(check_token(&tokens, "0123456789abcdef"), None);
        assert!(Token::parse("alice:short").is_err());
        assert!(Token::parse("no secret").is_err());
        assert!(Token::parse("a b:0123456789abcdef").is_err());
        assert!(format!("{:?}", tokens[0]).contains("alice"));
        assert!(!format!("{:?}", tokens[0]).contains("0123"));
    }

    #[test]
    fn sessions_and_csrf_tokens_are_this_process_s() {
        let keys = Keys::random();
        let (session, cookie) = keys.issue("alice", 1000);
        assert_eq!(keys.verify(&cookie, 1001), Some(session.clone()));
        assert_eq!(keys.verify(&cookie, 1000 + SESSION_SECS), None, "expired");
        assert_eq!(
            Keys::random().verify(&cookie, 1001),
            None,
            "another process's key"
        );
        let forged = cookie.replacen(&hex(b"alice"), &hex(b"mallory"), 1);
        assert_eq!(keys.verify(&forged, 1001), None);
        let (dotted, cookie) = keys.issue("alice.smith@ops", 1000);
        assert_eq!(
            keys.verify(&cookie, 1001),
            Some(dotted),
            "a name with the separator in it"
        );
        let (other, _) = keys.issue("alice", 1000);
        assert_ne!(
            keys.csrf(&session),
            keys.csrf(&other),
            "one token per session"
        );
        assert_eq!(keys.csrf(&session), keys.csrf(&session));
    }

    #[test]
    fn hosts_and_origins() {
        let check = HostCheck {
            bound: "127.0.0.1:7000".parse().unwrap(),
            allowed: vec!["console.internal".into()],
        };
        let local: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        for ok in [
            "localhost:7000",
            "127.0.0.1:9",
            "[::1]",
            "console.internal",
            "Console.Internal:443",
        ] {
            assert!(check.allows(ok, local), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:7000",
            "localhost.evil.example",
            "127.0.0.2:7000",
            "a@localhost",
            "",
        ] {
            assert!(!check.allows(bad, local), "{bad}");
        }
        assert!(check.allows_origin("http://localhost:7000", local));
        assert!(!check.allows_origin("http://evil.example", local));
        assert!(!check.allows_origin("null", local));
        let any = HostCheck {
            bound: "0.0.0.0:7000".parse().unwrap(),
            allowed: vec![],
        };
        assert!(any.allows("10.1.2.3:7000", "10.1.2.3:7000".parse().unwrap()));
        assert!(!any.allows("10.1.2.3:7001", "10.1.2.3:7000".parse().unwrap()));
    }
}
