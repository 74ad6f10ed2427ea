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

mod draw;
mod layout;
mod op;
mod timeline;

pub use layout::{INITIAL, KEYS, RELAYS, SKIP_DEAD_HEADS, SUBSCRIBERS, TOPICS, label};
pub use op::{DevFault, From, Op, ReplayMode, Selection, Target};
pub use timeline::{Schedule, Step};
