//! The one parallel-for of the inference kernels (tiled quantized matmuls, dense few-row
//! matmuls, decode attention). It runs on rayon's work-stealing pool rather than candle's
//! barrier pool: a barrier makes every call wait until each worker has woken, even one that has
//! no work left, so when another process holds a core the whole decode waits on the scheduler.
//! With work stealing the calling side finishes whatever no awake worker has taken.
//!
//! When the caller still ends up waiting on helpers (another process keeps preempting them:
//! measured, one busy thread beside a 2-thread decode cut it to 0.48× while one thread alone
//! kept 0.75× of the quiet rate), calls run on the caller alone for a while ([`Backoff`]).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Stalled calls, among the last 64 parallel ones, that send calls to the caller alone.
const STALL_LIMIT: u32 = 8;
/// How long calls then stay on the caller alone before the helpers are tried again.
const SERIAL_FOR: Duration = Duration::from_millis(100);
/// A call stalled when its caller waited on helpers longer than its own share took, and at
/// least this long: a preempted helper is back after a scheduler slice (milliseconds), a quiet
/// one hands back within tens of microseconds (waking it from sleep included).
const STALL_MIN: Duration = Duration::from_micros(500);

/// The helpers' recent record: which of the last 64 parallel calls stalled (one bit each), and
/// until when calls run on the caller alone.
#[derive(Debug, Default)]
pub struct Backoff {
    stalls: AtomicU64,
    serial_until_ns: AtomicU64,
}

impl Backoff {
    /// Whether calls should run on the caller alone at `now_ns`.
    pub fn serial_at(&self, now_ns: u64) -> bool {
        now_ns < self.serial_until_ns.load(Ordering::Relaxed)
    }

    /// Records one parallel call: the caller's own share took `mine`, the whole call `total`.
    pub fn record(&self, mine: Duration, total: Duration, now_ns: u64) {
        let waited = total.saturating_sub(mine);
        let stalled = waited > mine && waited > STALL_MIN;
        let before = self
            .stalls
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some((b << 1) | u64::from(stalled))
            })
            .unwrap_or(0);
        if ((before << 1) | u64::from(stalled)).count_ones() >= STALL_LIMIT {
            self.stalls.store(0, Ordering::Relaxed);
            let until = now_ns.saturating_add(SERIAL_FOR.as_nanos() as u64);
            self.serial_until_ns.store(until, Ordering::Relaxed);
            tracing::debug!(
                "parallel kernels stalled on preempted helpers: caller alone for {SERIAL_FOR:?}"
            );
        }
    }
}

/// The process-wide record and clock.
fn backoff() -> &'static Backoff {
    static B: OnceLock<Backoff> = OnceLock::new();
    B.get_or_init(Backoff::default)
}

fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Runs `f(i)` for every `i` in `0..n_items`, on the calling thread when `serial` (too little
/// work to pay for waking the pool), otherwise shared over rayon's pool: every participant
/// claims runs of a few items from one cursor until none are left. The caller claims too, and
/// a helper job nobody stole is run by the caller once the work is gone (it returns at once),
/// so the call never waits on a worker that was not scheduled; a worker preempted mid-run holds
/// up only its one small run, and calls that keep stalling on them run on the caller alone for
/// a while ([`Backoff`]).
pub fn for_each_index<F>(n_items: usize, serial: bool, f: F)
where
    F: Fn(usize) + Sync + Send,
{
    let threads = rayon::current_num_threads().max(1);
    if serial || n_items <= 1 || threads == 1 || backoff().serial_at(now_ns()) {
        (0..n_items).for_each(f);
        return;
    }
    let run = n_items.div_ceil(threads * 8).max(1);
    let cursor = AtomicUsize::new(0);
    let work = || {
        loop {
            let start = cursor.fetch_add(run, Ordering::Relaxed);
            if start >= n_items {
                break;
            }
            (start..n_items.min(start + run)).for_each(&f);
        }
    };
    let k = threads.min(n_items);
    let half = k / 2;
    let start = Instant::now();
    let mut mine = Duration::ZERO;
    rayon::join(
        || {
            participate(k - half, &work);
            mine = start.elapsed();
        },
        || participate(half, &work),
    );
    backoff().record(mine, start.elapsed(), now_ns());
}

/// `work` on `k` participants: the caller and `k - 1` jobs offered to the pool's other workers
/// (`rayon::join`, which runs a job itself when no one has stolen it).
fn participate(k: usize, work: &(impl Fn() + Sync)) {
    if k <= 1 {
        work();
    } else {
        let half = k / 2;
        rayon::join(|| participate(k - half, work), || participate(half, work));
    }
}

/// Runs `f` on a worker of rayon's pool (in place when already on one), so that the calling
/// side of every [`for_each_index`] inside it takes part in the work instead of waiting for it.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_runs_once_serial_or_parallel() {
        for serial in [true, false] {
            for n in [0, 1, 2, 7, 100, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                for_each_index(n, serial, |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "{n} {serial}"
                );
            }
        }
    }

    #[test]
    fn stalls_send_calls_to_the_caller_alone_for_a_while() {
        let b = Backoff::default();
        let us = Duration::from_micros;
        // Quiet: the caller waits a little for the helpers' last run, never longer than its
        // own share.
        for i in 0..1000 {
            b.record(us(40), us(45), i * 50_000);
        }
        assert!(!b.serial_at(50_000_000));
        // Seven stalls among 64 calls are not enough, the eighth is.
        let t0 = 100_000_000;
        for _ in 0..STALL_LIMIT - 1 {
            b.record(us(40), us(3000), t0);
            b.record(us(40), us(41), t0);
        }
        assert!(!b.serial_at(t0));
        b.record(us(40), us(3000), t0);
        assert!(b.serial_at(t0 + 1));
        let end = t0 + SERIAL_FOR.as_nanos() as u64;
        assert!(b.serial_at(end - 1));
        assert!(!b.serial_at(end));
        // Waits under STALL_MIN never count, however short the call.
        let b = Backoff::default();
        for _ in 0..100 {
            b.record(us(20), us(400), 0);
        }
        assert!(!b.serial_at(1));
    }

    #[test]
    fn on_pool_runs_on_a_pool_worker_and_nests_in_place() {
        let outer = on_pool(|| {
            let me = rayon::current_thread_index();
            (me, on_pool(rayon::current_thread_index))
        });
        assert!(outer.0.is_some());
        assert_eq!(outer.0, outer.1);
    }
}
