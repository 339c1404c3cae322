//! Splitting batches over rows with rayon. Rows are independent, so the results do not depend
//! on the thread count; errors are reported for the lowest failing row, as a sequential loop
//! would. Small batches stay on the calling thread (spawning costs more than it saves).

use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// Below this much work per call (in units of `work_per_row`, about one float each), a kernel
/// runs on the calling thread. Handing a job to the pool costs a worker's wake-up, tens of
/// microseconds on a 2-vCPU VM whose other core spins in another library's pool (OpenBLAS,
/// OpenMP): the QJL value encode of 12 rows (one vLLM decode step's 4 tokens x 3 KV heads, 49 k
/// multiply-adds) took 13 us on the calling thread and 36-38 us split, and split calls were
/// slower up to 768 rows (285 against 263-608 us) on an AMD EPYC of family 0x19.
pub(crate) const PAR_MIN_WORK: usize = 1 << 19;
/// Work per rayon task: enough rows to amortise the task, few enough to balance two cores.
const TASK_WORK: usize = 1 << 14;

/// Runs `f(scratch, first_row, a_rows, b_rows, c_rows)` over blocks of rows of one input `a`
/// (`wa` items per row) and two outputs `b`, `c` (`wb`, `wc` items per row); `f` returns the
/// first failing row of its block. Each task gets its own scratch from `init` (allocated once
/// per task, never per row). Returns the lowest failing row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows2<A, B, C, S>(
    rows: usize,
    work_per_row: usize,
    (a, wa): (&[A], usize),
    (b, wb): (&mut [B], usize),
    (c, wc): (&mut [C], usize),
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize, &[A], &mut [B], &mut [C]) -> Result<(), usize> + Sync + Send,
) -> Result<(), usize>
where
    A: Sync,
    B: Send,
    C: Send,
{
    if rows == 0 {
        return Ok(());
    }
    debug_assert!(a.len() == rows * wa && b.len() == rows * wb && c.len() == rows * wc);
    let (wa, wb, wc) = (wa.max(1), wb.max(1), wc.max(1));
    let work = rows.saturating_mul(work_per_row.max(1));
    if work < PAR_MIN_WORK || rayon::current_num_threads() < 2 {
        return f(&mut init(), 0, a, b, c);
    }
    let block = (TASK_WORK / work_per_row.max(1)).max(1);
    let first_error = a
        .par_chunks(block * wa)
        .zip(b.par_chunks_mut(block * wb))
        .zip(c.par_chunks_mut(block * wc))
        .enumerate()
        .map_init(init, |s, (k, ((ai, bi), ci))| f(s, k * block, ai, bi, ci))
        .filter_map(|r| r.err())
        .min();
    match first_error {
        Some(row) => Err(row),
        None => Ok(()),
    }
}

/// [`rows2`] with a single output.
pub(crate) fn rows1<A, B, S>(
    rows: usize,
    work_per_row: usize,
    a: (&[A], usize),
    b: (&mut [B], usize),
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize, &[A], &mut [B]) -> Result<(), usize> + Sync + Send,
) -> Result<(), usize>
where
    A: Sync,
    B: Send,
{
    // A zero-sized second output: no memory, one "item" per row.
    let mut none = vec![(); rows];
    rows2(
        rows,
        work_per_row,
        a,
        b,
        (&mut none, 1),
        init,
        |s, r, ai, bi, _| f(s, r, ai, bi),
    )
}

/// Whether torch's GNU OpenMP workers sleep between parallel regions (`OMP_WAIT_POLICY=PASSIVE`)
/// instead of spinning on their cores.
fn passive_waits() -> bool {
    std::env::var("OMP_WAIT_POLICY").is_ok_and(|v| v.eq_ignore_ascii_case("passive"))
}

