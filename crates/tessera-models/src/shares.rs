//! How a decode-step matmul spreads its weight rows over the barrier pool.
//!
//! A single activation row streams every weight once: the step runs at the speed memory
//! delivers the bytes. Each thread therefore reads one contiguous run of rows (its
//! prefetches stay ahead of one stream), and the runs are cut at equal bytes, not equal
//! rows (a stack of Q4_K and Q6_K rows costs unequal bytes per row). Threads still finish
//! apart (memory does not serve two streams evenly), so one that is done takes items from
//! the far end of another's run instead of spinning at the barrier.

use std::sync::atomic::{AtomicU64, Ordering};

/// One thread's run of items, `front..back`, packed in one word so that the owner taking
/// the front and a helper taking the back never both take the last item. Each on its own
/// cache lines: the owner updates it per item, and sharing a line with another thread's
/// run would bounce it between the cores on every item.
#[repr(align(128))]
struct Run(AtomicU64);

impl Run {
    fn new(front: usize, back: usize) -> Self {
        Run(AtomicU64::new(((front as u64) << 32) | back as u64))
    }

    /// Takes the first item left (`from_front`) or the last one.
    fn take(&self, from_front: bool) -> Option<usize> {
        let mut now = self.0.load(Ordering::Relaxed);
        loop {
            let (front, back) = (now >> 32, now & 0xFFFF_FFFF);
            if front >= back {
                return None;
            }
            let (next, item) = if from_front {
                (((front + 1) << 32) | back, front)
            } else {
                ((front << 32) | (back - 1), back - 1)
            };
            match self
                .0
                .compare_exchange_weak(now, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(item as usize),
                Err(seen) => now = seen,
            }
        }
    }
}

/// Runs `run(item)` once for each of `items` over the barrier pool: contiguous runs of
/// equal `bytes(item)` per thread, each taken from its front by its thread, from its back
/// by threads done with their own.
pub(crate) fn stream(items: usize, bytes: impl Fn(usize) -> usize, run: impl Fn(usize) + Sync) {
    if items == 0 {
        return;
    }
    let pool = candle_core::utils::barrier_pool();
    let threads = (pool.n_workers() + 1).min(items);
    assert!(items < 1 << 32, "shares::stream: {items} items");
    let total: usize = (0..items).map(&bytes).sum();
    // Cut where the running byte count passes each thread's equal share.
    let mut runs = Vec::with_capacity(threads);
    let (mut start, mut seen) = (0, 0usize);
    for i in 0..items {
        seen += bytes(i);
        let cut = runs.len() + 1;
        if runs.len() + 1 < threads && seen * threads >= total * cut {
            runs.push(Run::new(start, i + 1));
            start = i + 1;
        }
    }
    runs.push(Run::new(start, items));
    let runs = &runs;
    pool.execute_chunked(runs.len(), |own| {
        for r in own.clone() {
            while let Some(item) = runs[r].take(true) {
                run(item);
            }
        }
        // Then help the others, from the far ends of their runs.
        for r in (0..runs.len()).filter(|r| !own.contains(r)) {
            while let Some(item) = runs[r].take(false) {
                run(item);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_item_runs_once_whatever_the_costs() {
        for items in [1usize, 2, 3, 7, 64, 1000] {
            for uneven in [false, true] {
                let counts: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
                let bytes = |i: usize| if uneven && i % 5 == 0 { 210 } else { 144 };
                stream(items, bytes, |i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                for (i, c) in counts.iter().enumerate() {
                    assert_eq!(c.load(Ordering::Relaxed), 1, "item {i} of {items}");
                }
            }
        }
    }

    #[test]
    fn a_run_gives_each_item_to_one_end_only() {
        let run = Run::new(3, 6);
        assert_eq!(run.take(true), Some(3));
        assert_eq!(run.take(false), Some(5));
        assert_eq!(run.take(false), Some(4));
        assert_eq!(run.take(true), None);
        assert_eq!(run.take(false), None);
    }
}
