//! `outbox`: the operator CLI. Migrate, status, dead letters, prune, relay runs and the web console, against a real database.
//! Every command calls the same library code the Lambdas run. (The local pipeline and the benchmarks are
//! `outbox-dev`'s.)

use clap::{Parser, Subcommand};
use outbox_cli::{console, dead_letters, prune, relay_cmd, status, subscribers, tenants, util};

#[derive(Parser)]
#[command(
    name = "outbox",
    version,
    about = "Transactional outbox → QStash: operate and inspect"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Backlog depth, oldest pending age and flapping events; dispatched per minute over the last hour; stuck
    /// leases; blocked ordered keys; dead letters by topic and source. A table, or --json.
    Status(status::StatusArgs),
    /// Dead letters: list, show, redrive (one, or a filtered set), purge.
    #[command(subcommand, visible_alias = "dlq")]
    DeadLetters(dead_letters::DeadLettersCommand),
    /// Retention: dispatched outbox rows, consumer dedupe rows, handled dead letters and unreferenced dead rows,
    /// in bounded batches with progress.
    Prune(prune::PruneArgs),
    /// Apply the embedded migrations (the outbox tables the Lambdas expect) and show the schema version.
    Migrate(util::MigrateArgs),
    /// Run the relay locally with the Lambda's configuration variables (QSTASH_URL, QSTASH_TOKEN, CONSUMER_URL,
    /// CALLBACK_URL, DATABASE_URL, RELAY_*): one simulated invocation after another.
    Relay(relay_cmd::RelayArgs),
    /// The operator console: the outbox in a browser (overview, topics and keys, one event's timeline, dead
    /// letters with guarded redrive and purge). Loopback by default; another bind needs --token-file.
    Console(console::ConsoleArgs),
    /// Fan-out: the subscribers of each topic (list, add with or without the retained history, replay, remove).
    #[command(subcommand)]
    Subscribers(subscribers::SubscribersCommand),
    /// Fairness per tenant: the backlog and lag per fairness key (list), holding one tenant's events in the outbox
    /// (pause, optionally at QStash too with --qstash) and releasing them (resume).
    #[command(subcommand)]
    Tenants(tenants::TenantsCommand),
}

#[tokio::main]
async fn main() {
    outbox::install_crypto_provider();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Status(args) => status::run(args, &mut std::io::stdout()).await,
        Command::DeadLetters(cmd) => {
            dead_letters::run(cmd, &mut std::io::stdout(), dead_letters::Confirm::detect()).await
        }
        Command::Prune(args) => prune::run(args, &mut std::io::stdout()).await.map(|_| ()),
        Command::Migrate(args) => util::migrate(&args).await,
        Command::Relay(args) => relay_cmd::run(args).await,
        Command::Console(args) => console::run(args).await,
        Command::Subscribers(cmd) => subscribers::run(cmd, &mut std::io::stdout()).await,
        Command::Tenants(cmd) => tenants::run(cmd, &mut std::io::stdout()).await,
    };
    if let Err(e) = result {
        // Errors can quote stored data (a topic, a database message): escaped like every other line.
        eprintln!("error: {}", util::printable(&format!("{e:#}")));
        std::process::exit(1);
    }
}
