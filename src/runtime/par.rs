//! The one parallel-for of the inference kernels (tiled quantized matmuls, dense few-row
//! matmuls, decode attention). It runs on rayon's work-stealing pool rather than candle's
//! barrier pool: a barrier makes every call wait until each worker has woken, even one that has
//! no work left, so when another process holds a core the whole decode waits on the scheduler.
//! With work stealing the calling side finishes whatever no awake worker has taken.
//!
//! When the caller still ends up waiting on helpers (another process keeps preempting them:
//! measured, one busy thread beside a 2-thread decode cut it to 0.48× while one thread alone
//! kept 0.75× of the quiet rate), calls run on the caller alone for a while ([`Backoff`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::fused::{Kernels, with_kernels};

/// Stalled calls, among the last 64 parallel ones, that send calls to the caller alone.
const STALL_LIMIT: u32 = 8;
/// How long calls then stay on the caller alone before the helpers are tried again.
const SERIAL_FOR: Duration = Duration::from_millis(100);
/// A call stalled when its caller waited on helpers longer than its own share took, and at
/// least this long: a preempted helper is back after a scheduler slice (milliseconds), a quiet
/// one hands back within tens of microseconds (waking it from sleep included).
const STALL_MIN: Duration = Duration::from_micros(500);
/// How long a spinning helper ([`with_spinning_helpers`]) looks for work without finding any
/// before it returns to rayon's own idle loop (and from there to sleep).
const SPIN_IDLE_LIMIT: Duration = Duration::from_millis(2);

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
/// work to pay for waking the pool), otherwise shared over rayon's pool. The items are cut into
/// one contiguous [`Segment`] per participant; each participant works through its own from the
/// front, in runs of a few items, then takes runs from the back of the others' until none are
/// left. So each thread streams one contiguous range (a decode step's weights are read once, in
/// order, by whichever thread owns them: measured, a shared cursor of interleaved runs streamed
/// the same bytes at ~0.6× the rate; `benches/decode_matmul.rs`), while a participant that is
/// late or preempted still holds up only its one small run. The caller takes part too, and a
/// helper job nobody stole is run by the caller once the work is gone (it returns at once), so
/// the call never waits on a worker that was not scheduled; calls that keep stalling on
/// preempted helpers run on the caller alone for a while ([`Backoff`]).
pub fn for_each_index<F>(n_items: usize, serial: bool, f: F)
where
    F: Fn(usize) + Sync + Send,
{
    let threads = rayon::current_num_threads().max(1);
    if serial
        || n_items <= 1
        || threads == 1
        || u32::try_from(n_items).is_err()
        || backoff().serial_at(now_ns())
    {
        (0..n_items).for_each(f);
        return;
    }
    let k = threads.min(n_items);
    let segments: Vec<Segment> = (0..k)
        .map(|p| Segment::new(p * n_items / k, (p + 1) * n_items / k))
        .collect();
    let run = n_items.div_ceil(k * RUNS_PER_SEGMENT).max(1);
    let arrived = AtomicUsize::new(0);
    let work = || {
        let me = arrived.fetch_add(1, Ordering::Relaxed);
        if let Some(own) = segments.get(me) {
            while let Some(r) = own.take_front(run) {
                r.for_each(&f);
            }
        }
        // Then the others' remaining items, from their backs, the fullest first (another
        // participant may empty it first: then the next fullest, until every one is empty).
        while let Some(r) = steal(&segments, run) {
            r.for_each(&f);
        }
    };
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

/// Runs a participant takes at a time, per segment (so a late or preempted participant holds up
/// at most about 1 / this of its segment).
const RUNS_PER_SEGMENT: usize = 8;

/// One participant's contiguous share of the items, `front..back` still to do: its owner takes
/// runs from the front, the others from the back, both by compare-and-swap on one word.
struct Segment(AtomicU64);

impl Segment {
    fn new(front: usize, back: usize) -> Self {
        Self(AtomicU64::new(pack(front, back)))
    }

    fn remaining(&self) -> usize {
        let (f, b) = unpack(self.0.load(Ordering::Relaxed));
        b.saturating_sub(f)
    }

    /// The next `run` items (or fewer) from the front.
    fn take_front(&self, run: usize) -> Option<std::ops::Range<usize>> {
        self.take(|f, b| (f.min(b) + run).min(b), true)
    }

    /// The last `run` items (or fewer) from the back.
    fn take_back(&self, run: usize) -> Option<std::ops::Range<usize>> {
        self.take(|f, b| b.saturating_sub(run).max(f), false)
    }

    fn take(
        &self,
        cut: impl Fn(usize, usize) -> usize,
        front: bool,
    ) -> Option<std::ops::Range<usize>> {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            let (f, b) = unpack(cur);
            if f >= b {
                return None;
            }
            let c = cut(f, b);
            let (next, taken) = if front {
                (pack(c, b), f..c)
            } else {
                (pack(f, c), c..b)
            };
            match self
                .0
                .compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(taken),
                Err(now) => cur = now,
            }
        }
    }
}

