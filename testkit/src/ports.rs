//! Ports bound once. "Find a free port, then start a server on it" races: tests run side by side, and between
//! the look and the bind another test can take the port — the server then fails, or worse, the test talks to
//! someone else's. So a port here is always the one a server (or a socket held for it) has bound:
//!
//! | server | how it gets its port | why it cannot collide |
//! |---|---|---|
//! | in this process | bind port 0, hand the listener over | the port is ours from the bind |
//! | a child that binds port 0 (moto_server, chromedriver, PgBouncer, qstash-dev) | port 0, then [`wait_listening`] reads the port it listens on from `/proc` | the child binds once; the port is read from the kernel's own table of that child's sockets |
//! | a child of ours that must keep one port across restarts (the soak's receivers) | [`ReservedPort`] held by the parent; the child binds it with `SO_REUSEPORT` | the held socket keeps every other process off the port, also while the child is down |
//! | a child that cannot take port 0 (Postgres, `cargo lambda watch`: it tells the functions its address before it binds) | [`retry_when_taken`] (and its async twin): started on a port the kernel just handed out, and again on another when it reports that port taken; used only once it is seen listening | a collision costs a restart, never a failed test or a stranger's server |
//! | a preferred port with a fallback (`outbox-dev dev`'s 7070 and 8080) | [`on_port_or_any`]: that port, then 0 when the bind fails as taken | one bind per attempt, no look before it |
//! | a port nothing may listen on (a probe that must find nobody) | [`ReservedPort`]: bound, never listening | connections are refused, and nobody else can bind it meanwhile |

use std::collections::{BTreeSet, HashSet};
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// A loopback port held by a socket that is bound and not listening: connections to it are refused, and no other
/// process can bind it while this value lives — except one that sets `SO_REUSEPORT` as this socket does, under the
/// same user ([`ReservedPort::listen`]: how the soak's receivers take over the port they were given, restart after
/// restart).
pub struct ReservedPort {
    socket: tokio::net::TcpSocket,
    port: u16,
}

impl ReservedPort {
    /// Binds 127.0.0.1:0 (`SO_REUSEPORT` set) and keeps it.
    pub fn new() -> std::io::Result<ReservedPort> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseport(true)?;
        socket.bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
        let port = socket.local_addr()?.port();
        Ok(ReservedPort { socket, port })
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// A listener on a port some [`ReservedPort`] holds (in this process or the parent's): bound with
    /// `SO_REUSEPORT` beside the held socket. Connections go to the listener; the held socket never takes any.
    pub fn listen(port: u16) -> std::io::Result<tokio::net::TcpListener> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseport(true)?;
        socket.bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))?;
        socket.listen(1024)
    }
}

impl std::fmt::Debug for ReservedPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReservedPort")
            .field("port", &self.port)
            .field("socket", &self.socket.local_addr().ok())
            .finish()
    }
}

/// The TCP ports process `pid` listens on: its socket inodes (`/proc/<pid>/fd`) looked up among the listening
/// sockets of its network namespace (`/proc/<pid>/net/tcp`, `tcp6`). Empty when it listens on none (or is gone).
pub fn listening_ports(pid: u32) -> BTreeSet<u16> {
    let mut inodes = HashSet::new();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            if let Ok(link) = std::fs::read_link(fd.path())
                && let Some(inode) = link
                    .to_str()
                    .and_then(|l| l.strip_prefix("socket:["))
                    .and_then(|l| l.strip_suffix(']'))
            {
                inodes.insert(inode.to_owned());
            }
        }
    }
    let mut ports = BTreeSet::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode …
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            const LISTEN: &str = "0A";
            if f.len() > 9 && f[3] == LISTEN && inodes.contains(f[9]) {
                let port = f[1].rsplit(':').next().map(|p| u16::from_str_radix(p, 16));
                if let Some(Ok(port)) = port {
                    ports.insert(port);
                }
            }
        }
    }
    ports
}

