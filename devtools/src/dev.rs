//! `outbox-dev dev`: the whole pipeline on one machine, with live progress. Ctrl-C stops the demo producer, lets
//! the relay and the dev server finish what is in flight (bounded by `--drain-secs`), then stops every component
//! after its current step: nothing that was committed is lost (a second Ctrl-C skips the wait).
//!
//! stdout carries the progress only (the `console` module): a table redrawn in place on a terminal, plain lines
//! otherwise, and the summary as the last line. Every component's log lines go to a file named in the first lines
//! ([`logs`]); `--verbose` shows them on stderr too. The operator console (`outbox console`) runs alongside on
//! 127.0.0.1:7070 (`--console-port`; any free port when that one is taken), and the first lines print its URL.
//!
//! Ports are bound once: a server is started on the port asked for, and only when that bind fails because the port
//! is taken is it started again on a port the kernel picks (0). Never "is it free? then bind": two runs side by
//! side (tests under nextest) could both find it free and one would fail.

mod console;
pub mod dead_letters;
mod figures;
pub mod logs;
pub mod mirror;

pub use console::summary_line;
pub use figures::{DevSummary, Progress, SubscriberCounts, progress, subscriber_counts};

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use outbox::db::Db;
use tokio::sync::watch;

use orders_example::demo::{self, DemoCounts, DemoOptions};
use outbox_cli::util::{DbArgs, connect};
use outbox_testkit::db::with_database;
use outbox_testkit::pg_local;
use outbox_testkit::ports::on_port_or_any;
use outbox_testkit::stack::{LocalStack, StackOptions};

use console::{Console, Frame, Style};
use dead_letters::Tally;

/// Arguments of `outbox-dev dev`.
#[derive(Args, Debug, Clone)]
pub struct DevArgs {
    /// The Postgres server: a fresh `outbox_local` database on it, or (--existing-db) its own database. When
    /// this is the default and nothing answers at 127.0.0.1:5432 (OUTBOX_PG_PROBE overrides the address probed),
    /// a throwaway cluster is started from the server binaries on this machine (initdb, pg_ctl) and stopped at
    /// exit.
    #[command(flatten)]
    pub db: DbArgs,
    /// Run against DATABASE_URL's database as it is (migrated, never dropped) instead of a fresh `outbox_local`
    /// database on the same server.
    #[arg(long)]
    pub existing_db: bool,
    /// Do not run the demo producer (publish your own events, or just inspect).
    #[arg(long)]
    pub no_demo: bool,
    /// Fault injection: 10% of publishes fail with 5xx, 5% lose their response after being accepted, 10% of
    /// deliveries are duplicated, 5% fail on the network, and the flow-control waitlist is shuffled.
    #[arg(long)]
    pub faults: bool,
    /// Demo orders per second.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// One demo order in N is poison (rejected as permanent, ends in the dead letters); 0 disables.
    #[arg(long, default_value_t = 25)]
    pub poison_every: u64,
    /// Port of the QStash dev server (falls back to a free port when taken; 0 = any).
    #[arg(long, default_value_t = 8080)]
    pub qstash_port: u16,
    /// Port of the operator console (falls back to a free port when taken; 0 = any). Its URL is printed at start.
    #[arg(long, default_value_t = CONSOLE_PORT)]
    pub console_port: u16,
    /// Stop after this many seconds, as if Ctrl-C had been pressed.
    #[arg(long)]
    pub duration_secs: Option<u64>,
    /// On shutdown, wait at most this long for in-flight events.
    #[arg(long, default_value_t = 30)]
    pub drain_secs: u64,
    /// Print progress as JSON lines instead of a table (the last line is the summary as JSON).
    #[arg(long)]
    pub json: bool,
    /// Also show the log lines, on stderr. Every component's logs (relay, consumer and callback handlers, QStash
    /// dev server, demo producer) always go to the log file named at start; stdout keeps the progress. With
    /// --verbose the live table gives way to plain progress lines (every --progress-secs) between the log lines.
    #[arg(long, short)]
    pub verbose: bool,
    /// The log file [default: target/outbox-dev/dev-{UTC time}-{pid}.log in the cargo target directory of this
    /// binary, else under the temp directory]. RUST_LOG sets its level (default info); LOG_FORMAT=json for JSON.
    #[arg(long)]
    pub log_file: Option<PathBuf>,
    /// Seconds between two progress lines when stdout is not a terminal (or with --json or --verbose); on a
    /// terminal the table is redrawn every second.
    #[arg(long, default_value_t = 5)]
    pub progress_secs: u64,
    /// Subscribers of each example topic (fan-out, docs/fanout.md): the default consumer plus N-1 named ones
    /// (billing, shipping, search, …), each a consumer of its own on its own port; the last one rejects the audit
    /// entries of orders whose id ends in 7, which the others accept. The summary counts each one's events.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub subscribers: u32,
    /// Export the whole pipeline's traces by OTLP/HTTP to this base URL (a local trace viewer's, e.g.
    /// http://127.0.0.1:4318; docs/operations.md, "Tracing"). Without it the standard OTEL_EXPORTER_OTLP_ENDPOINT
    /// does the same; with neither, nothing is exported.
    #[arg(long, value_name = "URL")]
    pub otlp: Option<String>,
}