/// Below this much work per call (about one multiply-add each), decode attention (contiguous,
/// paged and the full-precision window) runs on the calling thread; `KVQRS_ATTEND_SPLIT` (a
/// count, read once; a value that does not parse is ignored) sets it. With passive OpenMP
/// waits the threshold is 2^21: a SmolLM2 layer at 4k tokens of context (4.7 M multiply-adds)
/// splits, one at 1k (1.2 M) does not. A split call from Python's thread works beside the
/// pool's worker ([`claim_map`]), so it never waits for a sleeping worker to wake. In
/// `generate` on SmolLM2 (Intel Xeon, 2 vCPUs, `benches/bench_speed.py --sections
/// scoreboard`, speed against dense in one run) splitting from 2^20 gave `kqv` / `kivi` /
/// `4bit` 1.63x / 1.44x / 1.51x at 4k (torch 1 thread) where 4k calls on the calling thread
/// (2^23) gave 1.33x / 1.23x / 1.31x (torch 2 threads); at 1k splitting gained 1-5% on the
/// AVX-512 path and lost 2-6% on the AVX2 path (two runs each), so 1k calls stay whole. GNU
/// OpenMP workers spin after each region unless the wait policy is passive, and a split worker
/// then finds its core taken (a 1k layer took 4.6 ms split against 0.32 ms on the calling
/// thread): that threshold is 2^25.
pub(crate) fn par_min_attend() -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| {
        let set = std::env::var("KVQRS_ATTEND_SPLIT").ok();
        if let Some(n) = set.and_then(|v| v.trim().parse().ok()) {
            return n;
        }
        if passive_waits() {
            1 << 21
        } else {
            1 << 25
        }
    })
}

/// Below this much work per call, a prompt's bulk work in the paged cache (the slot writer's
/// encode, the reconstruction for a prefill's dense attention) runs on the calling thread: 2^19
/// with passive OpenMP waits, 2^21 without. These calls come once per prompt and chunk, not
/// once per decode step, and were not measured to lose when split.
pub(crate) fn par_min_bulk() -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| if passive_waits() { 1 << 19 } else { 1 << 21 })
}

/// `f(0) .. f(n - 1)` collected in order, on the calling thread and the rayon pool when `work`
/// (about one multiply-add each) reaches `min_work` and the pool has two threads or more, else
/// on the calling thread alone. Each item is computed the same way either way, so the result
/// does not depend on the choice. A thread outside the pool works on the items itself
/// ([`claim_map`]) instead of waiting for the pool's workers to wake.
pub(crate) fn map_range<R: Send>(
    n: usize,
    work: usize,
    min_work: usize,
    f: impl Fn(usize) -> R + Sync + Send,
) -> Vec<R> {
    if work < min_work || rayon::current_num_threads() < 2 || n < 2 {
        (0..n).map(f).collect()
    } else if rayon::current_thread_index().is_some() {
        (0..n).into_par_iter().map(f).collect()
    } else {
        claim_map(n, &f)
    }
}