/// Waits until process `pid` listens on a TCP port and returns it (the lowest, if it listens on several).
/// `exited` is asked between looks: `Some(why)` (the process ended) fails at once, naming `what` and `why`.
pub async fn wait_listening(
    what: &str,
    pid: u32,
    timeout: Duration,
    mut exited: impl FnMut() -> Option<String>,
) -> anyhow::Result<u16> {
    let started = Instant::now();
    loop {
        if let Some(port) = look(what, pid, started, timeout, &mut exited)? {
            return Ok(port);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`wait_listening`] for code that is not async.
pub fn wait_listening_blocking(
    what: &str,
    pid: u32,
    timeout: Duration,
    mut exited: impl FnMut() -> Option<String>,
) -> anyhow::Result<u16> {
    let started = Instant::now();
    loop {
        if let Some(port) = look(what, pid, started, timeout, &mut exited)? {
            return Ok(port);
        }
        std::thread::sleep(POLL);
    }
}

const POLL: Duration = Duration::from_millis(50);

/// One look of the waits above: the port, not yet, or why not ever.
fn look(
    what: &str,
    pid: u32,
    started: Instant,
    timeout: Duration,
    exited: &mut impl FnMut() -> Option<String>,
) -> anyhow::Result<Option<u16>> {
    if let Some(port) = listening_ports(pid).first() {
        return Ok(Some(*port));
    }
    if let Some(why) = exited() {
        bail!("{what} exited before it listened: {why}");
    }
    if started.elapsed() > timeout {
        bail!("{what} (pid {pid}) did not listen within {timeout:?}");
    }
    Ok(None)
}

/// How an attempt of [`retry_when_taken`] ended when it did not start the server.
#[derive(Debug)]
pub enum NotStarted {
    /// Its port was taken (by the time the server bound it): try another.
    Taken,
    /// Anything else: give up.
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for NotStarted {
    fn from(e: anyhow::Error) -> Self {
        NotStarted::Failed(e)
    }
}

/// Attempts of [`retry_when_taken`] before it gives up.
pub const ATTEMPTS: u32 = 8;

/// Starts a server that cannot take port 0: `start(port)` on a port the kernel has just handed out (and released)
/// as free, and again on another while `start` reports [`NotStarted::Taken`]. `start` must report success only
/// once the server itself is seen listening there (its own readiness, or [`listening_ports`] of its pid), never on
/// a connection that someone else's server could answer.
pub fn retry_when_taken<T>(
    what: &str,
    mut start: impl FnMut(u16) -> Result<T, NotStarted>,
) -> anyhow::Result<T> {
    for _ in 0..ATTEMPTS {
        let port = handed_out()?;
        match start(port) {
            Ok(t) => return Ok(t),
            Err(e) => taken_or_fail(what, port, e)?,
        }
    }
    bail!("{what}: {ATTEMPTS} ports in a row were taken before it could bind them")
}

/// [`retry_when_taken`] for a `start` that is async.
pub async fn retry_when_taken_async<T, F, Fut>(what: &str, mut start: F) -> anyhow::Result<T>
where
    F: FnMut(u16) -> Fut,
    Fut: Future<Output = Result<T, NotStarted>>,
{
    for _ in 0..ATTEMPTS {
        let port = handed_out()?;
        match start(port).await {
            Ok(t) => return Ok(t),
            Err(e) => taken_or_fail(what, port, e)?,
        }
    }
    bail!("{what}: {ATTEMPTS} ports in a row were taken before it could bind them")
}

/// A port the kernel hands out as free (bound to port 0 and released): for the retries above only.
fn handed_out() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .context("asking the kernel for a free port")?
        .port())
}

fn taken_or_fail(what: &str, port: u16, e: NotStarted) -> anyhow::Result<()> {
    match e {
        NotStarted::Taken => {
            tracing::info!(
                what,
                port,
                "port taken before the server bound it; another one"
            );
            Ok(())
        }
        NotStarted::Failed(e) => Err(e),
    }
}

/// Starts a server with `start(preferred)`, and with `start(0)` (a port the kernel picks) when `preferred` is 0 or
/// that bind failed as taken ([`addr_in_use`]). Any other error is returned as it is.
pub async fn on_port_or_any<T, F, Fut>(preferred: u16, start: F) -> anyhow::Result<T>
where
    F: Fn(u16) -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    if preferred != 0 {
        match start(preferred).await {
            Err(e) if addr_in_use(&e) => {
                tracing::info!(
                    port = preferred,
                    "port taken: listening on a free one instead"
                );
            }
            other => return other,
        }
    }
    start(0).await
}

