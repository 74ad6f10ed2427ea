//! `outbox-dev`: developer commands. The whole pipeline locally (`dev`), the benchmarks (`bench`), the soak
//! (`soak`), the example application's migrations (`example migrate`) and the sample events (`events resign`).
//! The operator commands are the `outbox` CLI's.

use clap::{Parser, Subcommand};
use outbox_devtools::{bench, dev, events, example, soak};

#[derive(Parser)]
#[command(
    name = "outbox-dev",
    version,
    about = "Transactional outbox → QStash: the whole pipeline locally, and benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the whole pipeline locally: migrations, the QStash-compatible dev server, the consumer and
    /// failure-callback handlers on local ports, the relay, and a demo producer, with live progress.
    ///
    /// stdout shows the progress only: on a terminal, a table redrawn in place; when stdout is a file or a pipe,
    /// plain lines every --progress-secs with no escape codes. Either way the last line is the summary (events
    /// enqueued, applied, dead-lettered by cause with the demo's poison orders apart, left pending). Log lines
    /// of every component go to the log file named in the first lines; --verbose shows them on stderr as well.
    Dev(dev::DevArgs),
    /// Benchmarks (figures and one JSON line; never assertions).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// The pipeline under chaos, then an account of every event.
    ///
    /// Producers (ordered and unordered topics, poison events), relays, consumer and callback receiver as
    /// separate processes SIGKILLed and restarted at random moments, their Postgres backends terminated, the dev
    /// server's faults on, optionally a Postgres restart and a QStash outage. Prints one line (stdout; progress on stderr) and exits non-zero when an event was
    /// lost, applied twice or applied out of order, or rows are left leased.
    Soak(soak::SoakArgs),
    /// The example application the consumer function ships with: its migrations.
    #[command(subcommand)]
    Example(example::ExampleCommand),
    /// The sample function-URL events in `events/` (for `cargo lambda invoke --data-file`).
    #[command(subcommand)]
    Events(events::EventsCommand),
    /// A worker process of `soak` (started by it).
    #[command(subcommand, hide = true)]
    SoakWorker(soak::worker::SoakWorker),
}

#[tokio::main]
async fn main() {
    outbox::install_crypto_provider();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Dev(args) => dev::run(args).await.map(|_| ()),
        Command::Bench(cmd) => bench::run(cmd).await,
        Command::Soak(args) if args.schedule == soak::ScheduleKind::Random => {
            if args.print_schedule {
                print!(
                    "{}",
                    soak::explore::schedule::Schedule::draw(
                        args.seed,
                        std::time::Duration::from_secs_f64(args.minutes.max(0.0) * 60.0)
                    )
                );
                return;
            }
            match soak::explore::run(args).await {
                Ok(report) => {
                    if !report.ok {
                        eprint!("{}", report.details);
                    }
                    println!("{}", report.line());
                    if !report.ok {
                        std::process::exit(1);
                    }
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        Command::Soak(args) => match soak::run(args).await {
            Ok(report) => {
                println!("{}", report.line());
                if !report.ok {
                    std::process::exit(1);
                }
                Ok(())
            }
            Err(e) => Err(e),
        },
        Command::Events(cmd) => events::run(cmd),
        Command::Example(cmd) => example::run(cmd).await,
        Command::SoakWorker(w) => soak::worker::run(w).await,
    };
    if let Err(e) = result {
        // Errors can quote stored data (a topic, a database message): escaped like every other line.
        eprintln!("error: {}", outbox_cli::util::printable(&format!("{e:#}")));
        std::process::exit(1);
    }
}
