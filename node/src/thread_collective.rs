//! Collective among the worker threads of one process (CPU-only nodes), shaped by a link model.
//!
//! This module owns [`ThreadCollective`], the [`Collective`] backend for workers that are
//! threads of one process. Submissions go into a shared table keyed by [`ReduceKey`]; the
//! last rank to arrive for a key sums the contributions in rank order (so the mean is
//! deterministic and bit-identical on every rank), divides by the world size, and
//! publishes the result.
//!
//! Wall-clock completion is shaped by a [`LinkModel`] treated as one shared FIFO link:
//! `done_at = max(link_free_at, last_arrival) + ring_allreduce_seconds(bytes)` and then
//! `link_free_at = done_at`. Waiters block until the result exists and then until
//! `done_at`, so a bucket launched early in backward overlaps with the rest of backward in
//! wall-clock time, and buckets launched back to back queue behind each other. This is a
//! real-time shell (it uses `Instant` and sleeps); the simulator models links separately.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::collective::{Collective, CollectiveError, PendingReduce, ReduceHandle, ReduceKey};
use crate::link::LinkModel;

/// All-reduce among the worker threads of one process, delayed as if it ran over `link`.
///
/// Share it between workers behind an `Arc`. Dropping the last owner shuts it down, so
/// handles still pending return [`CollectiveError::PeerGone`].
pub struct ThreadCollective {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ThreadCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadCollective")
            .field("world", &self.shared.world)
            .field("link", &self.shared.link)
            .field("timeout", &self.shared.timeout)
            .finish_non_exhaustive()
    }
}

/// State shared by the collective and every handle it gave out.
struct Shared {
    world: usize,
    link: LinkModel,
    /// How long a waiter waits for its peers to submit; `None` waits forever (until
    /// shutdown).
    timeout: Option<Duration>,
    state: Mutex<TableState>,
    /// Notified whenever an operation's outcome is published or the collective shuts
    /// down.
    changed: Condvar,
}

struct TableState {
    operations: HashMap<ReduceKey, Operation>,
    /// When the shared link finishes the last operation reserved on it.
    link_free_at: Option<Instant>,
    bytes_sent: Vec<u64>,
    /// Set by `shutdown`; the first reason wins.
    shut_down: Option<String>,
}

/// One all-reduce in progress.
struct Operation {
    /// Per-rank contributions, indexed by rank; emptied once the reduction starts.
    contributions: Vec<Option<Vec<f32>>>,
    /// Which ranks have submitted.
    submitted: Vec<bool>,
    submitted_count: usize,
    /// Length of the first submission; every other submission must match.
    len: usize,
    /// Which ranks have collected (waited on or dropped) their handle.
    collected: Vec<bool>,
    collected_count: usize,
    outcome: Option<Result<Published, CollectiveError>>,
}

/// A completed reduction, visible to waiters from `done_at` on.
struct Published {
    mean: Arc<Vec<f32>>,
    done_at: Instant,
}

