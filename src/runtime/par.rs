//! The one parallel-for of the inference kernels (tiled quantized matmuls, dense few-row
//! matmuls, decode attention). It runs on rayon's work-stealing pool rather than candle's
//! barrier pool: a barrier makes every call wait until each worker has woken, even one that has
//! no work left, so when another process holds a core the whole decode waits on the scheduler.
//! With work stealing the calling side finishes whatever no awake worker has taken.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Runs `f(i)` for every `i` in `0..n_items`, on the calling thread when `serial` (too little
/// work to pay for waking the pool), otherwise shared over rayon's pool: every participant
/// claims runs of a few items from one cursor until none are left. The caller claims too, and
/// a helper job nobody stole is run by the caller once the work is gone (it returns at once),
/// so the call never waits on a worker that was not scheduled; a worker preempted mid-run holds
/// up only its one small run.
pub fn for_each_index<F>(n_items: usize, serial: bool, f: F)
where
    F: Fn(usize) + Sync + Send,
{
    if serial || n_items <= 1 {
        (0..n_items).for_each(f);
        return;
    }
    let threads = rayon::current_num_threads().max(1);
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
    participate(threads.min(n_items), &work);
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
    use std::sync::atomic::{AtomicUsize, Ordering};

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
    fn on_pool_runs_on_a_pool_worker_and_nests_in_place() {
        let outer = on_pool(|| {
            let me = rayon::current_thread_index();
            (me, on_pool(rayon::current_thread_index))
        });
        assert!(outer.0.is_some());
        assert_eq!(outer.0, outer.1);
    }
}
