//! Steps 2 and 3 of a cycle as a pipeline (decision record 0018): each `/v2/batch` request is settled as soon as
//! QStash answers it, while the cycle's other requests are still in flight, in statements of whole messages of
//! at most [`SETTLE_PIECE_ROWS`] rows.
//!
//! Why: a settle statement holds the row locks of every row it changes until it commits, and the consumer's
//! delivery evidence for an ordered run updates the same rows (and the key's row). Settled in one statement after
//! the last request (a claim of 500 keys × 20 events is 10,000 rows, ~1.8 s under load), the evidence of every
//! run of the claim waited for the slowest part of the claim, and claims, publishes, deliveries and evidence ran
//! in lock-step. In pieces, a run's evidence waits at most for its own piece, and the key can be claimed again
//! while the rest of its claim is still being settled.
//!
//! Nothing the guarantees rest on changes: every piece is the same fenced settle statement ([`super::settle`]),
//! committed on its own (autocommit, no lock kept across a network round trip); a message's events are always in
//! one piece (the key's state follows its head and its last event); what is not published this cycle (left over,
//! exhausted, held back) is settled first, while the requests are out. A relay that dies between pieces leaves
//! the unsettled rows under their lease, exactly as a relay that died before its one settle did.

use futures::stream::{FuturesUnordered, StreamExt};

use super::claim::ClaimedEvent;
use super::decide::log_dead_letters;
use super::forming::{Formed, Outgoing};
use super::published::{Published, PublishedEvent};
use super::settle::{SettleCounts, SettleItem, Settlement};
use super::triage::Triage;
use super::{Relay, RelayError};

/// The most rows one settle statement of the pipeline changes (a message larger than this is settled alone, in
/// one statement). Small enough that a delivery's evidence waits a few milliseconds for a piece, not for the
/// claim; large enough that an unordered claim of 500 is still one statement per request.
pub const SETTLE_PIECE_ROWS: usize = 500;

/// Cuts a list of messages (`sizes[i]` events each, in order) into pieces of consecutive whole messages of at
/// most `max_rows` events (a larger message is a piece of its own): the number of messages in each piece.
pub fn pieces(sizes: &[usize], max_rows: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let (mut messages, mut rows) = (0usize, 0usize);
    for &n in sizes {
        if messages > 0 && rows + n > max_rows {
            out.push(messages);
            messages = 0;
            rows = 0;
        }
        messages += 1;
        rows += n;
    }
    if messages > 0 {
        out.push(messages);
    }
    out
}

/// One answered request: its messages (with the single-event messages of a refused batch, and the ordered
/// followers those leave over) and what QStash said, per event of the claim.
struct Answered {
    formed: Formed,
    published: Published,
}

impl Published {
    /// Nothing published yet for `n` events (each [`super::publish::Reach::NotSent`]).
    fn none(n: usize) -> Published {
        Published::assemble(n, &Formed::default(), Default::default())
    }

    /// Takes in one request's answer about the events `which`.
    fn merge(&mut self, other: Published, which: &[usize]) {
        let mut events: Vec<Option<PublishedEvent>> = other.events.into_iter().map(Some).collect();
        for &i in which {
            if let Some(e) = events[i].take() {
                self.events[i] = e;
            }
        }
        self.requests_ok += other.requests_ok;
        self.requests_failed += other.requests_failed;
        self.latencies.extend(other.latencies);
        self.messages.extend(other.messages);
    }
}

