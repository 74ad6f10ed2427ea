//! The dead-letter pages: filters, the groups by normalised error, the list, one dead letter, and the guarded
//! actions — redrive one; bulk redrive and purge only with a filter, after a confirmation page that shows how many
//! they will touch (and fixes the selection to the dead letters counted), with a report afterwards. Every action
//! is recorded in the action log with who took it: before it runs, then completed with what it did.
//!
//! | Rule | Why |
//! |---|---|
//! | Every field of [`Filter`](outbox::dead_letters::Filter) travels in every link, form and confirmation ([`filter::params_of`], [`filter::filter_form`] and [`filter::describe`] are made from one list of its fields, [`filter::parts`], which takes the filter apart field by field: a new field does not compile until it is carried) | An action never widens: what the list shows is what the confirmation counts and what the action touches |
//! | The action log row is written before the action, and completed after it, also when it fails | A failure half-way leaves a record of what was started and done |

mod audit;
mod bulk;
mod filter;
mod list;
mod show;

pub use bulk::{bulk, confirm};
pub use list::list;
pub use show::{redrive_one, show};
