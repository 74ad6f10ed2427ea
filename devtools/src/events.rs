//! `outbox-dev events resign`: re-signs the function-URL fixtures in `events/` with QStash's documented dev key
//! (`sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r`), because QStash tokens expire five minutes after signing.
//!
//! ```text
//! outbox-dev events resign                                              # tokens valid for 300 s from now
//! outbox-dev events resign --ttl-secs 3600
//! outbox-dev events resign --public-base-url https://example.com       # `sub` on another base URL
//! ```
//!
//! Every `*.json` with an `upstash-signature` header is re-signed in place (the rest of the file byte for byte,
//! by `outbox::internals::receiver::resign_function_url_event`); other files are left alone. The tests do not need this
//! (they verify the committed tokens at the time they were issued, and re-sign in memory); it is for
//! `cargo lambda invoke --data-file events/…` against a function running with the dev keys.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, Subcommand};
use outbox::internals::receiver::{DEV_SIGNING_KEYS, resign_function_url_event};

/// `outbox-dev events …`: the sample function-URL events in `events/`.
#[derive(Subcommand, Debug)]
pub enum EventsCommand {
    /// Re-sign the sample events with the dev signing key, valid from now (QStash tokens live five minutes).
    Resign(ResignArgs),
}

/// Arguments of `outbox-dev events resign`.
#[derive(Args, Debug, Clone)]
pub struct ResignArgs {
    /// How long the new tokens are valid, seconds.
    #[arg(long, default_value_t = 300)]
    pub ttl_secs: i64,
    /// The base URL the function sees as `PUBLIC_BASE_URL` (the token's `sub` is built on it); without it, the
    /// URL is rebuilt from each event's `requestContext.domainName`, as the function does with no
    /// `PUBLIC_BASE_URL`.
    #[arg(long)]
    pub public_base_url: Option<String>,
    /// The directory of the events [default: the repository's `events/`].
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// What happened to one file.
#[derive(Debug)]
pub enum Resigned {
    /// Re-signed in place.
    Done(PathBuf),
    /// Left alone (no signature header, not a function-URL event): why.
    Skipped(PathBuf, String),
}

/// The repository's `events/` directory.
pub fn default_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../events")
}

/// Re-signs every signed `*.json` of `dir` (in name order) at `now` for `ttl_secs`.
pub fn resign_dir(
    dir: &Path,
    public_base_url: Option<&str>,
    now: i64,
    ttl_secs: i64,
) -> anyhow::Result<Vec<Resigned>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let mut out = Vec::with_capacity(files.len());
    for path in files {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        match resign_function_url_event(&text, DEV_SIGNING_KEYS.0, public_base_url, now, ttl_secs) {
            Ok(new) => {
                std::fs::write(&path, new)
                    .with_context(|| format!("writing {}", path.display()))?;
                out.push(Resigned::Done(path));
            }
            Err(reason) => out.push(Resigned::Skipped(path, reason)),
        }
    }
    Ok(out)
}

/// Runs an `events` command.
pub fn run(cmd: EventsCommand) -> anyhow::Result<()> {
    match cmd {
        EventsCommand::Resign(args) => {
            let now = i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs())?;
            let dir = args.dir.unwrap_or_else(default_dir);
            for r in resign_dir(&dir, args.public_base_url.as_deref(), now, args.ttl_secs)? {
                match r {
                    Resigned::Done(p) => println!(
                        "re-signed {} (valid until unix {})",
                        p.display(),
                        now + args.ttl_secs
                    ),
                    Resigned::Skipped(p, why) => println!("skipped   {} ({why})", p.display()),
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox::internals::receiver::decode_unverified;

    /// The signature header's value in an event file.
    fn token_of(text: &str) -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(text).ok()?;
        v["headers"]["upstash-signature"]
            .as_str()
            .map(str::to_owned)
    }

    #[test]
    fn resign_renews_every_signed_event_and_leaves_the_rest_byte_for_byte() {
        let dir = std::env::temp_dir().join(format!("outbox-events-resign-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut before = Vec::new();
        for e in std::fs::read_dir(default_dir()).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "json") {
                let text = std::fs::read_to_string(&p).unwrap();
                std::fs::write(dir.join(p.file_name().unwrap()), &text).unwrap();
                before.push((p.file_name().unwrap().to_owned(), text));
            }
        }
        let now = 1_900_000_000;
        let results = resign_dir(&dir, None, now, 3600).unwrap();
        assert_eq!(results.len(), before.len());
        let mut resigned = 0;
        for (name, old) in before {
            let new = std::fs::read_to_string(dir.join(&name)).unwrap();
            match token_of(&old) {
                Some(old_token) => {
                    resigned += 1;
                    let token = token_of(&new).unwrap();
                    assert_ne!(token, old_token, "{name:?} kept its old token");
                    let claims = decode_unverified(&token).unwrap();
                    assert_eq!(claims["iat"], now, "{name:?}");
                    assert_eq!(claims["exp"], now + 3600, "{name:?}");
                    // Only the token changed.
                    assert_eq!(new.replace(&token, &old_token), old, "{name:?}");
                }
                None => assert_eq!(new, old, "{name:?} has no signature and must not change"),
            }
        }
        assert!(resigned >= 4, "the signed fixtures were not found");
        assert!(
            results
                .iter()
                .filter(|r| matches!(r, Resigned::Done(_)))
                .count()
                == resigned
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
