//! A throwaway Postgres cluster for when none is running. `outbox-dev dev` starts one when `DATABASE_URL` is the
//! default (unset, or the default `.cargo/config.toml` gives every cargo command) and nothing answers at the
//! default address, and stops it when it ends ([`start_unless_reachable`]); `scripts/with-postgres` does the same
//! for the test run, in bash.
//!
//! The cluster: `initdb` (trust auth, user `postgres`, UTF8, C locale) into a fresh directory, `pg_ctl start` on a
//! loopback port the kernel has just handed out — and on another when the server finds it taken by then
//! ([`crate::ports::retry_when_taken`]: Postgres cannot take port 0) — TCP only (no Unix socket), durability off (`fsync`, `synchronous_commit`,
//! `full_page_writes`: it is thrown away). The server binaries come from `pg_config --bindir`, the newest
//! `/usr/lib/postgresql/*/bin` or `PATH`; `scripts/install-postgres` installs them (Debian's `postgresql`). initdb
//! refuses to run as root: as root the commands run as the `postgres` user (`runuser`), in a directory it owns.
//!
//! [`LocalPostgres`] stops the server and removes its directory on drop: at the end of `dev`, on an error, after
//! Ctrl-C, on a panic. A cluster left behind by a killed process is stopped and removed by the next start under
//! the same parent directory (each directory records the pid of the process that started it).

use std::ffi::OsStr;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::ports::NotStarted;

/// The URL everything defaults to (`.cargo/config.toml`, the commands' `--database-url`): a throwaway cluster
/// is started only for it.
pub const DEFAULT_URL: &str = outbox::config::LOCAL_DATABASE_URL;
/// The address probed for a running Postgres, unless [`PROBE_VAR`] names another.
pub const DEFAULT_PROBE: &str = "127.0.0.1:5432";
/// Overrides the probed address (`host:port`): pointed at a port nothing listens on, it makes the throwaway
/// cluster start even though a server runs on the default address (how the fallback is tested).
pub const PROBE_VAR: &str = "OUTBOX_PG_PROBE";
/// What installs the server binaries.
pub const INSTALL: &str = "scripts/install-postgres";

/// The address to probe: [`PROBE_VAR`], else [`DEFAULT_PROBE`].
pub fn probe_address() -> String {
    std::env::var(PROBE_VAR)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_PROBE.to_owned())
}

/// Whether something accepts TCP connections at `addr` (`host:port`) within a second.
pub fn answers(addr: &str) -> bool {
    addr.to_socket_addrs().is_ok_and(|mut addrs| {
        addrs.any(|a| TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok())
    })
}

/// Whether a throwaway cluster is needed: `database_url` is [`DEFAULT_URL`] (nobody chose a server) and nothing
/// answers at `probe`. Any other URL is used as it is, reachable or not.
pub fn needed(database_url: &str, probe: &str) -> bool {
    database_url == DEFAULT_URL && !answers(probe)
}

/// The directory with `initdb` and `pg_ctl`: `pg_config --bindir`, else the newest `/usr/lib/postgresql/*/bin`
/// (Debian keeps the server binaries there, off `PATH`), else the directory of `initdb` on `PATH`.
pub fn server_binaries() -> Option<PathBuf> {
    let has_both = |d: &Path| d.join("initdb").is_file() && d.join("pg_ctl").is_file();
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(d) = from_pg_config.filter(|d| has_both(d)) {
        return Some(d);
    }
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            Some((version, e.path().join("bin")))
        })
        .filter(|(_, d)| has_both(d))
        .collect();
    debian.sort();
    if let Some((_, d)) = debian.pop() {
        return Some(d);
    }
    std::env::split_paths(&std::env::var_os("PATH")?).find(|d| has_both(d))
}

/// The user the server commands run as when this process is root.
struct RunAs {
    name: String,
    uid: u32,
    gid: u32,
}

