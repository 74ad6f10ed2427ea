//! The timeline a seed draws ([`Schedule::draw`]): traffic phases, faults and operator actions at fixed offsets
//! from the start. Drawn in full before anything runs, from the seed alone (a model of which subscriber is on
//! which topic stands in for the run's state), so the same seed prints and runs the same schedule; only the
//! interleaving with the processes' own timing varies.
//!
//! | Rule | Why |
//! |---|---|
//! | Drawn ahead, from a model, never from what the run observed | The seed alone names the schedule: a failing seed is a regression case by itself |
//! | Faults and actions are Poisson arrivals over the whole length; traffic stops at 85 % of it | The last stretch is a drain under faults (a Postgres crash while the relays catch up) |
//! | A removal is often followed within seconds by the same subscriber added again from before it | The lifecycle defects sit where a removal's in-flight copies meet a replay |
//! | An action is sometimes run with a Postgres crash 0–150 ms into it | A crash during a replay, a partition drop, a removal |
//! | Poison is curable (`soak_control.cured`), and redrives mostly follow a cure | Redrives then succeed, and a lane blocked by a dead head can move again |
//! | A window of lost messages is sometimes given a redrive inside it | A dead letter of a lost message, redriven, is lost again |

use std::fmt;
use std::time::Duration;

use outbox::Topic;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// The explorer's topics: an ordered one whose dead heads block their lane, an ordered one whose dead heads are
/// skipped (`RELAY_SKIP_DEAD_HEAD_TOPICS`), two unordered ones.
pub static TOPICS: [Topic; 4] = [
    Topic::ordered("x.ordered"),
    Topic::ordered("x.ordered.skip"),
    Topic::unordered("x.unordered"),
    Topic::unordered("x.unordered.2"),
];

/// Index in [`TOPICS`] of the ordered topic whose dead heads are skipped.
pub const SKIP_DEAD_HEADS: usize = 1;

/// The subscribers (stored names): the default one (`""`, the relays' `CONSUMER_URL`) and three named ones. Each
/// has a consumer process of its own for the whole run, subscribed or not.
pub const SUBSCRIBERS: [&str; 4] = ["", "s1", "s2", "s3"];

/// Partition keys per topic.
pub const KEYS: u32 = 12;

/// Who is subscribed to what at the start (`[topic][subscriber]`): the default subscriber everywhere, `s1` on
/// every topic, `s2` on the first ordered and the first unordered topic, `s3` nowhere.
pub const INITIAL: [[bool; 4]; 4] = [
    [true, true, true, false],
    [true, true, false, false],
    [true, true, true, false],
    [true, true, false, false],
];

/// The label of subscriber `i` as the CLI shows it.
pub fn label(sub: usize) -> &'static str {
    match SUBSCRIBERS[sub] {
        "" => "default",
        s => s,
    }
}

/// A seeded timeline of traffic, faults and operator actions.
#[derive(Debug, Clone, Serialize)]
pub struct Schedule {
    pub seed: u64,
    /// Its length; traffic stops at 85 % of it, faults and actions go on to the end.
    pub length: Duration,
    /// In time order.
    pub steps: Vec<Step>,
}

/// One operation at its offset from the start.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    #[serde(serialize_with = "secs")]
    pub at: Duration,
    pub op: Op,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// A worker process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Target {
    /// Relay process `i`.
    Relay(usize),
    /// The consumer of subscriber `i` ([`SUBSCRIBERS`]).
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

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "schedule: seed {}, {:.0} s, {} steps",
            self.seed,
            self.length.as_secs_f64(),
            self.steps.len()
        )?;
        for s in &self.steps {
            writeln!(f, "  {:>7.2}s  {}", s.at.as_secs_f64(), s.op)?;
        }
        Ok(())
    }
}

/// Relay processes of a run.
pub const RELAYS: usize = 2;

/// The share of the length with traffic.
const TRAFFIC_SHARE: f64 = 0.85;
/// Mean seconds between two faults.
const FAULT_EVERY: f64 = 3.0;
/// Mean seconds between two operator actions.
const ACTION_EVERY: f64 = 4.0;

/// The draw's model of the run: who is subscribed, whose replay waits for a resume.
struct Model {
    subscribed: [[bool; 4]; 4],
    interrupted: Vec<(usize, usize)>,
}

impl Schedule {
    /// The schedule of `seed` over `length`.
    pub fn draw(seed: u64, length: Duration) -> Schedule {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5c4e_d01e);
        let total = length.as_secs_f64();
        let mut steps = Vec::new();
        let at = |t: f64, op: Op, steps: &mut Vec<Step>| {
            steps.push(Step {
                at: Duration::from_secs_f64(t.clamp(0.0, total)),
                op,
            })
        };