/// Whether `e` is (or was caused by) a bind that failed because the address is in use.
pub fn addr_in_use(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_reserved_port_refuses_connections_and_keeps_other_binds_off() {
        let reserved = ReservedPort::new().unwrap();
        let refused = tokio::net::TcpStream::connect(reserved.addr()).await;
        assert!(refused.is_err(), "nothing listens on a reserved port");
        let other = std::net::TcpListener::bind(reserved.addr());
        assert_eq!(
            other.err().map(|e| e.kind()),
            Some(std::io::ErrorKind::AddrInUse),
            "a plain bind of a reserved port fails"
        );
        // The one it was reserved for takes it over, and connections reach it.
        let listener = ReservedPort::listen(reserved.port()).unwrap();
        let accepted = tokio::spawn(async move { listener.accept().await.map(|_| ()) });
        tokio::net::TcpStream::connect(reserved.addr())
            .await
            .unwrap();
        accepted.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn listening_ports_sees_this_process_listen_and_stop() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listening_ports(std::process::id()).contains(&port));
        drop(listener);
        assert!(!listening_ports(std::process::id()).contains(&port));
        // A bound socket that does not listen is not listening.
        let reserved = ReservedPort::new().unwrap();
        assert!(!listening_ports(std::process::id()).contains(&reserved.port()));
    }

    #[tokio::test]
    async fn a_taken_preferred_port_falls_back_to_any_and_other_errors_stay() {
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let preferred = taken.local_addr().unwrap().port();
        let bind = |port: u16| async move {
            tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .with_context(|| format!("listening on {port}"))
        };
        let got = on_port_or_any(preferred, bind).await.unwrap();
        assert_ne!(got.local_addr().unwrap().port(), preferred);
        let other = on_port_or_any(preferred, |_| async {
            Err::<(), _>(anyhow::anyhow!("not a bind error"))
        })
        .await;
        assert!(other.is_err());
    }

    #[test]
    fn retry_when_taken_moves_on_from_a_taken_port_and_stops_at_a_failure() {
        let mut seen = Vec::new();
        let got = retry_when_taken("server", |port| {
            seen.push(port);
            if seen.len() < 3 {
                Err(NotStarted::Taken)
            } else {
                Ok(port)
            }
        })
        .unwrap();
        assert_eq!(seen.len(), 3);
        assert_eq!(Some(&got), seen.last());
        let failed: anyhow::Result<u16> = retry_when_taken("server", |_| {
            Err(NotStarted::Failed(anyhow::anyhow!("broken")))
        });
        assert_eq!(failed.unwrap_err().to_string(), "broken");
        let never: anyhow::Result<u16> = retry_when_taken("server", |_| Err(NotStarted::Taken));
        assert!(never.unwrap_err().to_string().contains("in a row"));
    }

    #[tokio::test]
    async fn retry_when_taken_async_moves_on_from_a_taken_port() {
        let mut tries = 0;
        let got = retry_when_taken_async("server", |port| {
            tries += 1;
            let taken = tries < 2;
            async move {
                if taken {
                    Err(NotStarted::Taken)
                } else {
                    Ok(port)
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(tries, 2);
        assert_ne!(got, 0);
    }
}