impl Operation {
    fn new(world: usize, len: usize) -> Self {
        Self {
            contributions: (0..world).map(|_| None).collect(),
            submitted: vec![false; world],
            submitted_count: 0,
            len,
            collected: vec![false; world],
            collected_count: 0,
            outcome: None,
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, TableState> {
        // No critical section leaves the table inconsistent when it unwinds, so a poisoned
        // lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn peer_gone(reason: &str) -> CollectiveError {
        CollectiveError::PeerGone {
            reason: reason.to_string(),
        }
    }

    /// Marks `rank`'s handle for `key` as collected and removes the operation once every
    /// rank has submitted and collected. Returns the removed operation, if any.
    fn collect(&self, state: &mut TableState, key: ReduceKey, rank: usize) -> Option<Operation> {
        let operation = state.operations.get_mut(&key)?;
        if !operation.collected[rank] {
            operation.collected[rank] = true;
            operation.collected_count += 1;
        }
        if operation.collected_count == self.world && operation.submitted_count == self.world {
            state.operations.remove(&key)
        } else {
            None
        }
    }

    /// Sums `contributions` in rank order into the first one and divides by the world
    /// size.
    fn mean_in_rank_order(&self, contributions: Vec<Option<Vec<f32>>>) -> Vec<f32> {
        let mut by_rank = contributions.into_iter().map(|contribution| {
            contribution.expect("every rank submitted before the reduction started")
        });
        let mut sum = by_rank.next().expect("world is at least one rank");
        for contribution in by_rank {
            for (total, value) in sum.iter_mut().zip(&contribution) {
                *total += value;
            }
        }
        if self.world > 1 {
            let ranks = self.world as f32;
            for total in &mut sum {
                *total /= ranks;
            }
        }
        sum
    }
}

impl ThreadCollective {
    /// A collective for `world` worker threads whose operations complete no earlier than
    /// a ring all-reduce over `link` would. Waits for peers block until they submit or the
    /// collective shuts down.
    pub fn new(world: usize, link: LinkModel) -> Result<Self, CollectiveError> {
        Self::build(world, link, None)
    }

    /// Like [`ThreadCollective::new`], but waits fail with [`CollectiveError::Timeout`]
    /// when the peers have not all submitted within `timeout` of the wait starting. The
    /// modelled link time after the last submission is not counted against it.
    pub fn with_timeout(
        world: usize,
        link: LinkModel,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        Self::build(world, link, Some(timeout))
    }

    fn build(
        world: usize,
        link: LinkModel,
        timeout: Option<Duration>,
    ) -> Result<Self, CollectiveError> {
        if world == 0 {
            return Err(CollectiveError::EmptyWorld);
        }
        Ok(Self {
            shared: Arc::new(Shared {
                world,
                link,
                timeout,
                state: Mutex::new(TableState {
                    operations: HashMap::new(),
                    link_free_at: None,
                    bytes_sent: vec![0; world],
                    shut_down: None,
                }),
                changed: Condvar::new(),
            }),
        })
    }

    /// The link model operations are shaped by.
    pub fn link(&self) -> LinkModel {
        self.shared.link
    }

    /// Operations submitted by at least one rank whose result not every rank has collected
    /// yet (for leak checks and diagnostics).
    pub fn pending_operations(&self) -> usize {
        self.shared.lock().operations.len()
    }
}

impl Drop for ThreadCollective {
    fn drop(&mut self) {
        self.shutdown("collective dropped");
    }
}

impl Collective for ThreadCollective {
    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_mean(
        &self,
        rank: usize,
        key: ReduceKey,
        data: Vec<f32>,
    ) -> Result<ReduceHandle, CollectiveError> {
        let shared = &self.shared;
        let world = shared.world;
        if rank >= world {
            return Err(CollectiveError::RankOutOfRange { rank, world });
        }
        let mut state = shared.lock();
        if let Some(reason) = &state.shut_down {
            return Err(Shared::peer_gone(reason));
        }
        let operation = state
            .operations
            .entry(key)
            .or_insert_with(|| Operation::new(world, data.len()));
        if operation.submitted[rank] {
            return Err(CollectiveError::DuplicateSubmit { key, rank });
        }
        operation.submitted[rank] = true;
        operation.submitted_count += 1;
        let arrived_at = Instant::now();
        if operation.outcome.is_some() {
            // Already failed: this rank's values are not needed, its wait reports the error.
        } else if data.len() != operation.len {
            operation.outcome = Some(Err(CollectiveError::LengthMismatch {
                key,
                rank,
                expected: operation.len,
                got: data.len(),
            }));
            operation.contributions.iter_mut().for_each(|c| *c = None);
            shared.changed.notify_all();
        } else {
            operation.contributions[rank] = Some(data);
        }

        let handle = ReduceHandle::new(
            key,
            Box::new(ThreadPending {
                shared: Arc::clone(shared),
                key,
                rank,
                collected: false,
            }),
        );
        if operation.submitted_count < world || operation.outcome.is_some() {
            return Ok(handle);
        }

        // Last arrival: reserve the shared FIFO link, then reduce outside the lock.
        let contributions = std::mem::take(&mut operation.contributions);
        let bytes = operation.len * std::mem::size_of::<f32>();
        let seconds = shared.link.ring_allreduce_seconds(bytes, world);
        let start = state
            .link_free_at
            .map_or(arrived_at, |free_at| free_at.max(arrived_at));
        let done_at = Duration::try_from_secs_f64(seconds)
            .ok()
            .and_then(|busy| start.checked_add(busy))
            .unwrap_or(start + Duration::from_secs(365 * 24 * 3600));
        state.link_free_at = Some(done_at);
        let bytes_per_rank = LinkModel::ring_allreduce_bytes_per_rank(bytes, world).round() as u64;
        for sent in &mut state.bytes_sent {
            *sent += bytes_per_rank;
        }
        drop(state);

        let mean = shared.mean_in_rank_order(contributions);

        let mut state = shared.lock();
        if let Some(operation) = state.operations.get_mut(&key) {
            operation.outcome = Some(Ok(Published {
                mean: Arc::new(mean),
                done_at,
            }));
        }
        shared.changed.notify_all();
        Ok(handle)
    }

    fn bytes_sent(&self, rank: usize) -> u64 {
        self.shared
            .lock()
            .bytes_sent
            .get(rank)
            .copied()
            .unwrap_or(0)
    }

    fn name(&self) -> &'static str {
        "thread"
    }

    fn shutdown(&self, reason: &str) {
        let mut state = self.shared.lock();
        if state.shut_down.is_none() {
            state.shut_down = Some(reason.to_string());
        }
        state.operations.clear();
        self.shared.changed.notify_all();
    }
}

/// One rank's pending operation in a [`ThreadCollective`].
struct ThreadPending {
    shared: Arc<Shared>,
    key: ReduceKey,
    rank: usize,
    /// Set once this rank's copy has been handed out, so `Drop` does not collect twice.
    collected: bool,
}

impl PendingReduce for ThreadPending {
    fn is_ready(&self) -> bool {
        let state = self.shared.lock();
        if state.shut_down.is_some() {
            return true;
        }
        match state.operations.get(&self.key).map(|op| &op.outcome) {
            Some(Some(Ok(published))) => Instant::now() >= published.done_at,
            Some(Some(Err(_))) | None => true,
            Some(None) => false,
        }
    }