/// How far the items of a [`claim_map`] call have gone: the next unclaimed item, the items
/// finished, and whether one panicked on a worker.
struct Claims {
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

/// `f(0) .. f(n - 1)` in order, computed by the calling thread (outside the pool) and the
/// pool's workers together: each takes the next unclaimed item until none is left. The caller
/// starts at once and waits only for items a worker has already taken, never for a worker to
/// wake: inside `generate` the workers sleep through the model's work between two layers, and
/// a sleeping worker's vCPU takes hundreds of microseconds to wake (docs/benchmarks.md), so a
/// call that waited for them could lose to the calling thread alone. A worker that wakes after
/// the last item was taken finds nothing to do.
fn claim_map<R: Send>(n: usize, f: &(impl Fn(usize) -> R + Sync)) -> Vec<R> {
    let mut out: Vec<MaybeUninit<R>> = Vec::with_capacity(n);
    out.resize_with(n, MaybeUninit::uninit);
    let slots = SendPtr(out.as_mut_ptr());
    let claims = Arc::new(Claims {
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    });
    // Item i writes slot i only, once: the slots are disjoint, and the caller reads them after
    // every taken item is done.
    let item = move |i: usize| {
        let r = f(i);
        // SAFETY: i < n lies in `out`, and only the thread that claimed i writes slot i.
        unsafe { slots.at(i).write(MaybeUninit::new(r)) };
    };
    let item: &(dyn Fn(usize) + Sync) = &item;
    // SAFETY: a worker calls `item` only after claiming an item below n, and the caller returns
    // (or unwinds, through `Wait`) only once every claimed item is done; after that every claim
    // fails, so the borrow is never used beyond this call.
    let item: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(item) };
    let wait = Wait(&claims, n);
    for _ in 1..rayon::current_num_threads() {
        let claims = Arc::clone(&claims);
        rayon::spawn(move || {
            while let Some(i) = claim(&claims.next, n) {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| item(i))).is_err() {
                    claims.panicked.store(true, Ordering::Relaxed);
                }
                claims.done.fetch_add(1, Ordering::Release);
            }
        });
    }
    let mut caught = None;
    while let Some(i) = claim(&claims.next, n) {
        // An item that panics here is still counted done, so that `Wait` does not wait for it;
        // the panic resumes once no worker reads the borrows any more.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| item(i)));
        claims.done.fetch_add(1, Ordering::Release);
        if let Err(p) = r {
            caught = Some(p);
            break;
        }
    }
    drop(wait);
    if let Some(p) = caught {
        std::panic::resume_unwind(p);
    }
    assert!(
        !claims.panicked.load(Ordering::Relaxed),
        "a worker's item panicked"
    );
    // SAFETY: every slot was written (each item below n was claimed once and is done).
    out.into_iter()
        .map(|r| unsafe { r.assume_init() })
        .collect()
}

/// The next unclaimed item below `n`, if any.
fn claim(next: &AtomicUsize, n: usize) -> Option<usize> {
    let i = next.fetch_add(1, Ordering::Relaxed);
    (i < n).then_some(i)
}

/// On drop (the caller's return or unwind): closes the claims and waits until every item taken
/// is done, so that no worker still reads the caller's borrows.
struct Wait<'a>(&'a Claims, usize);

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        let taken = self
            .0
            .next
            .swap(usize::MAX / 2, Ordering::Relaxed)
            .min(self.1);
        let mut spins = 0u32;
        while self.0.done.load(Ordering::Acquire) < taken {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A raw pointer that the worker closures may carry (each item writes its own slot only).
struct SendPtr<T>(*mut T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer to element `i` (a method, so that closures capture the whole `SendPtr`).
    fn at(self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}
// SAFETY: the pointee slots are written by one thread each and read after all writes are done.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above; shared references only copy the pointer.
unsafe impl<T: Send> Sync for SendPtr<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Items of uneven cost, so that the caller and the workers interleave their claims.
    fn slow_square(i: usize) -> usize {
        let mut x = i;
        for _ in 0..(i % 7) * 2000 {
            x = std::hint::black_box(x);
        }
        x * x
    }

    #[test]
    fn split_calls_return_every_item_in_order() {
        for n in [2usize, 3, 17, 1000] {
            let want: Vec<usize> = (0..n).map(slow_square).collect();
            assert_eq!(map_range(n, usize::MAX, 0, slow_square), want);
            // From a pool worker: rayon's own split.
            let inner = rayon::scope(|_| map_range(n, usize::MAX, 0, slow_square));
            assert_eq!(inner, want);
        }
        assert!(map_range(0, usize::MAX, 0, slow_square).is_empty());
    }

    /// A panicking item ends the call with a panic (on whichever thread it ran), never a hang,
    /// and later calls still work.
    #[test]
    fn a_panicking_item_panics_the_call() {
        let r = std::panic::catch_unwind(|| {
            map_range(64, usize::MAX, 0, |i| {
                assert!(i != 40, "item 40");
                slow_square(i)
            })
        });
        assert!(r.is_err());
        let want: Vec<usize> = (0..64).map(slow_square).collect();
        assert_eq!(map_range(64, usize::MAX, 0, slow_square), want);
    }
}
