//! The operator's entry points: one action of the schedule run ([`Operator::run`]), what is left to finish tried
//! again ([`Operator::follow_up`]), and everything finished at the end of the run ([`Operator::finish`]).

use std::time::Duration;

use chrono::Utc;

use super::state::{FollowUp, Operator};
use crate::soak::explore::history::Outcome;
use crate::soak::explore::schedule::{From, Op, ReplayMode, TOPICS, label};

impl Operator {
    /// Runs one action of the schedule.
    pub async fn run(&mut self, step: usize, op: &Op) {
        if let Op::CrashDuring {
            action,
            after_ms,
            down_secs,
        } = op
        {
            let what = format!("postgres crash {after_ms} ms into: {action}");
            let (after, down) = (
                Duration::from_millis((*after_ms).into()),
                Duration::from_secs_f64(*down_secs),
            );
            if matches!(**action, Op::Add { from, .. } if from != From::Now) {
                // A replay of a few hundred events takes a hundred milliseconds: the crash comes after its first
                // chunk, so that it lands in the middle of it.
                self.crash_mid_replay = Some((step, what, down));
            } else if !self.crasher.crash(step, what, after, down) {
                tracing::warn!("a crash is under way: the action runs without one");
            }
            Box::pin(self.run(step, action)).await;
            self.crash_mid_replay = None;
            return;
        }
        let start = Utc::now();
        let outcome = match op {
            Op::Add {
                topic,
                sub,
                from,
                replay,
            } => self.add(*topic, *sub, *from, *replay).await,
            Op::Remove { topic, sub } => self.remove(*topic, *sub).await,
            Op::Resume { topic, sub } => {
                self.interrupted.remove(&(*topic, *sub));
                self.follow_ups.remove(&FollowUp::Replay(*topic, *sub));
                self.replay(*topic, *sub, None).await
            }
            Op::Cure => self.cure().await,
            Op::Redrive(sel) => self.redrive(sel).await,
            Op::Purge {
                selection,
                handled_only,
            } => self.purge(selection, *handled_only).await,
            Op::Prune { retention_secs } => self.prune(*retention_secs, false).await,
            Op::Partitions { retention_secs } => self.prune(*retention_secs, true).await,
            _ => Outcome::Refused("not an operator action".into()),
        };
        self.record(Some(step), op.to_string(), op.kind(), start, outcome);
    }

    /// Tries what is left to finish once (the operator running the command again).
    pub async fn follow_up(&mut self) {
        for f in std::mem::take(&mut self.follow_ups) {
            let start = Utc::now();
            let (what, outcome) = match f {
                FollowUp::Replay(t, s) => (
                    format!(
                        "subscribers replay {} {} (again)",
                        TOPICS[t].name(),
                        label(s)
                    ),
                    self.replay(t, s, None).await,
                ),
                FollowUp::Remove(t, s) => (
                    format!(
                        "subscribers remove {} {} (again)",
                        TOPICS[t].name(),
                        label(s)
                    ),
                    self.finish_removal(t, s).await,
                ),
                FollowUp::Add(t, s, since) => (
                    format!(
                        "subscribers add {} {}{} (again)",
                        TOPICS[t].name(),
                        label(s),
                        since.map_or(String::new(), |at| format!(" --from {at}"))
                    ),
                    self.add_since(t, s, since, ReplayMode::Whole).await,
                ),
            };
            let kind = match f {
                FollowUp::Replay(..) => "replay (resume)",
                FollowUp::Remove(..) => "remove",
                FollowUp::Add(..) => "add (again)",
            };
            self.record(None, what, kind.into(), start, outcome);
        }
    }

    /// Finishes everything: interrupted replays resumed, held-up replays and removals run again, until none is
    /// left or `within` has passed; stops the console. Returns what is still unfinished.
    pub async fn finish(&mut self, within: Duration) -> Vec<String> {
        for (t, s) in std::mem::take(&mut self.interrupted) {
            self.follow_ups.insert(FollowUp::Replay(t, s));
        }
        let until = std::time::Instant::now() + within;
        while !self.follow_ups.is_empty() && std::time::Instant::now() < until {
            self.follow_up().await;
            if !self.follow_ups.is_empty() {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        if let Some(console) = self.console.take()
            && let Err(e) = console.stop().await
        {
            tracing::warn!(error = %e, "stopping the console");
        }
        self.follow_ups.iter().map(|f| format!("{f:?}")).collect()
    }
}
