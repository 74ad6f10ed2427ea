//! The queue of ready deliveries between the core and the worker pool.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;

use crate::core::Job;

/// Multi-producer, multi-consumer queue of ready deliveries.
pub(crate) struct JobQueue {
    q: Mutex<VecDeque<Job>>,
    ready: Semaphore,
    in_flight: AtomicUsize,
}

impl JobQueue {
    pub fn new() -> JobQueue {
        JobQueue {
            q: Mutex::new(VecDeque::new()),
            ready: Semaphore::new(0),
            in_flight: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Job>> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn push_all(&self, jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let n = jobs.len();
        self.lock().extend(jobs);
        self.ready.add_permits(n);
    }

    /// Waits for a job; the job counts as in flight until [`JobQueue::finish`].
    pub async fn pop(&self) -> Option<Job> {
        let permit = self.ready.acquire().await.ok()?;
        permit.forget();
        let mut q = self.lock();
        let job = q.pop_front();
        if job.is_some() {
            self.in_flight.fetch_add(1, Ordering::SeqCst);
        }
        job
    }

    pub fn finish(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    /// (queued, in flight).
    pub fn load(&self) -> (usize, usize) {
        let q = self.lock();
        (q.len(), self.in_flight.load(Ordering::SeqCst))
    }

    pub fn clear(&self) {
        let mut q = self.lock();
        let n = q.len();
        q.clear();
        // Take back the permits of the dropped jobs (never blocks: they exist).
        if let Ok(p) = self
            .ready
            .try_acquire_many(u32::try_from(n).unwrap_or(u32::MAX))
        {
            p.forget();
        }
    }
}
