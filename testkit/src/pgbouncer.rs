//! A PgBouncer in transaction mode of the test's own, in front of the local Postgres: the pooler that production
//! puts between many Lambda environments and the database (or RDS Proxy, which behaves alike for what matters
//! here: a server connection is a client's only for one transaction, so named prepared statements and session
//! state do not survive between transactions).
//!
//! [`PgBouncer::start`] writes an ini to a scratch directory (trust auth, `pool_mode = transaction`, loopback port
//! 0 — the kernel picks one when PgBouncer binds it, read back from `/proc` ([`crate::ports`]) — every database
//! forwarded to the Postgres given) and runs the Debian package's binary on it
//! (`scripts/test-deps` installs it). It returns `None` when no binary is installed: the caller skips, loudly, or
//! fails under CI ([`crate::skip_or_fail_under_ci`]).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::Context;

use crate::ports::wait_listening_blocking;

/// A running PgBouncer; stopped (and its scratch directory removed) on drop.
pub struct PgBouncer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

/// The installed binary, if any (`$PATH`, then the Debian package's `/usr/sbin`).
pub fn binary() -> Option<PathBuf> {
    let from_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("pgbouncer"))
            .find(|p| p.is_file())
    });
    from_path.or_else(|| {
        let p = PathBuf::from("/usr/sbin/pgbouncer");
        p.is_file().then_some(p)
    })
}

pub(crate) fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl PgBouncer {
    /// Starts one in front of `pg_host:pg_port`, or returns `None` when PgBouncer is not installed.
    pub fn start(pg_host: &str, pg_port: u16) -> anyhow::Result<Option<PgBouncer>> {
        let Some(bin) = binary() else {
            return Ok(None);
        };
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "outbox-pgbouncer-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let root = running_as_root();
        if root {
            // PgBouncer refuses to run as root: it drops to `nobody`, who must be able to write its log here.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
        }
        let user = std::env::var("PGUSER").unwrap_or_else(|_| "postgres".to_owned());
        std::fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n"))?;
        let ini = format!(
            "[databases]\n\
             * = host={pg_host} port={pg_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = 0\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             pool_mode = transaction\n\
             max_client_conn = 500\n\
             default_pool_size = 10\n\
             ignore_startup_parameters = extra_float_digits,options\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n",
            dir = dir.display()
        );
        let ini_path = dir.join("pgbouncer.ini");
        std::fs::write(&ini_path, ini)?;
        let mut cmd = Command::new(&bin);
        if root {
            cmd.arg("-u").arg("nobody");
        }
        let child = cmd
            .arg(&ini_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut bouncer = PgBouncer {
            child,
            port: 0,
            dir,
        };
        let pid = bouncer.child.id();
        let child = &mut bouncer.child;
        let listening = wait_listening_blocking("pgbouncer", pid, Duration::from_secs(20), || {
            child.try_wait().ok().flatten().map(|s| s.to_string())
        });
        match listening {
            Ok(port) => bouncer.port = port,
            Err(e) => anyhow::bail!("{e:#}:\n{}", bouncer.log()),
        }
        Ok(Some(bouncer))
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `database_url` (a URL of the Postgres behind it) pointed at this PgBouncer instead: same user and database.
    pub fn url_for(&self, database_url: &str) -> String {
        match url::Url::parse(database_url) {
            Ok(mut u) => {
                let _ = u.set_host(Some("127.0.0.1"));
                let _ = u.set_port(Some(self.port));
                u.query_pairs_mut().clear();
                let mut s = u.to_string();
                if s.ends_with('?') {
                    s.pop();
                }
                s
            }
            Err(_) => format!("postgres://postgres@127.0.0.1:{}/postgres", self.port),
        }
    }

    /// Its log so far (for a failure message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
