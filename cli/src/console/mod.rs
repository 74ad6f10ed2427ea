//! `outbox console`: the outbox in a browser — the overview of `outbox status` refreshing live, topics and
//! ordered keys, one event's whole life as a timeline, the dead letters grouped by error with guarded
//! redrive and purge, and the tenants (fairness keys) by lag, each one paused or resumed with a button. Server-rendered HTML, no script; every figure and list comes from the library
//! (`outbox::ops`, `outbox::dead_letters`), as the other commands' do.
//!
//! Safe with hostile data: every stored string reaches a page only through the escaper ([`html::Html`]).
//! Safe on a network: loopback by default, a token required for any other bind, Host and Origin checked, every
//! action a POST with a CSRF token, `--read-only` to refuse them all ([`auth`]; docs/console.md).
//!
//! | file | concern |
//! |---|---|
//! | `html.rs` | [`html::Html`] and the escaper |
//! | `auth.rs` | tokens, session cookies, CSRF tokens, Host and Origin |
//! | `server.rs` | router, the checks every request passes, parameters, responses |
//! | `layout.rs` | the page frame, the style sheet, formatting helpers |
//! | `overview.rs` | the overview: `outbox status`'s numbers and the per-minute chart |
//! | `pages.rs` | topics, keys, event timeline, action log, log-in |
//! | `subscribers.rs` | fan-out: per subscriber and topic, lag, in flight, blocked lanes, dead letters, replay |
//! | `tenants.rs` | fairness keys: backlog and lag per tenant, pause and resume one (logged) |
//! | `dead_letters.rs` | dead letters: groups, list, one, redrive, bulk redrive and purge |

pub mod auth;
mod context;
mod dead_letters;
mod event;
pub mod html;
mod layout;
mod overview;
mod pages;
mod respond;
mod server;
mod subscribers;
mod tenants;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Args;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::util::DbArgs;
use auth::{HostCheck, Keys, Token};
use context::App;

/// Arguments of `outbox console`.
#[derive(Args, Debug, Clone)]
pub struct ConsoleArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 7070)]
    pub port: u16,
    /// Address to listen on. Anything but loopback needs --token-file.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    pub bind: IpAddr,
    /// Show everything, change nothing: no redrive or purge (hidden and refused).
    #[arg(long)]
    pub read_only: bool,
    /// A file of `name:secret` lines (secrets of at least 16 characters): the console then asks for one to log in,
    /// and the action log names who acted. Required for a bind address other than loopback.
    #[arg(long, env = "OUTBOX_CONSOLE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Another `Host` the console answers to (`name` or `name:port`; e.g. behind a reverse proxy). Loopback names
    /// and the address it listens on are always accepted.
    #[arg(long)]
    pub allow_host: Vec<String>,
    /// The consumers' dedupe namespaces (`CONSUMER_NAME`) the event page looks in for "applied".
    #[arg(
        long = "consumer",
        env = "CONSUMER_NAME",
        default_value = "consumer",
        value_delimiter = ','
    )]
    pub consumers: Vec<String>,
    /// The overview reloads itself this often, seconds (0: never).
    #[arg(long, default_value_t = 5)]
    pub refresh_secs: u32,
    /// Postgres cancels any statement of the console that runs longer than this, seconds: a page whose query
    /// waits on a lock or runs too long answers with an error instead of hanging (1 to 3600).
    #[arg(
        long,
        env = "OUTBOX_CONSOLE_STATEMENT_TIMEOUT_SECS",
        default_value_t = DEFAULT_STATEMENT_TIMEOUT_SECS,
        value_parser = clap::value_parser!(u32).range(1..=3600)
    )]
    pub statement_timeout_secs: u32,
}

/// `--statement-timeout-secs`' default: far above what any page takes on a large database (docs/console.md,
/// "Page times"), far below a browser's patience.
pub const DEFAULT_STATEMENT_TIMEOUT_SECS: u32 = 15;

/// A running console.
pub struct Console {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Console {
    /// Checks the arguments (a bind address other than loopback without tokens is refused), connects, binds and
    /// starts serving.
    pub async fn start(args: &ConsoleArgs) -> anyhow::Result<Console> {
        let tokens = match &args.token_file {
            Some(path) => Token::read_file(path)?,
            None => Vec::new(),
        };
        let requested = SocketAddr::new(args.bind, args.port);
        if tokens.is_empty() && !auth::is_loopback(&requested) {
            bail!(
                "refusing to serve the console on {requested} without a token: anyone who can reach that address \
                 could redrive and purge. Give --token-file (lines of name:secret), or bind 127.0.0.1"
            );
        }
        let pool = connect(args).await?;
        let horizon = crate::status::reconcile_horizon()?;
        let listener = TcpListener::bind(requested)
            .await
            .with_context(|| format!("listening on {requested}"))?;
        let addr = listener.local_addr()?;
        let app = Arc::new(App {
            pool,
            keys: Keys::random(),
            tokens,
            hosts: HostCheck {
                bound: addr,
                allowed: args.allow_host.clone(),
            },
            read_only: args.read_only,
            horizon,
            consumers: args.consumers.clone(),
            refresh_secs: args.refresh_secs,
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::serve(listener, app, async {
            let _ = stopped.await;
        }));
        tracing::info!(%addr, read_only = args.read_only, "console listening");
        Ok(Console {
            addr,
            stop: Some(stop),
            task,
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>` (`127.0.0.1` for an unspecified bind address).
    pub fn url(&self) -> String {
        url_for(self.addr)
    }

    /// Stops serving (requests under way finish first).
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await.context("console task")??;
        Ok(())
    }
}

/// The console's pool: every connection has `statement_timeout` set from `--statement-timeout-secs` (as a startup
/// parameter, so it holds for every statement on it, pages and actions alike).
async fn connect(args: &ConsoleArgs) -> anyhow::Result<sqlx::PgPool> {
    if args.statement_timeout_secs == 0 {
        bail!("--statement-timeout-secs must be at least 1: a query must not hang a page forever");
    }
    args.db.schema()?;
    let options = crate::util::connect_options(&args.db.database_url)?.options([(
        "statement_timeout",
        format!("{}s", args.statement_timeout_secs),
    )]);
    crate::util::connect_with(options).await
}

/// The URL to open for a console listening on `addr`.
pub fn url_for(addr: SocketAddr) -> String {
    let ip = if addr.ip().is_unspecified() {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        addr.ip()
    };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

/// `outbox console`: serves until Ctrl-C.
pub async fn run(args: ConsoleArgs) -> anyhow::Result<()> {
    outbox::telemetry::init_from_env();
    let console = Console::start(&args).await?;
    println!(
        "outbox console on {}{}{}  (Ctrl-C stops it)",
        console.url(),
        if args.read_only { ", read-only" } else { "" },
        if args.token_file.is_some() {
            ", log in with a token"
        } else {
            ""
        }
    );
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    console.stop().await
}