fn id_of(flag: &str, user: &str) -> Option<u32> {
    let out = Command::new("id")
        .args([flag, user])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

impl RunAs {
    fn postgres() -> anyhow::Result<RunAs> {
        let name = "postgres";
        match (id_of("-u", name), id_of("-g", name)) {
            (Some(uid), Some(gid)) => Ok(RunAs {
                name: name.to_owned(),
                uid,
                gid,
            }),
            _ => bail!(
                "running as root, and initdb refuses root: there is no `postgres` user to run it as \
                 ({INSTALL} creates it), or start a Postgres yourself and set DATABASE_URL"
            ),
        }
    }

    /// Whether this user can write in `dir` (a private home directory above it would stop the server).
    fn can_write(&self, dir: &Path) -> bool {
        Command::new("runuser")
            .args(["-u", &self.name, "--", "test", "-w"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success())
    }
}

/// A running throwaway cluster: stopped, and its directory removed, on drop.
pub struct LocalPostgres {
    dir: PathBuf,
    port: u16,
    bin: PathBuf,
    run_as: Option<RunAs>,
}

impl LocalPostgres {
    /// Creates and starts a cluster in a new directory under `parent` (as root, under the temp directory when the
    /// `postgres` user cannot write below `parent`). Fails naming [`INSTALL`] when the server binaries are missing.
    pub fn start(parent: &Path) -> anyhow::Result<LocalPostgres> {
        let Some(bin) = server_binaries() else {
            bail!(
                "the Postgres server binaries (initdb, pg_ctl) are not installed: {INSTALL} installs them \
                 (Debian's postgresql package), or start a Postgres yourself and set DATABASE_URL"
            );
        };
        let run_as = if crate::pgbouncer::running_as_root() {
            Some(RunAs::postgres()?)
        } else {
            None
        };
        sweep(parent, &bin);
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        );
        let mut pg = LocalPostgres {
            dir: parent.join(&name),
            port: 0,
            bin,
            run_as,
        };
        pg.make_dir()?;
        if let Some(user) = &pg.run_as
            && !user.can_write(&pg.dir)
        {
            let _ = std::fs::remove_dir_all(&pg.dir);
            let fallback = std::env::temp_dir().join("outbox-pg-local");
            sweep(&fallback, &pg.bin);
            pg.dir = fallback.join(&name);
            pg.make_dir()?;
        }
        let data = pg.dir.join("data");
        pg.run(
            "initdb",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "-A".as_ref(),
                "trust".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
                "--locale=C".as_ref(),
                "--no-sync".as_ref(),
            ],
        )?;
        let conf = data.join("postgresql.conf");
        let mut settings = std::fs::read_to_string(&conf)
            .with_context(|| format!("reading {}", conf.display()))?;
        settings.push_str(
            "\n# outbox throwaway cluster (outbox_testkit::pg_local); the port is pg_ctl's -o -p\n\
             listen_addresses = '127.0.0.1'\nunix_socket_directories = ''\nmax_connections = 200\n\
             fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n",
        );
        std::fs::write(&conf, settings).with_context(|| format!("writing {}", conf.display()))?;
        pg.port = crate::ports::retry_when_taken("the throwaway Postgres", |port| {
            pg.start_on(port).map(|()| port)
        })?;
        Ok(pg)
    }

    /// `pg_ctl start` on `port`, waiting until the server accepts connections (its own readiness, not a
    /// connection someone else's server could answer). [`NotStarted::Taken`] when the server found the port
    /// taken.
    fn start_on(&self, port: u16) -> Result<(), NotStarted> {
        let log = self.dir.join("server.log");
        let _ = std::fs::remove_file(&log);
        let started = self.run(
            "pg_ctl",
            &[
                "-D".as_ref(),
                self.dir.join("data").as_os_str(),
                "-l".as_ref(),
                log.as_os_str(),
                "-o".as_ref(),
                format!("-p {port}").as_ref(),
                "-w".as_ref(),
                "-t".as_ref(),
                "60".as_ref(),
                "start".as_ref(),
            ],
        );
        match started {
            Ok(()) => Ok(()),
            Err(_) if self.log().contains("Address already in use") => Err(NotStarted::Taken),
            Err(e) => Err(NotStarted::Failed(
                e.context(format!("server log:\n{}", self.log())),
            )),
        }
    }

    /// Its URL: user `postgres`, database `postgres`, trust auth.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its directory (`data/` is the cluster, `server.log` the server's log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Crashes the server the way a power cut would look to Postgres: `pg_ctl stop -m immediate` (no shutdown
    /// checkpoint; whatever was committed without a WAL flush, `synchronous_commit = off`, is lost). [`Self::start_again`]
    /// brings it back through crash recovery. For the schedule explorer (`outbox-dev soak --schedule random`).
    pub fn crash(&self) -> anyhow::Result<()> {
        let data = self.dir.join("data");
        self.run(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-m".as_ref(),
                "immediate".as_ref(),
                "-w".as_ref(),
                "stop".as_ref(),
            ],
        )
    }

    /// Starts the server (again, after [`Self::crash`]: on the same port; crash recovery replays the WAL).
    pub fn start_again(&self) -> anyhow::Result<()> {
        self.start_on(self.port).map_err(|e| match e {
            NotStarted::Taken => anyhow::anyhow!(
                "the throwaway Postgres could not start again: port {} was taken meanwhile",
                self.port
            ),
            NotStarted::Failed(e) => e,
        })
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    fn make_dir(&self) -> anyhow::Result<()> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        std::fs::write(self.dir.join(OWNER), std::process::id().to_string())?;
        if let Some(user) = &self.run_as {
            std::os::unix::fs::chown(&self.dir, Some(user.uid), Some(user.gid))
                .with_context(|| format!("giving {} to {}", self.dir.display(), user.name))?;
        }
        Ok(())
    }

    /// Runs `tool` from the server binaries, as the `postgres` user when root.
    fn run(&self, tool: &str, args: &[&OsStr]) -> anyhow::Result<()> {
        let out = command(&self.bin, tool, self.run_as.as_ref())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {tool} from {}", self.bin.display()))?;
        if !out.status.success() {
            bail!(
                "{tool} failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for LocalPostgres {
    fn drop(&mut self) {
        stop(&self.dir, &self.bin, self.run_as.as_ref());
    }
}

/// The file in a cluster's directory with the pid of the process that started it.
const OWNER: &str = "owner.pid";

fn command(bin: &Path, tool: &str, run_as: Option<&RunAs>) -> Command {
    match run_as {
        Some(user) => {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", &user.name, "--"]).arg(bin.join(tool));
            cmd
        }
        None => Command::new(bin.join(tool)),
    }
}

/// Stops the server in `dir` if it runs (immediate mode: nothing in it is kept) and removes `dir`.
fn stop(dir: &Path, bin: &Path, run_as: Option<&RunAs>) {
    let data = dir.join("data");
    if data.join("postmaster.pid").exists() {
        let _ = command(bin, "pg_ctl", run_as)
            .arg("-D")
            .arg(&data)
            .args(["-m", "immediate", "-w", "stop"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Stops and removes the clusters under `parent` whose starting process is gone (killed before it could clean
/// up). Only where `/proc` tells which processes live.
fn sweep(parent: &Path, bin: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let root = crate::pgbouncer::running_as_root();
    for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let dir = entry.path();
        let Ok(owner) = std::fs::read_to_string(dir.join(OWNER)) else {
            continue;
        };
        if Path::new("/proc").join(owner.trim()).exists() {
            continue;
        }
        let run_as = if root { RunAs::postgres().ok() } else { None };
        stop(&dir, bin, run_as.as_ref());
    }
}

/// What `outbox-dev dev` does before it connects: `None` when `database_url` is to be used as it is ([`needed`]
/// is false with [`probe_address`]); otherwise a throwaway cluster under `parent`, announced on stderr. The
/// caller connects to [`LocalPostgres::url`] and keeps the value alive as long as it needs the server.
pub fn start_unless_reachable(
    database_url: &str,
    parent: &Path,
) -> anyhow::Result<Option<LocalPostgres>> {
    let probe = probe_address();
    if !needed(database_url, &probe) {
        return Ok(None);
    }
    let pg = LocalPostgres::start(parent)
        .with_context(|| format!("no Postgres at {probe}, and none could be started"))?;
    eprintln!(
        "no Postgres at {probe}; started a throwaway cluster at {} (in {}; stopped at exit)",
        pg.url(),
        pg.dir().display()
    );
    Ok(Some(pg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_default_url_with_nothing_at_the_probe_needs_a_cluster() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let live = listener.local_addr().unwrap().to_string();
        let nobody = crate::ports::ReservedPort::new().unwrap();
        let dead = nobody.addr().to_string();
        assert!(answers(&live) && !answers(&dead));
        assert!(needed(DEFAULT_URL, &dead));
        assert!(!needed(DEFAULT_URL, &live));
        assert!(!needed("postgres://postgres@127.0.0.1:5432/app", &dead));
        assert!(!needed("postgres://app@db.example:5432/postgres", &dead));
    }

    #[test]
    fn a_cluster_told_a_taken_port_reports_it_taken_and_starts_on_another() {
        if server_binaries().is_none() {
            crate::skip_or_fail_under_ci(
                "initdb",
                INSTALL,
                "the throwaway Postgres cluster's port retry was NOT tested",
            );
            return;
        }
        let parent =
            std::env::temp_dir().join(format!("outbox-pg-local-taken-{}", std::process::id()));
        let pg = LocalPostgres::start(&parent).unwrap();
        let data = pg.dir().join("data");
        pg.run(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-m".as_ref(),
                "fast".as_ref(),
                "-w".as_ref(),
                "stop".as_ref(),
            ],
        )
        .unwrap();
        // Someone else's server on the port the cluster is told to use.
        let stranger = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = stranger.local_addr().unwrap().port();
        assert!(
            matches!(pg.start_on(taken), Err(NotStarted::Taken)),
            "log:\n{}",
            pg.log()
        );
        let port = crate::ports::retry_when_taken("the throwaway Postgres", |port| {
            pg.start_on(port).map(|()| port)
        })
        .unwrap();
        assert_ne!(port, taken);
        assert!(answers(&format!("127.0.0.1:{port}")));
        drop(pg);
        let _ = std::fs::remove_dir_all(&parent);
    }

    #[tokio::test]
    async fn a_throwaway_cluster_starts_on_a_port_of_its_own_and_is_gone_after_drop() {
        if server_binaries().is_none() {
            crate::skip_or_fail_under_ci(
                "initdb",
                INSTALL,
                "the throwaway Postgres cluster was NOT tested",
            );
            return;
        }
        let parent =
            std::env::temp_dir().join(format!("outbox-pg-local-test-{}", std::process::id()));
        let pg = LocalPostgres::start(&parent).unwrap();
        let (dir, addr) = (pg.dir().to_path_buf(), format!("127.0.0.1:{}", pg.port()));
        assert!(dir.join("data/PG_VERSION").is_file(), "{}", dir.display());
        let pool = sqlx::PgPool::connect(&pg.url()).await.unwrap();
        // A real server, with the settings of a throwaway one, where the tests can create their databases.
        let fsync: String = sqlx::query_scalar("SHOW fsync")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(fsync, "off");
        sqlx::query("CREATE DATABASE pg_local_probe")
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;

        drop(pg);
        assert!(!answers(&addr), "the server still answers at {addr}");
        assert!(!dir.exists(), "{} is left behind", dir.display());
        let _ = std::fs::remove_dir_all(&parent);
    }

    #[tokio::test]
    async fn a_crashed_cluster_starts_again_on_its_port_with_what_was_committed() {
        if server_binaries().is_none() {
            crate::skip_or_fail_under_ci(
                "initdb",
                INSTALL,
                "the throwaway cluster's crash and restart were NOT tested",
            );
            return;
        }
        let parent =
            std::env::temp_dir().join(format!("outbox-pg-crash-test-{}", std::process::id()));
        let pg = LocalPostgres::start(&parent).unwrap();
        let addr = format!("127.0.0.1:{}", pg.port());
        let pool = sqlx::PgPool::connect(&pg.url()).await.unwrap();
        sqlx::query("CREATE TABLE survived (n int)")
            .execute(&pool)
            .await
            .unwrap();
        // Durable: the cluster's default is `synchronous_commit = off`.
        sqlx::raw_sql("SET synchronous_commit = on; INSERT INTO survived VALUES (1)")
            .execute(&pool)
            .await
            .unwrap();
        pg.crash().unwrap();
        assert!(
            !answers(&addr),
            "the server still answers at {addr} after the crash"
        );
        assert!(sqlx::query("SELECT 1").execute(&pool).await.is_err());
        pg.start_again().unwrap();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM survived")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, 1);
        assert!(
            pg.log().contains("database system was interrupted"),
            "{}",
            pg.log()
        );
        pool.close().await;
        drop(pg);
        let _ = std::fs::remove_dir_all(&parent);
    }
}
