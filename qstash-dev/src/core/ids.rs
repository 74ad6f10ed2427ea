//! Message ids.

use std::sync::Arc;

use rand::Rng;

/// Unique, random-looking message ids: `msg_` + 22 base-62 characters.
pub(super) struct IdGen {
    prefix: String,
    counter: u64,
    salt: u64,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn base62_11_into(mut x: u64, buf: &mut [u8]) {
    const A: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    for slot in buf.iter_mut().rev() {
        *slot = A[(x % 62) as usize];
        x /= 62;
    }
}

fn base62_11(x: u64, out: &mut String) {
    let mut buf = [b'0'; 11];
    base62_11_into(x, &mut buf);
    out.extend(buf.iter().map(|&b| b as char));
}

impl IdGen {
    pub(super) fn new() -> IdGen {
        let mut rng = rand::rng();
        let mut prefix = String::with_capacity(11);
        base62_11(rng.random(), &mut prefix);
        IdGen {
            prefix,
            counter: 0,
            salt: rng.random(),
        }
    }

    pub(super) fn next(&mut self) -> Arc<str> {
        self.counter += 1;
        let mut buf = [0u8; 26];
        buf[..4].copy_from_slice(b"msg_");
        buf[4..15].copy_from_slice(self.prefix.as_bytes());
        // splitmix64 is a bijection, so distinct counters give distinct ids.
        base62_11_into(splitmix64(self.counter ^ self.salt), &mut buf[15..]);
        Arc::from(std::str::from_utf8(&buf).unwrap_or("msg_invalid"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_shaped() {
        let mut g = IdGen::new();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let id = g.next();
            assert!(id.starts_with("msg_"));
            assert_eq!(id.len(), 26);
            assert!(seen.insert(id));
        }
    }
}