/// The database to run against on the server at `server_url`: that URL's own with `--existing-db`, else a fresh
/// `outbox_local`.
async fn prepare_database(server_url: &str, existing_db: bool) -> anyhow::Result<String> {
    if existing_db {
        return Ok(server_url.to_owned());
    }
    let admin = connect(server_url).await?;
    sqlx::query("DROP DATABASE IF EXISTS outbox_local WITH (FORCE)")
        .execute(&admin)
        .await?;
    sqlx::query("CREATE DATABASE outbox_local")
        .execute(&admin)
        .await
        .context(
            "creating the outbox_local database (the user needs CREATEDB, or use --existing-db)",
        )?;
    admin.close().await;
    Ok(with_database(server_url, "outbox_local"))
}

/// How stdout shows progress: JSON when asked, a live table on a terminal, plain lines otherwise.
fn style(args: &DevArgs) -> Style {
    let terminal =
        std::io::stdout().is_terminal() && std::env::var_os("TERM").is_none_or(|t| t != "dumb");
    if args.json {
        Style::Json
    } else if terminal && !args.verbose {
        Style::Live
    } else {
        Style::Lines
    }
}

/// Runs the local pipeline until Ctrl-C (or `--duration-secs`).
pub async fn run(args: DevArgs) -> anyhow::Result<DevSummary> {
    let log_file = args.log_file.clone().unwrap_or_else(logs::default_path);
    let tracing_to = logs::install(&log_file, args.verbose, args.otlp.as_deref())?;
    let mut console = Console::new(style(&args));
    console.line("outbox-dev dev — the whole pipeline, locally");
    console.line(&format!(
        "  log file          {}{}",
        logs::display(&log_file),
        if args.verbose {
            "   (shown on stderr too)"
        } else {
            "   (--verbose shows it here too)"
        }
    ));
    if let Some(to) = &tracing_to {
        console.line(&format!("  traces            OTLP/HTTP to {to}"));
    }
    tracing::info!(log_file = %log_file.display(), "outbox-dev dev starting");
    // OUTBOX_SCHEMA is checked here, at the edge: a bad name stops the command instead of falling back to public.
    let schema = outbox::schema::from_process_env()?;
    outbox::schema::install(&schema)?;
    // No DATABASE_URL (or the default) and nothing at the default address: a throwaway cluster, stopped when
    // `local_pg` is dropped at the end of this function (also on an error or a panic).
    let parent = logs::target_dir()
        .map(|t| t.join("pg-local"))
        .unwrap_or_else(|| std::env::temp_dir().join("outbox-pg-local"));
    let requested = args.db.database_url.clone();
    let local_pg =
        tokio::task::spawn_blocking(move || pg_local::start_unless_reachable(&requested, &parent))
            .await??;
    let server_url = local_pg
        .as_ref()
        .map_or_else(|| args.db.database_url.clone(), |pg| pg.url());
    let url = prepare_database(&server_url, args.existing_db).await?;
    let mut opts = StackOptions::new(&url)?;
    let statements = opts.statements;
    if args.faults {
        opts.dev.faults = qstash_dev::Faults {
            publish_5xx_rate: 0.10,
            publish_drop_response_rate: 0.05,
            duplicate_delivery_rate: 0.10,
            delivery_network_error_rate: 0.05,
            ..Default::default()
        };
        opts.dev.waitlist_order = qstash_dev::WaitlistOrder::Shuffled;
        opts.dev.time_scale = 0.05; // QStash's 12 s first retry becomes 0.6 s
    }
    let consumer_name = opts.consumer_name.clone();
    let named = mirror::names(args.subscribers);
    if !named.is_empty() {
        let admin = connect(&url).await?;
        sqlx::query(mirror::CREATE_SQL).execute(&admin).await?;
        admin.close().await;
    }
    opts.subscribers = named
        .iter()
        .enumerate()
        .map(|(i, name)| outbox_testkit::stack::SubscriberOptions {
            name: name.clone(),
            topics: vec![
                orders_example::ORDERS.name().to_owned(),
                orders_example::AUDIT.name().to_owned(),
            ],
            registry: mirror::registry(name, i + 1 == named.len()),
        })
        .collect();
    opts.dev.port = args.qstash_port;
    let stack = LocalStack::start(opts).await?;
    let operator_console = on_port_or_any(args.console_port, |port| {
        start_console(&url, &consumer_name, port)
    })
    .await?;
    let keys = stack.dev.signing_keys();
    for line in [
        format!("  database          {}", redact(&url)),
        format!(
            "  QStash dev server {}  (token {})",
            stack.dev.url(),
            stack.dev.token()
        ),
        format!(
            "  signing keys      current {}  next {}",
            keys.current, keys.next
        ),
        format!(
            "  consumer          {}/events/{{topic}}",
            stack.consumer_url
        ),
        format!(
            "  failure callback  {}/failure   delivery callback {}/delivered",
            stack.callback_url, stack.callback_url
        ),
        format!(
            "  demo producer     {}",
            if args.no_demo {
                "off".to_string()
            } else {
                format!("{} orders/s, 1 in {} poison", args.rate, args.poison_every)
            }
        ),
    ] {
        console.line(&line);
    }
    for (i, name) in named.iter().enumerate() {
        console.line(&format!(
            "  subscriber        {name} at {}/events/{{topic}}{}",
            stack.subscriber_url(name).unwrap_or("?"),
            if i + 1 == named.len() {
                "   (rejects the audit entries of orders whose id ends in 7)"
            } else {
                ""
            }
        ));
    }
    if args.faults {
        console.line(
            "  fault injection   ON (publish 5xx 10%, lost responses 5%, duplicate deliveries 10%, network errors 5%, shuffled waitlist)",
        );
    }
    console.line(&format!(
        "  console           {}   (the operator console in a browser: outbox console --database-url {})",
        operator_console.url(),
        redact(&url)
    ));
    console.line(&format!(
        "  inspect           outbox status --database-url {}   (Ctrl-C to stop)\n",
        redact(&url)
    ));

    let (stop_tx, stop_rx) = watch::channel(false);
    let (counts_tx, counts_rx) = watch::channel(DemoCounts::default());
    let demo_task = (!args.no_demo).then(|| {
        tokio::spawn(demo::run(
            Db::new(stack.pool.clone(), statements),
            DemoOptions {
                orders_per_sec: args.rate,
                poison_every: args.poison_every,
            },
            stop_rx.clone(),
            counts_tx,
        ))
    });

    let started = Instant::now();
    let every = if console.style() == Style::Live {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(args.progress_secs.max(1))
    };
    let mut reporter = Reporter {
        stack: &stack,
        started,
        last: Progress::default(),
        last_at: started,
        tally: Tally::default(),
    };
    let mut tick = tokio::time::interval(every);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let stop_at = args.duration_secs.map(|s| started + Duration::from_secs(s));
    let running = if args.duration_secs.is_some() {
        "running — Ctrl-C to stop early"
    } else {
        "running — Ctrl-C to stop"
    };
    loop {
        let until_stop = stop_at.map(|t| t.saturating_duration_since(Instant::now()));
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut ctrl_c => break,
            _ = tokio::time::sleep(until_stop.unwrap_or(Duration::MAX)), if until_stop.is_some() => break,
        }
        reporter.report(&mut console, running).await?;
        if stop_at.is_some_and(|t| Instant::now() >= t) {
            break;
        }
    }

    let stopping = format!(
        "stopping: demo producer off; draining for up to {} s (Ctrl-C again to skip)",
        args.drain_secs
    );
    if console.style() != Style::Live {
        console.line(&stopping);
    }
    let _ = stop_tx.send(true);
    if let Some(t) = demo_task {
        let _ = t.await;
    }
    let drained = {
        let quiet = stack.wait_quiet(Duration::from_secs(args.drain_secs));
        tokio::pin!(quiet);
        let skip = tokio::signal::ctrl_c();
        tokio::pin!(skip);
        loop {
            tokio::select! {
                d = &mut quiet => break d,
                _ = &mut skip => break false,
                _ = tick.tick() => reporter.report(&mut console, &stopping).await?,
            }
        }
    };
    let end = if drained {
        "stopped cleanly: everything committed was dispatched and delivered (or dead-lettered)."
    } else {
        "stopped before the pipeline was idle: events still pending in the outbox will be relayed on the next run \
         with --existing-db; messages the dev server had not delivered yet are gone with it."
    };
    reporter.report(&mut console, "stopped").await?;
    let last = reporter.last;
    let causes = reporter.tally.causes();
    let subscribers = if named.is_empty() {
        Vec::new()
    } else {
        subscriber_counts(&stack.pool, &consumer_name, &named).await?
    };
    stack.stop().await;
    // The last spans (the producer's, the consumers' since their last request) before the process ends.
    outbox::telemetry::flush().await;
    operator_console.stop().await?;
    let c = *counts_rx.borrow();
    let summary = DevSummary {
        progress: last,
        demo_orders: c.orders,
        demo_poison: c.poison,
        demo_cancellations: c.cancellations,
        demo_failed: c.failed,
        demo: !args.no_demo,
        dead_letters_by_cause: causes,
        drained,
        seconds: started.elapsed().as_secs_f64(),
        log_file: log_file.clone(),
        subscribers,
    };
    tracing::info!(summary = %serde_json::to_string(&summary)?, "outbox-dev dev stopped");
    console.line(end);
    console.line(&format!("  logs: {}", logs::display(&log_file)));
    console.line(&console::summary_line(&summary));
    if args.json {
        console.line(&serde_json::to_string(&summary)?);
    }
    Ok(summary)
}

