//! The operations a schedule is made of ([`Op`]: traffic phases, faults, operator actions) and their parts (the
//! worker a fault hits, a dev-server fault, where an addition starts, how its replay runs, a dead-letter
//! selection); each named by its kind for counting and printed as a line of the schedule.

use std::fmt;

use serde::Serialize;

use super::layout::{TOPICS, label};

/// A worker process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Target {
    /// Relay process `i`.
    Relay(usize),
    /// The consumer of subscriber `i` ([`SUBSCRIBERS`](super::layout::SUBSCRIBERS)).
    Consumer(usize),
    /// The callback receiver.
    Callback,
}

/// A fault of the QStash dev server, for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum DevFault {
    /// Every publish fails (500).
    Outage,
    /// 50 % of accepted messages are lost before their first attempt (no delivery, no callback).
    LoseMessages,
    /// 50 % of publishes are stored but their response is dropped.
    DropPublishResponses,
    /// 30 % of delivery responses are lost after the consumer did the work.
    LoseDeliveryResponses,
}

/// Where an added subscriber's history starts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum From {
    /// From now on (`--from now`).
    Now,
    /// Events written in the last `secs` seconds (`--from <time>`).
    Back { secs: u32 },
    /// Events written from `secs` seconds before the subscriber's last removal (`--from <time>`): the replay
    /// reaches what was in flight when it was removed.
    BeforeRemoval { secs: u32 },
}

/// How an added subscriber's replay runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ReplayMode {
    /// To the end.
    Whole,
    /// Stopped after this many chunks (the operator's command interrupted); a later [`Op::Resume`] finishes it.
    Interrupted { chunks: u32 },
}

/// Which dead letters a redrive or purge selects (at least one field set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Selection {
    pub topic: Option<usize>,
    pub subscriber: Option<usize>,
    pub key: Option<u32>,
    /// Only those whose error mentions the poison.
    pub poison: bool,
}

/// One operation of a schedule.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Op {
    /// From here on, producers write `rate` events per second over all topics; `poison` and `delayed` are the
    /// shares of poison events (for a random set of subscribers) and of delayed ones (1–5 s).
    Traffic {
        rate: f64,
        poison: f64,
        delayed: f64,
    },
    /// SIGKILL, started again at once.
    Kill(Target),
    /// SIGKILL, started again after `secs` (a consumer down: QStash retries; the callback receiver down: callbacks
    /// refused, then lost).
    Down { target: Target, secs: f64 },
    /// Subscriber `sub`'s handler sleeps `ms` per event for `secs`.
    Slow { sub: usize, secs: f64, ms: u32 },
    /// A dev-server fault for `secs`.
    Dev { fault: DevFault, secs: f64 },
    /// `pg_terminate_backend` of the relays' (`relays`) or the receivers' connections.
    Backends { relays: bool },
    /// A producer transaction that writes an event to `topic` and stays open `secs`, pinning the xmin horizon
    /// (replays and removals wait for it).
    LongTransaction { secs: f64, topic: usize },
    /// `pg_ctl stop -m immediate`, then start after `down_secs`.
    PgCrash { down_secs: f64 },
    /// Operator action `action`, with Postgres crashed `after_ms` into it (down `down_secs`): during a replay, a
    /// removal, a partition drop.
    CrashDuring {
        action: Box<Op>,
        after_ms: u32,
        down_secs: f64,
    },
    /// `outbox subscribers add`.
    Add {
        topic: usize,
        sub: usize,
        from: From,
        replay: ReplayMode,
    },
    /// `outbox subscribers remove`.
    Remove { topic: usize, sub: usize },
    /// `outbox subscribers replay` (resumes an interrupted replay; nothing when none is under way).
    Resume { topic: usize, sub: usize },
    /// The consumers are fixed: poison written so far is accepted from now on.
    Cure,
    /// `outbox dead-letters redrive` with a filter.
    Redrive(Selection),
    /// `outbox dead-letters purge` with a filter (`handled_only`: `--handled`).
    Purge {
        selection: Selection,
        handled_only: bool,
    },
    /// `outbox prune --outbox-hours` at a retention of `retention_secs`.
    Prune { retention_secs: u32 },
    /// The outbox's partition maintenance at a retention of `retention_secs`, partitions of at least 200 ids.
    Partitions { retention_secs: u32 },
}

impl Op {
    /// The kind, for counting: `kill relay`, `dev outage`, `add --from`, …
    pub fn kind(&self) -> String {
        match self {
            Op::Traffic { .. } => "traffic".into(),
            Op::Kill(t) => format!("kill {}", target_kind(*t)),
            Op::Down { target, .. } => format!("down {}", target_kind(*target)),
            Op::Slow { .. } => "slow consumer".into(),
            Op::Dev { fault, .. } => format!("dev {}", dev_fault_name(*fault)),
            Op::Backends { .. } => "backend kill".into(),
            Op::LongTransaction { .. } => "long transaction".into(),
            Op::PgCrash { .. } => "postgres crash".into(),
            Op::CrashDuring { action, .. } => action.kind(),
            Op::Add { from, replay, .. } => match (from, replay) {
                (From::Now, _) => "add".into(),
                (_, ReplayMode::Whole) => "add --from".into(),
                (_, ReplayMode::Interrupted { .. }) => "add --from (interrupted)".into(),
            },
            Op::Remove { .. } => "remove".into(),
            Op::Resume { .. } => "replay (resume)".into(),
            Op::Cure => "cure".into(),
            Op::Redrive(_) => "redrive".into(),
            Op::Purge { .. } => "purge".into(),
            Op::Prune { .. } => "prune".into(),
            Op::Partitions { .. } => "partition maintenance".into(),
        }
    }

