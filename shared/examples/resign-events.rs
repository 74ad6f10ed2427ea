//! Re-signs the function-URL fixtures in `events/` with QStash's documented dev key
//! (`sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r`), because QStash tokens expire after five minutes.
//!
//! ```text
//! cargo run -p outbox --example resign-events                 # tokens valid for 300 s from now
//! cargo run -p outbox --example resign-events -- --ttl-secs 3600
//! cargo run -p outbox --example resign-events -- --public-base-url https://example.com  # sub on another base
//! ```
//!
//! Every `events/*.json` with an `upstash-signature` header is re-signed in place; other files are left alone.
//! The tests do not need this (they verify the committed tokens at the time they were issued, and re-sign in
//! memory); it is for `cargo lambda invoke --data-file events/…` against a function running with the dev keys.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use outbox::receiver::{DEV_SIGNING_KEYS, resign_function_url_event};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut ttl: i64 = 300;
    let mut base: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ttl-secs" => ttl = args.next().ok_or("--ttl-secs needs a value")?.parse()?,
            "--public-base-url" => {
                base = Some(args.next().ok_or("--public-base-url needs a value")?)
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?} (use --ttl-secs N, --public-base-url URL)"
                )
                .into());
            }
        }
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as i64;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../events");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    for path in files {
        let text = std::fs::read_to_string(&path)?;
        match resign_function_url_event(&text, DEV_SIGNING_KEYS.0, base.as_deref(), now, ttl) {
            Ok(new) => {
                std::fs::write(&path, new)?;
                println!(
                    "re-signed {} (valid until unix {})",
                    path.display(),
                    now + ttl
                );
            }
            Err(e) => println!("skipped   {} ({e})", path.display()),
        }
    }
    Ok(())
}