/// A run from the back of the fullest segment that still has one, or `None` when all are empty.
fn steal(segments: &[Segment], run: usize) -> Option<std::ops::Range<usize>> {
    loop {
        let fullest = segments.iter().max_by_key(|s| s.remaining())?;
        if fullest.remaining() == 0 {
            return None;
        }
        if let Some(r) = fullest.take_back(run) {
            return Some(r);
        }
    }
}

/// `front` and `back` (each below 2³², which [`for_each_index`] checks) in one word.
fn pack(front: usize, back: usize) -> u64 {
    ((front as u64) << 32) | back as u64
}

fn unpack(v: u64) -> (usize, usize) {
    ((v >> 32) as usize, (v & u64::from(u32::MAX)) as usize)
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
/// The caller's choice of training kernels (a per-thread override, [`with_kernels`]) goes with
/// it. Whatever `f` keeps per thread must allow for nesting: while `f` waits inside a parallel
/// call, its worker may run another caller's `f`.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        let kernels = Kernels::current();
        rayon::scope(|_| with_kernels(kernels, f))
    }
}

/// Runs `f` as [`on_pool`] does while the pool's other workers look for work without going to
/// sleep: each spins on `rayon::yield_now` (running any job it finds, as it would after waking)
/// until `f` returns. For a training step, a long run of short parallel calls (gemm's row
/// blocks, the fused passes) with serial work between them: a rayon worker that finds nothing
/// for a few dozen rounds sleeps on a futex, and waking it for each call was a visible share of
/// a small model's step (OpenMP pools spin between parallel regions for the same reason).
/// Measured with `envace bench train`: docs/PERFORMANCE.md. Only for work that keeps the cores
/// busy anyway: a spinner holds its core until `f` returns.
///
/// A spinner also returns after [`SPIN_IDLE_LIMIT`] without work. That gives the core back
/// during a long serial stretch, and it bounds a wait spinning could otherwise make endless
/// when several drivers share the pool: a spinner picked up by a worker that was waiting inside
/// one of its jobs sits above that job on the worker's stack, and the job cannot finish before
/// the spinner returns.
pub fn with_spinning_helpers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    spinning(f, SPIN_IDLE_LIMIT, &Arc::default())
}