    /// An operator action (run one at a time by the operator task), rather than traffic or a fault.
    pub fn is_action(&self) -> bool {
        matches!(
            self,
            Op::CrashDuring { .. }
                | Op::Add { .. }
                | Op::Remove { .. }
                | Op::Resume { .. }
                | Op::Cure
                | Op::Redrive(_)
                | Op::Purge { .. }
                | Op::Prune { .. }
                | Op::Partitions { .. }
        )
    }
}

fn target_kind(t: Target) -> &'static str {
    match t {
        Target::Relay(_) => "relay",
        Target::Consumer(_) => "consumer",
        Target::Callback => "callback receiver",
    }
}

fn dev_fault_name(f: DevFault) -> &'static str {
    match f {
        DevFault::Outage => "outage",
        DevFault::LoseMessages => "lost messages",
        DevFault::DropPublishResponses => "dropped publish responses",
        DevFault::LoseDeliveryResponses => "lost delivery responses",
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Relay(i) => write!(f, "relay {i}"),
            Target::Consumer(s) => write!(f, "consumer of {}", label(*s)),
            Target::Callback => write!(f, "callback receiver"),
        }
    }
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(t) = self.topic {
            parts.push(format!("--topic {}", TOPICS[t].name()));
        }
        if let Some(s) = self.subscriber {
            parts.push(format!("--subscriber {}", label(s)));
        }
        if let Some(k) = self.key {
            parts.push(format!("--key k{k}"));
        }
        if self.poison {
            parts.push("--error poison".into());
        }
        write!(f, "{}", parts.join(" "))
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Traffic {
                rate,
                poison,
                delayed,
            } => write!(
                f,
                "traffic {rate:.0}/s (poison {:.0} %, delayed {:.0} %)",
                poison * 100.0,
                delayed * 100.0
            ),
            Op::Kill(t) => write!(f, "SIGKILL {t}"),
            Op::Down { target, secs } => write!(f, "SIGKILL {target}, down {secs:.1} s"),
            Op::Slow { sub, secs, ms } => {
                write!(
                    f,
                    "consumer of {} slow ({ms} ms/event) {secs:.1} s",
                    label(*sub)
                )
            }
            Op::Dev { fault, secs } => {
                write!(f, "dev server: {} {secs:.1} s", dev_fault_name(*fault))
            }
            Op::Backends { relays } => write!(
                f,
                "pg_terminate_backend of the {}",
                if *relays { "relays" } else { "receivers" }
            ),
            Op::LongTransaction { secs, topic } => {
                write!(
                    f,
                    "long producer transaction on {} {secs:.1} s",
                    TOPICS[*topic].name()
                )
            }
            Op::CrashDuring {
                action,
                after_ms,
                down_secs,
            } => write!(
                f,
                "{action}, Postgres crashed {after_ms} ms into it (down {down_secs:.1} s)"
            ),
            Op::PgCrash { down_secs } => {
                write!(
                    f,
                    "postgres crash (stop -m immediate), down {down_secs:.1} s"
                )
            }
            Op::Add {
                topic,
                sub,
                from,
                replay,
            } => {
                write!(
                    f,
                    "subscribers add {} {}",
                    TOPICS[*topic].name(),
                    label(*sub)
                )?;
                match from {
                    From::Now => Ok(()),
                    From::Back { secs } => write!(f, " --from {secs}s-ago"),
                    From::BeforeRemoval { secs } => write!(f, " --from {secs}s-before-its-removal"),
                }?;
                match (from, replay) {
                    (From::Now, _) | (_, ReplayMode::Whole) => Ok(()),
                    (_, ReplayMode::Interrupted { chunks }) => {
                        write!(f, " (interrupted after {chunks} chunks)")
                    }
                }
            }
            Op::Remove { topic, sub } => {
                write!(
                    f,
                    "subscribers remove {} {}",
                    TOPICS[*topic].name(),
                    label(*sub)
                )
            }
            Op::Resume { topic, sub } => {
                write!(
                    f,
                    "subscribers replay {} {}",
                    TOPICS[*topic].name(),
                    label(*sub)
                )
            }
            Op::Cure => write!(f, "cure the poison written so far"),
            Op::Redrive(s) => write!(f, "dead-letters redrive {s}"),
            Op::Purge {
                selection,
                handled_only,
            } => write!(
                f,
                "dead-letters purge {selection}{}",
                if *handled_only { " --handled" } else { "" }
            ),
            Op::Prune { retention_secs } => write!(f, "prune --outbox-hours {retention_secs}s"),
            Op::Partitions { retention_secs } => {
                write!(f, "partition maintenance, retention {retention_secs}s")
            }
        }
    }
}