/// Reads the figures and the new dead letters and shows them.
struct Reporter<'a> {
    stack: &'a LocalStack,
    started: Instant,
    last: Progress,
    last_at: Instant,
    tally: Tally,
}

impl Reporter<'_> {
    async fn report(&mut self, console: &mut Console, state: &str) -> anyhow::Result<()> {
        let mut now = progress(&self.stack.pool).await?;
        now.qstash_attempts = self.stack.dev.handle().stats().attempts;
        let new_dead = self.tally.update(&self.stack.pool).await?;
        let causes = self.tally.causes();
        console.frame(&Frame {
            t: self.started.elapsed().as_secs_f64(),
            now,
            before: self.last,
            since: self.last_at.elapsed().as_secs_f64(),
            new_dead: &new_dead,
            causes: &causes,
            state,
        })?;
        self.last = now;
        self.last_at = Instant::now();
        Ok(())
    }
}

/// The operator console (`outbox console`) on the pipeline's database, on 127.0.0.1:`port` (0: any free port);
/// loopback without tokens, as `outbox console` runs by default.
async fn start_console(
    database_url: &str,
    consumer_name: &str,
    port: u16,
) -> anyhow::Result<outbox_cli::console::Console> {
    let args = outbox_cli::console::ConsoleArgs {
        db: outbox_cli::util::DbArgs {
            database_url: database_url.to_owned(),
        },
        port,
        bind: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        read_only: false,
        token_file: None,
        allow_host: Vec::new(),
        consumers: vec![consumer_name.to_owned()],
        refresh_secs: 5,
        statement_timeout_secs: outbox_cli::console::DEFAULT_STATEMENT_TIMEOUT_SECS,
    };
    outbox_cli::console::Console::start(&args)
        .await
        .context("starting the operator console")
}

/// The operator console's port (`outbox console`'s default).
const CONSOLE_PORT: u16 = 7070;

fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("****"));
            u.to_string()
        }
        _ => url.to_owned(),
    }
}
