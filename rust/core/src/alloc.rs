//! Output buffers for large batches. A fresh multi-MiB output is mapped lazily by the OS and
//! each first write faults in one 4 KiB page: for a 512 MiB decode that costs more than the
//! kernel itself (about 1 GB/s here). Asking for transparent huge pages on such buffers makes
//! the first touch about 2x cheaper (512x fewer faults); memory use is unchanged.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Outputs at least this large are advised for huge pages (smaller ones gain nothing).
const HUGE_MIN_BYTES: usize = 8 << 20;
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed vector of `n` items whose pages (when large) are advised for huge pages before
/// first touch. The zeroing is the allocator's (fresh mappings are zero), not a write pass.
pub fn output_vec<T: Copy + Default>(n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    advise_huge(&mut v);
    v
}

#[cfg(target_os = "linux")]
fn advise_huge<T>(v: &mut [T]) {
    let (start, len) = (v.as_mut_ptr() as usize, std::mem::size_of_val(v));
    if len < HUGE_MIN_BYTES {
        return;
    }
    // madvise needs page-aligned bounds: advise the 2 MiB-aligned interior only.
    let first = start.next_multiple_of(HUGE_PAGE);
    let end = (start + len) / HUGE_PAGE * HUGE_PAGE;
    if end > first {
        // SAFETY: the range lies inside `v`'s allocation; MADV_HUGEPAGE only changes how the
        // kernel backs those pages, never their contents. A failure (THP disabled) is harmless.
        unsafe {
            libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge<T>(_v: &mut [T]) {}

/// Freed bytes at which the allocator is asked to hand free pages back to the system.
const RELEASE_MIN_BYTES: usize = 4 << 20;
static FREED: AtomicUsize = AtomicUsize::new(0);

/// Notes `bytes` just freed; once at least [`RELEASE_MIN_BYTES`] are noted since the last
/// release, glibc's `malloc_trim` hands free heap pages back to the system. glibc raises its
/// mmap threshold after the first large free, so later buffers come from the heap, and a store
/// that grows (every part moved to a larger buffer) would otherwise leave its old buffers
/// resident: about 100 MiB for 30 layers of a 16k-token `kqv` cache on SmolLM2-135M. Python's
/// `kvqrs.hf.heap.release_freed` does the same for the temporaries of a long prompt.
pub fn note_freed(bytes: usize) {
    let total = FREED.fetch_add(bytes, Ordering::Relaxed) + bytes;
    if total >= RELEASE_MIN_BYTES && FREED.swap(0, Ordering::Relaxed) > 0 {
        release();
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release() {
    // SAFETY: malloc_trim only returns free pages to the system; live allocations are untouched.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_vec_is_zeroed_at_every_size() {
        for n in [0usize, 1, 1000, (HUGE_MIN_BYTES / 4) + 12_345] {
            let v: Vec<f32> = output_vec(n);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 0.0));
        }
    }
}