impl Relay {
    /// Steps 2 and 3 of a cycle (see the module docs): publishes the claim's messages in `/v2/batch` requests run
    /// concurrently and settles each request's events in pieces as soon as it is answered. Returns what
    /// publishing found (as [`Relay::publish_classified`] would) and the rows the settles changed.
    pub(super) async fn publish_and_settle(
        &self,
        triage: &Triage,
    ) -> Result<(Published, SettleCounts), RelayError> {
        let events = &triage.publish;
        let mut formed = self.messages_for(events);
        let chunk = self.qstash.batch_size.max(1) as usize;
        let mut requests: Vec<Vec<Outgoing>> = Vec::new();
        let mut messages = std::mem::take(&mut formed.messages).into_iter().peekable();
        while messages.peek().is_some() {
            requests.push(messages.by_ref().take(chunk).collect());
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Answered>();
        let publishing = async move {
            let mut out: FuturesUnordered<_> = requests
                .into_iter()
                .map(|messages| self.publish_request(events, messages))
                .collect();
            while let Some(answered) = out.next().await {
                // The settler stops at its first error: the remaining answers are then left unsettled (their
                // leases expire), as a failed settle always left them.
                let _ = tx.send(answered);
            }
        };
        let settling = async {
            let mut counts = SettleCounts::default();
            // What is not published this cycle first, while the requests are out.
            let mut unpublished: Vec<SettleItem> = formed
                .left_over
                .iter()
                .map(|&i| SettleItem {
                    id: events[i].id,
                    lease_token: events[i].lease_token,
                    settlement: Settlement::Release,
                })
                .collect();
            let first = self.decider().settle_unpublished(triage);
            log_dead_letters(
                &first,
                triage
                    .exhausted
                    .iter()
                    .chain(&triage.held_back)
                    .chain(&triage.orphans),
            );
            unpublished.extend(first);
            let singles = vec![1; unpublished.len()];
            counts.add(self.settle_in_pieces(&unpublished, &singles).await?);
            let mut published = Published::none(events.len());
            while let Some(answered) = rx.recv().await {
                let (which, sizes) = answered.events();
                let items = self
                    .decider()
                    .settle_published(events, &answered.published, &which);
                log_dead_letters(&items, which.iter().map(|&i| &events[i]));
                counts.add(self.settle_in_pieces(&items, &sizes).await?);
                published.merge(answered.published, &which);
            }
            Ok::<_, RelayError>((published, counts))
        };
        let ((), settled) = futures::join!(publishing, settling);
        settled
    }

    /// One `/v2/batch` request of `messages`, with the fallback for a refused message of several events
    /// ([`Relay::publish_classified`]).
    async fn publish_request(&self, events: &[ClaimedEvent], messages: Vec<Outgoing>) -> Answered {
        let formed = Formed {
            messages,
            left_over: Vec::new(),
        };
        let sent = self.send_request(events, &formed.messages).await;
        let (formed, published) = self.with_single_fallback(events, formed, sent).await;
        Answered { formed, published }
    }

    /// Settles `items` (whole messages of `sizes[i]` items each, in order) in pieces of at most
    /// [`SETTLE_PIECE_ROWS`] rows, one committed statement each.
    async fn settle_in_pieces(
        &self,
        items: &[SettleItem],
        sizes: &[usize],
    ) -> Result<SettleCounts, RelayError> {
        let mut counts = SettleCounts::default();
        let mut start = 0usize;
        let mut message = 0usize;
        for n in pieces(sizes, SETTLE_PIECE_ROWS) {
            let rows: usize = sizes[message..message + n].iter().sum();
            counts.add(self.settle(&items[start..start + rows]).await?);
            start += rows;
            message += n;
        }
        Ok(counts)
    }
}

impl Answered {
    /// The events this answer settles (indexes into the claim), message by message, then the followers left
    /// over; and how many events each of those messages (or left-over follower) holds.
    fn events(&self) -> (Vec<usize>, Vec<usize>) {
        let mut which = Vec::new();
        let mut sizes = Vec::new();
        for m in self.formed.messages.iter().filter(|m| !m.events.is_empty()) {
            which.extend_from_slice(&m.events);
            sizes.push(m.events.len());
        }
        which.extend_from_slice(&self.formed.left_over);
        sizes.extend(std::iter::repeat_n(1, self.formed.left_over.len()));
        (which, sizes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_keep_messages_whole_and_under_the_limit() {
        assert_eq!(pieces(&[], 500), Vec::<usize>::new());
        assert_eq!(pieces(&[20; 50], 500), vec![25, 25]);
        assert_eq!(pieces(&[1; 500], 500), vec![500]);
        assert_eq!(pieces(&[1; 501], 500), vec![500, 1]);
        // A message larger than the limit is a piece of its own; its neighbours are not added to it.
        assert_eq!(pieces(&[3, 900, 2], 500), vec![1, 1, 1]);
        assert_eq!(pieces(&[250, 250, 1], 500), vec![2, 1]);
    }
}