    fn wait(mut self: Box<Self>) -> Result<Vec<f32>, CollectiveError> {
        let shared = Arc::clone(&self.shared);
        let started = Instant::now();
        let mut state = shared.lock();
        self.collected = true;
        loop {
            if let Some(reason) = &state.shut_down {
                return Err(Shared::peer_gone(reason));
            }
            let Some(operation) = state.operations.get(&self.key) else {
                return Err(Shared::peer_gone("operation vanished from the table"));
            };
            match &operation.outcome {
                Some(Err(error)) => {
                    let error = error.clone();
                    shared.collect(&mut state, self.key, self.rank);
                    return Err(error);
                }
                Some(Ok(published)) => {
                    let now = Instant::now();
                    if now < published.done_at {
                        let remaining = published.done_at - now;
                        state = shared
                            .changed
                            .wait_timeout(state, remaining)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                        continue;
                    }
                    let mean = Arc::clone(&published.mean);
                    let removed = shared.collect(&mut state, self.key, self.rank);
                    drop(state);
                    // The last collector takes the buffer; the others copy it.
                    drop(removed);
                    return Ok(Arc::try_unwrap(mean).unwrap_or_else(|shared| (*shared).clone()));
                }
                None => match shared.timeout {
                    None => {
                        state = shared
                            .changed
                            .wait(state)
                            .unwrap_or_else(PoisonError::into_inner);
                    }
                    Some(timeout) => {
                        let waited = started.elapsed();
                        if waited >= timeout {
                            shared.collect(&mut state, self.key, self.rank);
                            return Err(CollectiveError::Timeout {
                                key: self.key,
                                waited,
                            });
                        }
                        state = shared
                            .changed
                            .wait_timeout(state, timeout - waited)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                },
            }
        }
    }
}

impl Drop for ThreadPending {
    fn drop(&mut self) {
        if !self.collected {
            let mut state = self.shared.lock();
            self.shared.collect(&mut state, self.key, self.rank);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::AbortOnPanic;
    use std::thread;

    /// Rank `rank`'s vector for bucket `bucket`: distinct per rank and bucket, with
    /// fractional values so rounding in the mean is exercised.
    fn contribution(rank: usize, bucket: u32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (rank as f32 + 1.0) * 0.37 + bucket as f32 * 1.5 - i as f32 * 0.013)
            .collect()
    }

    /// The mean computed the documented way: sum in rank order, then divide.
    fn reference_mean(world: usize, bucket: u32, len: usize) -> Vec<f32> {
        let mut sum = contribution(0, bucket, len);
        for rank in 1..world {
            for (total, value) in sum.iter_mut().zip(contribution(rank, bucket, len)) {
                *total += value;
            }
        }
        if world > 1 {
            sum.iter_mut().for_each(|total| *total /= world as f32);
        }
        sum
    }

    fn shaped(bandwidth_bytes_per_s: f64, latency_s: f64) -> LinkModel {
        LinkModel {
            bandwidth_bytes_per_s,
            latency_s,
        }
    }

    #[test]
    fn mean_is_deterministic_and_identical_on_every_rank() {
        const BUCKETS: u32 = 5;
        const LEN: usize = 257;
        for world in 1..=4 {
            let collective = ThreadCollective::new(world, LinkModel::unshaped()).unwrap();
            let results: Vec<Vec<(u32, Vec<f32>)>> = thread::scope(|scope| {
                let workers: Vec<_> = (0..world)
                    .map(|rank| {
                        let collective = &collective;
                        scope.spawn(move || {
                            // Each rank interleaves submissions differently.
                            let mut order: Vec<u32> = (0..BUCKETS).collect();
                            order.rotate_left(rank % BUCKETS as usize);
                            if rank % 2 == 1 {
                                order.reverse();
                            }
                            let handles: Vec<_> = order
                                .iter()
                                .map(|&bucket| {
                                    let key = ReduceKey::new(7, bucket);
                                    let data = contribution(rank, bucket, LEN);
                                    (bucket, collective.all_reduce_mean(rank, key, data).unwrap())
                                })
                                .collect();
                            handles
                                .into_iter()
                                .map(|(bucket, handle)| (bucket, handle.wait().unwrap()))
                                .collect()
                        })
                    })
                    .collect();
                workers.into_iter().map(|w| w.join().unwrap()).collect()
            });
            for (rank, per_bucket) in results.iter().enumerate() {
                assert_eq!(per_bucket.len(), BUCKETS as usize);
                for (bucket, mean) in per_bucket {
                    let expected = reference_mean(world, *bucket, LEN);
                    let same_bits = mean
                        .iter()
                        .zip(&expected)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same_bits, "world {world} rank {rank} bucket {bucket}");
                }
            }
            assert_eq!(collective.pending_operations(), 0, "world {world}");
        }
    }

