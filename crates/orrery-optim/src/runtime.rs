//! The CPU worker pool behind asynchronous preconditioning.
//!
//! A refresh is a pure function of a snapshot (statistics and the basis in use when it was
//! requested), so *which* worker runs it and *when* cannot change its result; only the step at
//! which the optimizer starts using the result can, and that is decided by the optimizer's
//! staleness rule, not here. The pool is a plain `std` channel shared by a few threads: jobs
//! are coarse (an eigendecomposition or QR of a whole matrix), so a lock around the queue is
//! not a bottleneck and no extra dependency is needed.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed set of threads running submitted closures in submission order (per thread).
pub(crate) struct WorkerPool {
    tx: Option<mpsc::Sender<Job>>,
    handles: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("workers", &self.handles.len())
            .finish()
    }
}

impl WorkerPool {
    /// Starts up to `workers` threads (at least one is attempted). If the OS refuses every
    /// thread the pool runs jobs inline in `submit`, which is still correct, only synchronous.
    pub(crate) fn new(workers: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::new();
        for i in 0..workers.max(1) {
            let rx = Arc::clone(&rx);
            let spawned = std::thread::Builder::new()
                .name(format!("orrery-precond-{i}"))
                .spawn(move || loop {
                    // Hold the lock only while taking a job, not while running it.
                    let job = match rx.lock() {
                        Ok(guard) => guard.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return, // sender dropped: the optimizer is gone
                    }
                });
            if let Ok(h) = spawned {
                handles.push(h);
            }
        }
        let tx = if handles.is_empty() { None } else { Some(tx) };
        Self { tx, handles }
    }

    pub(crate) fn workers(&self) -> usize {
        self.handles.len()
    }

    /// Runs `job` on a worker (or inline when there are no workers or they are gone).
    pub(crate) fn submit(&self, job: Job) {
        match &self.tx {
            Some(tx) => {
                if let Err(mpsc::SendError(job)) = tx.send(job) {
                    job();
                }
            }
            None => job(),
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        // Closing the channel ends every worker's loop once the queue is drained.
        self.tx = None;
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// A refresh in flight: the snapshot it works from (kept so that it can be saved, and
/// recomputed if a worker dies) and where its result will appear.
pub(crate) struct Inflight<J, R> {
    /// The optimizer step that requested it (staleness is measured from here).
    pub(crate) requested_at: u64,
    pub(crate) job: Arc<J>,
    slot: Slot<R>,
    compute: fn(&J) -> R,
}

enum Slot<R> {
    Waiting(mpsc::Receiver<R>),
    Ready(Option<R>),
}

impl<J, R> std::fmt::Debug for Inflight<J, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.slot {
            Slot::Waiting(_) => "waiting",
            Slot::Ready(_) => "ready",
        };
        f.debug_struct("Inflight")
            .field("requested_at", &self.requested_at)
            .field("state", &state)
            .finish()
    }
}

impl<J: Send + Sync + 'static, R: Send + 'static> Inflight<J, R> {
    /// Sends `compute(job)` to the pool.
    pub(crate) fn submit(
        pool: &WorkerPool,
        requested_at: u64,
        job: J,
        compute: fn(&J) -> R,
    ) -> Self {
        let job = Arc::new(job);
        let (tx, rx) = mpsc::channel();
        let shared = Arc::clone(&job);
        pool.submit(Box::new(move || {
            // The receiver is gone if the optimizer was dropped or reloaded: nothing to do.
            let _ = tx.send(compute(&shared));
        }));
        Self {
            requested_at,
            job,
            slot: Slot::Waiting(rx),
            compute,
        }
    }

    /// Computes the job now (used when restoring saved state: the job is a pure function, so
    /// the result is the one the worker would have produced).
    pub(crate) fn computed(requested_at: u64, job: J, compute: fn(&J) -> R) -> Self {
        let r = compute(&job);
        Self {
            requested_at,
            job: Arc::new(job),
            slot: Slot::Ready(Some(r)),
            compute,
        }
    }

    /// Blocks until the result is there; returns it with the seconds spent waiting.
    pub(crate) fn wait(self) -> (R, f64) {
        match self.slot {
            Slot::Ready(Some(r)) => (r, 0.0),
            Slot::Ready(None) => ((self.compute)(&self.job), 0.0),
            Slot::Waiting(rx) => {
                // The clock is read only to report the wait; it never influences the math.
                let t0 = std::time::Instant::now();
                // A worker that died without answering: compute it here instead.
                let r = rx.recv().unwrap_or_else(|_| (self.compute)(&self.job));
                (r, t0.elapsed().as_secs_f64())
            }
        }
    }

    /// The result if it is finished, without blocking. After `Some`, drop the `Inflight`.
    pub(crate) fn poll(&mut self) -> Option<R> {
        match &mut self.slot {
            Slot::Ready(r) => r.take().or_else(|| Some((self.compute)(&self.job))),
            Slot::Waiting(rx) => match rx.try_recv() {
                Ok(r) => Some(r),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => Some((self.compute)(&self.job)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pool_runs_every_job() {
        let pool = WorkerPool::new(3);
        let (tx, rx) = mpsc::channel();
        for i in 0..20u64 {
            let tx = tx.clone();
            pool.submit(Box::new(move || tx.send(i * i).unwrap()));
        }
        drop(tx);
        let mut got: Vec<u64> = rx.iter().collect();
        got.sort_unstable();
        assert_eq!(got, (0..20u64).map(|i| i * i).collect::<Vec<_>>());
    }
}