        // Traffic phases: quiet, steady, bursts.
        let traffic_end = total * TRAFFIC_SHARE;
        let mut t = 0.0;
        while t < traffic_end {
            let roll = rng.random_range(0..100u32);
            let (rate, len) = match roll {
                0..15 => (rng.random_range(0.0..3.0), rng.random_range(3.0..10.0)),
                15..75 => (rng.random_range(10.0..40.0), rng.random_range(5.0..20.0)),
                _ => (rng.random_range(60.0..120.0), rng.random_range(2.0..6.0)),
            };
            let op = Op::Traffic {
                rate,
                poison: rng.random_range(0.0..0.04),
                delayed: rng.random_range(0.0..0.05),
            };
            at(t, op, &mut steps);
            t += len;
        }
        at(
            traffic_end,
            Op::Traffic {
                rate: 0.0,
                poison: 0.0,
                delayed: 0.0,
            },
            &mut steps,
        );

        // Faults.
        let mut t = rng.random_range(1.0..2.0 * FAULT_EVERY);
        while t < total {
            let op = draw_fault(&mut rng);
            // Sometimes a redrive while messages are being lost: a dead letter of a lost message, redriven, is
            // lost again.
            if let Op::Dev {
                fault: DevFault::LoseMessages,
                secs,
            } = op
                && rng.random_bool(0.5)
            {
                let redrive = Op::Redrive(Selection {
                    topic: Some(rng.random_range(0..TOPICS.len())),
                    subscriber: None,
                    key: None,
                    poison: false,
                });
                at(t + rng.random_range(0.0..secs), redrive, &mut steps);
            }
            at(t, op, &mut steps);
            t += exponential(&mut rng, FAULT_EVERY);
        }

        // Operator actions, over the model.
        let mut model = Model {
            subscribed: INITIAL,
            interrupted: Vec::new(),
        };
        let mut t = rng.random_range(2.0..2.0 * ACTION_EVERY);
        while t < total - 2.0 {
            let mut ops = draw_action(&mut rng, &mut model);
            // Sometimes a Postgres crash in the middle of the action: its replay, its partition drop, …
            if rng.random_bool(0.04) {
                let dt: f64 = rng.random_range(0.1..1.5);
                let down_secs = rng.random_range(0.5..4.0);
                match ops.first_mut() {
                    Some((_, op)) => {
                        *op = Op::CrashDuring {
                            action: Box::new(op.clone()),
                            after_ms: ((dt - 0.1) / 1.4 * 150.0) as u32,
                            down_secs,
                        }
                    }
                    None => ops.push((dt, Op::PgCrash { down_secs })),
                }
            }
            for (dt, op) in ops {
                at(t + dt, op, &mut steps);
            }
            t += exponential(&mut rng, ACTION_EVERY);
        }
        steps.sort_by_key(|a| a.at);
        Schedule {
            seed,
            length,
            steps,
        }
    }

    /// How many steps of each kind.
    pub fn counts(&self) -> std::collections::BTreeMap<String, u64> {
        let mut m = std::collections::BTreeMap::new();
        for s in &self.steps {
            *m.entry(s.op.kind()).or_default() += 1;
        }
        m
    }
}

fn exponential(rng: &mut StdRng, mean: f64) -> f64 {
    -mean * (1.0 - rng.random::<f64>()).ln()
}

fn draw_target(rng: &mut StdRng) -> Target {
    match rng.random_range(0..9u32) {
        0..4 => Target::Relay(rng.random_range(0..RELAYS)),
        4..8 => Target::Consumer(rng.random_range(0..SUBSCRIBERS.len())),
        _ => Target::Callback,
    }
}

fn draw_fault(rng: &mut StdRng) -> Op {
    match rng.random_range(0..20u32) {
        0..6 => Op::Kill(draw_target(rng)),
        6 | 7 => Op::Down {
            target: if rng.random_bool(0.6) {
                Target::Consumer(rng.random_range(0..SUBSCRIBERS.len()))
            } else {
                Target::Callback
            },
            secs: rng.random_range(2.0..15.0),
        },
        8 => Op::Slow {
            sub: rng.random_range(0..SUBSCRIBERS.len()),
            secs: rng.random_range(3.0..15.0),
            ms: rng.random_range(20..300),
        },
        9..13 => Op::Dev {
            fault: match rng.random_range(0..4u32) {
                0 => DevFault::Outage,
                1 => DevFault::LoseMessages,
                2 => DevFault::DropPublishResponses,
                _ => DevFault::LoseDeliveryResponses,
            },
            secs: rng.random_range(2.0..12.0),
        },
        13..16 => Op::Backends {
            relays: rng.random_bool(0.5),
        },
        16..19 => Op::LongTransaction {
            secs: rng.random_range(2.0..20.0),
            topic: rng.random_range(0..TOPICS.len()),
        },
        _ => Op::PgCrash {
            down_secs: rng.random_range(0.5..4.0),
        },
    }
}