/// [`with_spinning_helpers`] with the idle limit `idle`, counting the spinners alive in `live`.
fn spinning<R: Send>(f: impl FnOnce() -> R + Send, idle: Duration, live: &Arc<AtomicUsize>) -> R {
    /// Ends the spinners when `f` returns or unwinds.
    struct Stop(Arc<AtomicBool>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    on_pool(|| {
        let stop = Stop(Arc::default());
        let flag = stop.0.clone();
        let live = live.clone();
        let caller = rayon::current_thread_index();
        rayon::spawn_broadcast(move |ctx| {
            if Some(ctx.index()) != caller {
                live.fetch_add(1, Ordering::Relaxed);
                spin_until(&flag, idle);
                live.fetch_sub(1, Ordering::Release);
            }
        });
        let out = f();
        drop(stop);
        out
    })
}

/// One helper's loop: run whatever work appears until `stop`, or until none has for `limit`.
fn spin_until(stop: &AtomicBool, limit: Duration) {
    let mut idle = 0u32;
    let mut idle_since = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if let Some(rayon::Yield::Executed) = rayon::yield_now() {
            idle = 0;
            continue;
        }
        if idle == 0 {
            idle_since = Instant::now();
        }
        idle = idle.wrapping_add(1);
        if idle.is_multiple_of(64) {
            if idle_since.elapsed() > limit {
                return;
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `for_each_index(n, serial, ..)` as `run` calls it: each of the `n` items ran exactly once.
    fn each_ran_once(n: usize, serial: bool, run: impl FnOnce(&(dyn Fn() + Sync))) -> bool {
        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        run(&|| {
            for_each_index(n, serial, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            })
        });
        hits.iter().all(|h| h.load(Ordering::Relaxed) == 1)
    }

    /// A two-worker pool of its own, so that other tests' work does not share it.
    fn pool() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap()
    }

    /// Waits up to a second for the spinners counted in `live` to end.
    fn spinners_end(live: &AtomicUsize) -> bool {
        let t = Instant::now();
        while live.load(Ordering::Acquire) > 0 {
            if t.elapsed() > Duration::from_secs(1) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    #[test]
    fn spinning_helpers_do_the_work_and_stop_with_it() {
        let pool = pool();
        let live = Arc::new(AtomicUsize::new(0));
        let seen = AtomicUsize::new(0);
        // An idle limit far beyond the test's waits: only `f`'s return can end the spinner.
        let long = Duration::from_secs(60);
        let out = pool.install(|| {
            spinning(
                || {
                    for _ in 0..50 {
                        assert!(each_ran_once(500, false, |f| f()));
                    }
                    // The other worker is held by its spinner (once it has woken).
                    let t = Instant::now();
                    while live.load(Ordering::Acquire) == 0 && t.elapsed().as_secs() < 1 {
                        std::hint::spin_loop();
                    }
                    seen.store(live.load(Ordering::Acquire), Ordering::Relaxed);
                    7
                },
                long,
                &live,
            )
        });
        assert_eq!(out, 7);
        assert_eq!(seen.load(Ordering::Relaxed), 1, "one spinner while f ran");
        assert!(spinners_end(&live), "the spinner outlived f");
        // A long serial stretch inside `f`: the spinner gives its core back after the idle limit.
        let live = Arc::new(AtomicUsize::new(0));
        let gave_back = pool.install(|| {
            spinning(
                || {
                    let t = Instant::now();
                    while live.load(Ordering::Acquire) == 0 && t.elapsed().as_secs() < 1 {
                        std::hint::spin_loop();
                    }
                    spinners_end(&live)
                },
                SPIN_IDLE_LIMIT,
                &live,
            )
        });
        assert!(
            gave_back,
            "the spinner kept spinning through a serial stretch"
        );
        // Also when `f` unwinds.
        let live = Arc::new(AtomicUsize::new(0));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                spinning(
                    || {
                        let t = Instant::now();
                        while live.load(Ordering::Acquire) == 0 && t.elapsed().as_secs() < 1 {
                            std::hint::spin_loop();
                        }
                        panic!("a failed step")
                    },
                    long,
                    &live,
                )
            })
        }));
        assert!(r.is_err());
        assert!(spinners_end(&live), "the spinner outlived a panicking f");
    }

    #[test]
    fn spinning_drivers_side_by_side_finish() {
        // Two drivers on one two-worker pool, each with nested parallel work, each spinning the
        // other's worker, so each one's spinner also runs the other's jobs and steps.
        let pool = Arc::new(pool());
        let (tx, rx) = std::sync::mpsc::channel();
        for d in 0..2 {
            let (pool, tx) = (pool.clone(), tx.clone());
            std::thread::spawn(move || {
                for _ in 0..100 {
                    let ok = pool.install(|| {
                        with_spinning_helpers(|| {
                            let n = AtomicUsize::new(0);
                            for_each_index(8, false, |_| {
                                for_each_index(64, false, |i| {
                                    n.fetch_add(i, Ordering::Relaxed);
                                })
                            });
                            n.load(Ordering::Relaxed) == 8 * 2016
                        })
                    });
                    assert!(ok);
                }
                tx.send(d).unwrap();
            });
        }
        for _ in 0..2 {
            rx.recv_timeout(Duration::from_secs(120))
                .expect("a driver did not finish");
        }
    }

    #[test]
    fn every_index_runs_once_serial_or_parallel() {
        for serial in [true, false] {
            for n in [0, 1, 2, 7, 100, 1000] {
                assert!(each_ran_once(n, serial, |f| f()), "{n} {serial}");
            }
        }
    }

    #[test]
    fn stealing_empties_every_segment_from_the_back_and_then_stops() {
        let segs = [
            Segment::new(0, 3),
            Segment::new(3, 10),
            Segment::new(10, 10),
        ];
        let mut got = Vec::new();
        while let Some(r) = steal(&segs, 2) {
            got.extend(r);
        }
        got.sort_unstable();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        assert!(segs.iter().all(|s| s.remaining() == 0));
    }

    #[test]
    fn every_index_runs_once_on_pools_of_two_to_eight_threads() {
        for threads in [2, 3, 4, 8] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for n in [2, 3, 5, 16, 17, 1000, 4099] {
                assert!(
                    each_ran_once(n, false, |f| pool.install(f)),
                    "{threads} threads, {n} items"
                );
            }
        }
    }

    #[test]
    fn a_segment_hands_out_each_item_once_from_either_end() {
        let s = Segment::new(3, 10);
        assert_eq!(s.take_front(2), Some(3..5));
        assert_eq!(s.take_back(4), Some(6..10));
        assert_eq!(s.remaining(), 1);
        assert_eq!(s.take_back(4), Some(5..6));
        assert_eq!(s.take_front(1), None);
        assert_eq!(s.take_back(1), None);
        assert_eq!(s.remaining(), 0);
        let empty = Segment::new(4, 4);
        assert_eq!(empty.take_front(1), None);
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
        // The caller's choice of training kernels goes with it.
        for k in [Kernels::Slow, Kernels::Fused] {
            assert_eq!(with_kernels(k, || on_pool(Kernels::current)), k);
        }
    }
}