    #[test]
    fn mean_of_integers_is_exact() {
        let world = 4;
        let collective = ThreadCollective::new(world, LinkModel::unshaped()).unwrap();
        let key = ReduceKey::new(0, 0);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let data = vec![rank as f32 * 4.0, -(rank as f32), 10.0];
                collective.all_reduce_mean(rank, key, data).unwrap()
            })
            .collect();
        for handle in handles {
            assert_eq!(handle.wait().unwrap(), vec![6.0, -1.5, 10.0]);
        }
    }

    #[test]
    fn length_mismatch_is_reported_to_every_waiter() {
        let world = 3;
        let collective = ThreadCollective::new(world, LinkModel::unshaped()).unwrap();
        let key = ReduceKey::new(2, 4);
        let errors: Vec<CollectiveError> = thread::scope(|scope| {
            let workers: Vec<_> = (0..world)
                .map(|rank| {
                    let collective = &collective;
                    scope.spawn(move || {
                        let len = if rank == 1 { 9 } else { 8 };
                        let handle = collective
                            .all_reduce_mean(rank, key, vec![1.0; len])
                            .unwrap();
                        handle.wait().unwrap_err()
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        for error in errors {
            assert!(
                matches!(error, CollectiveError::LengthMismatch { key: k, .. } if k == key),
                "{error:?}"
            );
        }
        assert_eq!(collective.pending_operations(), 0);
        assert_eq!(collective.bytes_sent(0), 0);
    }

    #[test]
    fn length_mismatch_names_both_lengths() {
        let collective = ThreadCollective::new(2, LinkModel::unshaped()).unwrap();
        let key = ReduceKey::new(1, 1);
        let first = collective.all_reduce_mean(0, key, vec![0.0; 5]).unwrap();
        let second = collective.all_reduce_mean(1, key, vec![0.0; 3]).unwrap();
        let expected = CollectiveError::LengthMismatch {
            key,
            rank: 1,
            expected: 5,
            got: 3,
        };
        assert_eq!(first.wait().unwrap_err(), expected);
        assert_eq!(second.wait().unwrap_err(), expected);
    }

    #[test]
    fn shaped_link_delays_completion_by_at_least_the_model() {
        let link = shaped(100e6, 1e-3);
        let world = 4;
        let len = 250_000; // 1 MB of f32
        let collective = ThreadCollective::new(world, link).unwrap();
        let model = Duration::from_secs_f64(link.ring_allreduce_seconds(len * 4, world));
        assert!(model >= Duration::from_millis(20), "{model:?}");
        let key = ReduceKey::new(0, 0);
        let mut handles: Vec<_> = (0..world - 1)
            .map(|rank| {
                collective
                    .all_reduce_mean(rank, key, vec![1.0; len])
                    .unwrap()
            })
            .collect();
        // The operation cannot start before the last rank submits.
        let before_last_submit = Instant::now();
        handles.push(
            collective
                .all_reduce_mean(world - 1, key, vec![1.0; len])
                .unwrap(),
        );
        for handle in handles {
            assert_eq!(handle.wait().unwrap().len(), len);
            // 1 µs of slack for the f64 -> Duration conversion.
            assert!(before_last_submit.elapsed() + Duration::from_micros(1) >= model);
        }
        let expected_bytes = LinkModel::ring_allreduce_bytes_per_rank(len * 4, world) as u64;
        assert_eq!(expected_bytes, 1_500_000);
        for rank in 0..world {
            assert_eq!(collective.bytes_sent(rank), expected_bytes);
        }
        assert_eq!(collective.bytes_sent(world), 0);
    }

    #[test]
    fn back_to_back_buckets_queue_on_the_fifo_link() {
        let link = shaped(200e6, 2e-3);
        let world = 2;
        let collective = ThreadCollective::new(world, link).unwrap();
        let (first_len, second_len) = (500_000, 250_000);
        let first_time = link.ring_allreduce_seconds(first_len * 4, world);
        let second_time = link.ring_allreduce_seconds(second_len * 4, world);
        let started = Instant::now();
        let first: Vec<_> = (0..world)
            .map(|rank| {
                let key = ReduceKey::new(0, 0);
                collective
                    .all_reduce_mean(rank, key, vec![0.5; first_len])
                    .unwrap()
            })
            .collect();
        let second: Vec<_> = (0..world)
            .map(|rank| {
                let key = ReduceKey::new(0, 1);
                collective
                    .all_reduce_mean(rank, key, vec![0.5; second_len])
                    .unwrap()
            })
            .collect();
        assert!(
            !second[0].is_ready(),
            "the second bucket waits behind the first"
        );
        for handle in second {
            handle.wait().unwrap();
        }
        let second_done = started.elapsed().as_secs_f64();
        assert!(
            second_done >= first_time + second_time - 1e-6,
            "{second_done} < {first_time} + {second_time}"
        );
        for handle in first {
            assert!(handle.is_ready());
            handle.wait().unwrap();
        }
        assert_eq!(collective.pending_operations(), 0);
    }

    #[test]
    fn shutdown_wakes_a_blocked_waiter_with_peer_gone() {
        let collective = ThreadCollective::new(2, LinkModel::unshaped()).unwrap();
        let key = ReduceKey::new(5, 0);
        let handle = collective.all_reduce_mean(0, key, vec![1.0; 4]).unwrap();
        assert!(!handle.is_ready());
        let error = thread::scope(|scope| {
            let waiter = scope.spawn(|| handle.wait());
            thread::sleep(Duration::from_millis(20));
            collective.shutdown("rank 1 exited");
            waiter.join().unwrap().unwrap_err()
        });
        assert_eq!(
            error,
            CollectiveError::PeerGone {
                reason: "rank 1 exited".into()
            }
        );
        // Submissions after shutdown fail immediately.
        assert!(matches!(
            collective.all_reduce_mean(1, key, vec![1.0; 4]),
            Err(CollectiveError::PeerGone { .. })
        ));
    }

    #[test]
    fn panicking_worker_poisons_the_collective() {
        let collective = ThreadCollective::new(2, LinkModel::unshaped()).unwrap();
        let key = ReduceKey::new(0, 0);
        let error = thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let handle = collective.all_reduce_mean(0, key, vec![1.0]).unwrap();
                handle.wait()
            });
            let crasher = scope.spawn(|| {
                let _guard = AbortOnPanic::new(&collective, 1);
                thread::sleep(Duration::from_millis(10));
                panic!("worker 1 fails before submitting");
            });
            assert!(crasher.join().is_err());
            waiter.join().unwrap().unwrap_err()
        });
        assert_eq!(
            error,
            CollectiveError::PeerGone {
                reason: "worker rank 1 panicked".into()
            }
        );
    }

    #[test]
    fn dropping_the_collective_fails_outstanding_handles() {
        let collective = ThreadCollective::new(3, LinkModel::unshaped()).unwrap();
        let handle = collective
            .all_reduce_mean(2, ReduceKey::new(1, 0), vec![0.0; 2])
            .unwrap();
        drop(collective);
        assert!(handle.is_ready());
        assert!(matches!(
            handle.wait(),
            Err(CollectiveError::PeerGone { .. })
        ));
    }

    #[test]
    fn timeout_reports_how_long_it_waited() {
        let timeout = Duration::from_millis(15);
        let collective = ThreadCollective::with_timeout(2, LinkModel::unshaped(), timeout).unwrap();
        let key = ReduceKey::new(3, 3);
        let handle = collective.all_reduce_mean(0, key, vec![1.0]).unwrap();
        match handle.wait() {
            Err(CollectiveError::Timeout { key: k, waited }) => {
                assert_eq!(k, key);
                assert!(waited >= timeout);
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[test]
    fn submission_errors_are_typed() {
        assert_eq!(
            ThreadCollective::new(0, LinkModel::unshaped()).unwrap_err(),
            CollectiveError::EmptyWorld
        );
        let collective = ThreadCollective::new(2, LinkModel::unshaped()).unwrap();
        let key = ReduceKey::new(0, 0);
        assert_eq!(
            collective.all_reduce_mean(2, key, vec![]).unwrap_err(),
            CollectiveError::RankOutOfRange { rank: 2, world: 2 }
        );
        let _first = collective.all_reduce_mean(0, key, vec![1.0]).unwrap();
        assert_eq!(
            collective.all_reduce_mean(0, key, vec![1.0]).unwrap_err(),
            CollectiveError::DuplicateSubmit { key, rank: 0 }
        );
    }

    #[test]
    fn dropped_handles_do_not_leak_table_entries() {
        let collective = ThreadCollective::new(2, LinkModel::unshaped()).unwrap();
        let key = ReduceKey::new(9, 0);
        let abandoned = collective.all_reduce_mean(0, key, vec![2.0]).unwrap();
        drop(abandoned);
        assert_eq!(collective.pending_operations(), 1);
        let kept = collective.all_reduce_mean(1, key, vec![4.0]).unwrap();
        assert!(kept.is_ready());
        assert_eq!(kept.wait().unwrap(), vec![3.0]);
        assert_eq!(collective.pending_operations(), 0);
    }

    #[test]
    fn works_as_a_trait_object() {
        let collective: Arc<dyn Collective> =
            Arc::new(ThreadCollective::new(1, LinkModel::unshaped()).unwrap());
        assert_eq!(collective.world(), 1);
        assert_eq!(collective.name(), "thread");
        let handle = collective
            .all_reduce_mean(0, ReduceKey::new(0, 0), vec![1.5, -2.0])
            .unwrap();
        assert_eq!(handle.wait().unwrap(), vec![1.5, -2.0]);
        assert_eq!(collective.bytes_sent(0), 0);
    }
}
