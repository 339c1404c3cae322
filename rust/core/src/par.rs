//! Splitting batches over rows with rayon. Rows are independent, so the results do not depend
//! on the thread count; errors are reported for the lowest failing row, as a sequential loop
//! would. Small batches stay on the calling thread (spawning costs more than it saves).

use rayon::prelude::*;
use std::sync::OnceLock;

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
/// count, read once; a value that does not parse is ignored) sets it. Handing a job to the pool
/// costs a worker's wake-up, and the worker then spins (`sched_yield`) on the core that torch's
/// next parallel region wants: in `generate` on SmolLM2 (2 cores, torch 2 threads,
/// `OMP_WAIT_POLICY=PASSIVE`, AMD EPYC Zen 3; decode steps interleaved with dense's in one
/// process, speed against dense) `kqv` 4/4 ran at 1.03x on the calling thread against 0.95x
/// split from 2^19 at 1k tokens of context (1.2 M multiply-adds a layer) and at 1.04x against
/// 0.98x-1.01x at 4k (4.7 M), while at 16k (19 M) two threads beat one (1.42x against 1.25x).
/// GNU OpenMP workers spin after each region unless the wait policy is passive, which makes a
/// split dearer still (a 1k layer took 4.6 ms split against 0.32 ms on the calling thread), so
/// that threshold is 4x higher.
pub(crate) fn par_min_attend() -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| {
        let set = std::env::var("KVQRS_ATTEND_SPLIT").ok();
        if let Some(n) = set.and_then(|v| v.trim().parse().ok()) {
            return n;
        }
        if passive_waits() {
            1 << 23
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

/// `f(0) .. f(n - 1)` collected in order, on the rayon pool when `work` (about one multiply-add
/// each) reaches `min_work` and the pool has two threads or more, else on the calling thread.
/// Each item is computed the same way either way, so the result does not depend on the choice.
pub(crate) fn map_range<R: Send>(
    n: usize,
    work: usize,
    min_work: usize,
    f: impl Fn(usize) -> R + Sync + Send,
) -> Vec<R> {
    if work < min_work || rayon::current_num_threads() < 2 {
        (0..n).map(f).collect()
    } else {
        (0..n).into_par_iter().map(f).collect()
    }
}
