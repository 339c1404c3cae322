//! x86_64 versions of the row primitives in `ops`, one file per instruction set: `avx2.rs`,
//! `avx512.rs` and `bmi2.rs` (the bit packing). Each function performs exactly the
//! floating-point operations of its scalar reference, element by element, in the same order:
//! no fused multiply-add, division kept as division, the fixed 8-lane reduction order of
//! `reduce.rs` (the f32 dot products use 8-lane accumulators even under AVX-512). Ragged tails
//! are finished by the scalar code on the same accumulators.
//!
//! Safety: every function here is `#[target_feature]`; `ops` only calls them for an [`Isa`]
//! that [`Isa::is_supported`] confirmed (the `bmi2` module: a supported `PackPath::Bmi2`).
//! Pointer accesses stay inside the slices, as the comments at each `unsafe` block show.
//!
//! [`Isa`]: super::Isa
//! [`Isa::is_supported`]: super::Isa::is_supported

use crate::reduce::{combine_f32, LANES};

pub(super) mod avx2;
pub(super) mod avx512;
/// The BMI2 pack path ([`super::PackPath::Bmi2`]): one `pext`/`pdep` per eight codes.
pub(super) mod bmi2;

/// The blocks of at most `max` query rows of an `ops::axpy_rows` call (`o`: rows x n, `w`: rows
/// x per-row weights): `f(o block, w block, rows in the block)`, the rows in order.
fn row_blocks(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    max: usize,
    mut f: impl FnMut(&mut [f32], &[f32], usize),
) {
    let (n, per) = (o.len() / rows, w.len() / rows);
    let mut r = 0;
    while r < rows {
        let rb = (rows - r).min(max);
        f(&mut o[r * n..(r + rb) * n], &w[r * per..(r + rb) * per], rb);
        r += rb;
    }
}

/// The blocks of at most `max` query rows of a scores call (`q`: rows x n, row `r`'s scores at
/// `out[r * stride..]`): `f(q block, out from the block's first row, rows in the block)`.
fn query_blocks(
    (q, n): (&[f32], usize),
    (out, stride): (&mut [f32], usize),
    max: usize,
    mut f: impl FnMut(&[f32], &mut [f32], usize),
) {
    let rows = q.len() / n;
    let mut r = 0;
    while r < rows {
        let rb = (rows - r).min(max);
        f(&q[r * n..(r + rb) * n], &mut out[r * stride..], rb);
        r += rb;
    }
}

/// Finishes an 8-lane f32 accumulator: adds the tail `a[i] * b[i]` to lane `i` (the tail starts
/// at a multiple of 8) and combines in the fixed order.
#[inline]
fn finish_dot(mut acc: [f32; LANES], a: &[f32], b: &[f32]) -> f32 {
    for (j, (x, y)) in a.iter().zip(b).enumerate() {
        acc[j] += x * y;
    }
    combine_f32(&acc)
}