fn draw_selection(rng: &mut StdRng) -> Selection {
    loop {
        let s = Selection {
            topic: rng
                .random_bool(0.5)
                .then(|| rng.random_range(0..TOPICS.len())),
            subscriber: rng
                .random_bool(0.5)
                .then(|| rng.random_range(0..SUBSCRIBERS.len())),
            key: rng.random_bool(0.2).then(|| rng.random_range(0..KEYS)),
            poison: rng.random_bool(0.4),
        };
        if s.topic.is_some() || s.subscriber.is_some() || s.key.is_some() || s.poison {
            return s;
        }
    }
}

/// One operator action (and what follows it closely), with offsets from its time, applied to the model.
fn draw_action(rng: &mut StdRng, m: &mut Model) -> Vec<(f64, Op)> {
    let roll = rng.random_range(0..22u32);
    match roll {
        // Add a subscriber that is not on a topic.
        0..5 => {
            let free: Vec<(usize, usize)> = pairs(|t, s| s > 0 && !m.subscribed[t][s]);
            let Some(&(topic, sub)) = pick(rng, &free) else {
                return Vec::new();
            };
            m.subscribed[topic][sub] = true;
            let from = match rng.random_range(0..3u32) {
                0 => From::Now,
                _ => From::Back {
                    secs: rng.random_range(5..60),
                },
            };
            let replay = if from != From::Now && rng.random_bool(0.3) {
                m.interrupted.push((topic, sub));
                ReplayMode::Interrupted {
                    chunks: rng.random_range(1..4),
                }
            } else {
                ReplayMode::Whole
            };
            vec![(
                0.0,
                Op::Add {
                    topic,
                    sub,
                    from,
                    replay,
                },
            )]
        }
        // Remove a named subscriber (the default one stays); often add it again from before the removal.
        5..9 => {
            let on: Vec<(usize, usize)> = pairs(|t, s| s > 0 && m.subscribed[t][s]);
            let Some(&(topic, sub)) = pick(rng, &on) else {
                return Vec::new();
            };
            m.subscribed[topic][sub] = false;
            m.interrupted.retain(|p| *p != (topic, sub));
            let mut ops = vec![(0.0, Op::Remove { topic, sub })];
            if rng.random_bool(0.5) {
                m.subscribed[topic][sub] = true;
                let from = if rng.random_bool(0.75) {
                    From::BeforeRemoval {
                        secs: rng.random_range(1..20),
                    }
                } else {
                    From::Now
                };
                ops.push((
                    rng.random_range(0.5..6.0),
                    Op::Add {
                        topic,
                        sub,
                        from,
                        replay: ReplayMode::Whole,
                    },
                ));
            }
            ops
        }
        9 | 10 => match m.interrupted.is_empty() {
            true => Vec::new(),
            false => {
                let (topic, sub) = m
                    .interrupted
                    .remove(rng.random_range(0..m.interrupted.len()));
                vec![(0.0, Op::Resume { topic, sub })]
            }
        },
        11 | 12 => {
            let mut ops = vec![(0.0, Op::Cure)];
            if rng.random_bool(0.7) {
                ops.push((rng.random_range(0.2..3.0), Op::Redrive(draw_selection(rng))));
            }
            ops
        }
        13..16 => vec![(0.0, Op::Redrive(draw_selection(rng)))],
        16 | 17 => vec![(
            0.0,
            Op::Purge {
                selection: draw_selection(rng),
                handled_only: rng.random_bool(0.5),
            },
        )],
        18 | 19 => vec![(
            0.0,
            Op::Prune {
                retention_secs: rng.random_range(10..90),
            },
        )],
        _ => vec![(
            0.0,
            Op::Partitions {
                retention_secs: rng.random_range(10..90),
            },
        )],
    }
}

fn pairs(keep: impl Fn(usize, usize) -> bool) -> Vec<(usize, usize)> {
    (0..TOPICS.len())
        .flat_map(|t| (0..SUBSCRIBERS.len()).map(move |s| (t, s)))
        .filter(|&(t, s)| keep(t, s))
        .collect()
}

fn pick<'a, T>(rng: &mut StdRng, v: &'a [T]) -> Option<&'a T> {
    (!v.is_empty()).then(|| &v[rng.random_range(0..v.len())])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_schedule_and_another_seed_another() {
        let a = Schedule::draw(42, Duration::from_secs(120)).to_string();
        assert_eq!(a, Schedule::draw(42, Duration::from_secs(120)).to_string());
        assert_ne!(a, Schedule::draw(43, Duration::from_secs(120)).to_string());
    }

    #[test]
    fn a_schedule_mixes_traffic_faults_and_actions_within_its_length() {
        let s = Schedule::draw(7, Duration::from_secs(180));
        assert!(s.steps.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(s.steps.iter().all(|st| st.at <= s.length));
        let counts = s.counts();
        for kind in ["traffic", "add", "remove", "postgres crash"] {
            assert!(counts.contains_key(kind), "{kind} missing: {counts:?}");
        }
        assert!(s.steps.iter().filter(|st| st.op.is_action()).count() > 20);
    }
}
