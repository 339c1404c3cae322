//! The scalar reference of every row primitive in `ops`, in one place: the bits every SIMD
//! path must reproduce. The kernels in `kernels/` call these (through `ops`, or directly where
//! they define a reference), never the other way round; nothing here calls back into `ops`.

use half::f16;

use crate::reduce::{combine_f32, combine_f64, LANES};

/// `codes[i] = #{j : table[j] <= x[i] / div}` over the `2^bits - 1` boundaries.
pub(crate) fn encode(x: &[f32], div: Option<f32>, table: &[f32], bits: u32, codes: &mut [u8]) {
    let b = &table[..(1usize << bits) - 1];
    for (c, &v) in codes.iter_mut().zip(x) {
        let v = match div {
            Some(d) => v / d,
            None => v,
        };
        *c = b.partition_point(|&t| t <= v) as u8;
    }
}

/// `out[i] = table[codes[i]] * mul`.
pub(crate) fn decode(codes: &[u8], table: &[f32], mul: f32, out: &mut [f32]) {
    out.iter_mut()
        .zip(codes)
        .for_each(|(o, &c)| *o = table[usize::from(c)] * mul);
}

/// Packed bits `t[i] < 0` for values starting at index `first` (a multiple of 8) of a row.
pub(crate) fn sign_bits_from(t: &[f32], first: usize, out: &mut [u8]) {
    debug_assert_eq!(first % 8, 0);
    for (k, chunk) in t.chunks(8).enumerate() {
        out[first / 8 + k] = chunk
            .iter()
            .enumerate()
            .fold(0u8, |b, (l, &v)| b | (u8::from(v < 0.0) << l));
    }
}

/// `out[i] = (y[i] * mul) ^ sign_bits[i]` (the inverse rotation's sign flip and norm).
pub(crate) fn finish(y: &[f32], sign_bits: &[u32], mul: f32, out: &mut [f32]) {
    out.iter_mut()
        .zip(y.iter().zip(sign_bits))
        .for_each(|(o, (&v, &s))| *o = f32::from_bits((v * mul).to_bits() ^ s));
}

/// The unnormalised fast Walsh-Hadamard transform in place (`x.len()` a power of two):
/// stages `h = 1, 2, 4, ...`, pairs `(a, b) -> (a + b, a - b)` (docs/kernels.md section 3).
pub(crate) fn fwht(x: &mut [f32]) {
    debug_assert!(x.len().is_power_of_two());
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
}

/// Packs one row of `bits`-bit codes, little-endian within each byte (docs/kernels.md, bit packing).
pub(crate) fn pack_row(codes: &[u8], bits: u32, out: &mut [u8]) {
    let mut acc: u32 = 0;
    let mut filled: u32 = 0;
    let mut pos = 0;
    for &c in codes {
        acc |= u32::from(c) << filled;
        filled += bits;
        while filled >= 8 {
            out[pos] = acc as u8;
            pos += 1;
            acc >>= 8;
            filled -= 8;
        }
    }
    if filled > 0 {
        out[pos] = acc as u8;
    }
}

/// Unpacks the first `out.len()` codes of a packed row.
pub(crate) fn unpack_row(packed: &[u8], bits: u32, out: &mut [u8]) {
    unpack_range(packed, bits, 0, out);
}

/// Unpacks `out.len()` codes of one packed row starting at code `start` (bit offset
/// `start * bits`); the row must hold codes `start .. start + out.len()`.
pub(crate) fn unpack_range(packed: &[u8], bits: u32, start: usize, out: &mut [u8]) {
    let mask = (1u32 << bits) - 1;
    let offset = start * bits as usize;
    let mut src = packed[offset / 8..].iter();
    let skip = (offset % 8) as u32;
    let mut acc: u32 = src.next().map_or(0, |&b| u32::from(b) >> skip);
    let mut filled: u32 = 8 - skip;
    for o in out.iter_mut() {
        while filled < bits {
            acc |= u32::from(*src.next().unwrap_or(&0)) << filled;
            filled += 8;
        }
        *o = (acc & mask) as u8;
        acc >>= bits;
        filled -= bits;
    }
}

/// `sum y[i] * sigma_i` (sigma = +-1 from packed sign bits) in the fixed 8-lane order.
pub(crate) fn dot_signs(y: &[f32], packed: &[u8]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, &v) in y.iter().enumerate() {
        let sigma = 1.0 - 2.0 * f32::from((packed[i / 8] >> (i % 8)) & 1);
        acc[i % LANES] += v * sigma;
    }
    combine_f32(&acc)
}

/// HeadQ correction `sum qu[i] * (s * (codes[i] - h))` in the fixed 8-lane order.
pub(crate) fn dot_side(qu: &[f32], codes: &[u8], s: f32, h: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, (&q, &c)) in qu.iter().zip(codes).enumerate() {
        acc[i % LANES] += q * (s * (f32::from(c) - h));
    }
    combine_f32(&acc)
}

/// `acc[j] += w[i] * f64(m[i * n + j])` for each row `i` of `m` in order (`n = acc.len()`),
/// each a multiply then an add (never fused): `w.len()` axpys in one pass over `m`, `T` sums
/// kept in registers across the rows (the SIMD paths inline this with a wider `T`: the same
/// bits for any `T`, and as the axpys one at a time).
#[inline(always)]
pub(crate) fn axpy_many_f64_tiles<const T: usize>(acc: &mut [f64], w: &[f64], m: &[f32]) {
    let n = acc.len();
    for (j0, a) in (0..n).step_by(T).zip(acc.chunks_mut(T)) {
        if a.len() == T {
            let mut s = [0.0f64; T];
            s.copy_from_slice(a);
            for (&wi, row) in w.iter().zip(m.chunks_exact(n)) {
                let x = &row[j0..j0 + T];
                for j in 0..T {
                    s[j] += wi * f64::from(x[j]);
                }
            }
            a.copy_from_slice(&s);
        } else {
            for (&wi, row) in w.iter().zip(m.chunks_exact(n)) {
                for (s, &x) in a.iter_mut().zip(&row[j0..]) {
                    *s += wi * f64::from(x);
                }
            }
        }
    }
}

pub(crate) fn axpy_many_f64(acc: &mut [f64], w: &[f64], m: &[f32]) {
    axpy_many_f64_tiles::<4>(acc, w, m);
}

/// `out[i] = f32(sum_c x[c] m[c * out.len() + i])`: each sum in float64 over `c` in order, a
/// multiply then an add (never fused), `T` outputs at a time whose sums stay in registers (the
/// SIMD paths inline this with a wider `T`: the same bits for any `T`).
#[inline(always)]
pub(crate) fn project_f64_tiles<const T: usize>(x: &[f64], m: &[f64], out: &mut [f32]) {
    let n = out.len();
    for (i0, o) in (0..n).step_by(T).zip(out.chunks_mut(T)) {
        let mut acc = [0.0f64; T];
        if o.len() == T {
            for (&v, row) in x.iter().zip(m.chunks_exact(n)) {
                let w = &row[i0..i0 + T];
                for j in 0..T {
                    acc[j] += v * w[j];
                }
            }
        } else {
            for (&v, row) in x.iter().zip(m.chunks_exact(n)) {
                for (a, &w) in acc.iter_mut().zip(&row[i0..i0 + o.len()]) {
                    *a += v * w;
                }
            }
        }
        o.iter_mut().zip(&acc).for_each(|(y, &a)| *y = a as f32);
    }
}

pub(crate) fn project_f64(x: &[f64], m: &[f64], out: &mut [f32]) {
    project_f64_tiles::<8>(x, m, out);
}

pub(crate) fn axpy_rows(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    mat: &[f32],
    stride: usize,
) {
    let n = o.len() / rows;
    let count = w.len() / (rows * groups);
    for (r, or) in o.chunks_exact_mut(n).enumerate() {
        for c in 0..count {
            let wc = &w[(r * count + c) * groups..(r * count + c + 1) * groups];
            let row = &mat[c * stride..c * stride + n];
            if groups == 1 {
                or.iter_mut().zip(row).for_each(|(a, &v)| *a += wc[0] * v);
            } else {
                for (i, (a, &v)) in or.iter_mut().zip(row).enumerate() {
                    *a += wc[i / group] * v;
                }
            }
        }
    }
}

/// [`super::ops::zero_point_sums`]: eight (row, group) sums advance together, one token at a
/// time.
pub(crate) fn zero_point_sums(
    (p, n, at): (&[f32], usize, usize),
    (ze, groups): (&[f32], usize),
    count: usize,
    (acc, stride, offset): (&mut [f64], usize, usize),
) {
    let pairs = p.len() / n * groups;
    for first in (0..pairs).step_by(8) {
        let m = (pairs - first).min(8);
        // (query row, group) of each lane; lanes past the last pair repeat it, unstored.
        let rg: [(usize, usize); 8] = std::array::from_fn(|j| {
            let q = (first + j).min(pairs - 1);
            (q / groups, q % groups)
        });
        let mut a: [f64; 8] = std::array::from_fn(|j| acc[rg[j].0 * stride + offset + rg[j].1]);
        for k in 0..count {
            for (aj, &(r, g)) in a.iter_mut().zip(&rg) {
                *aj += f64::from(p[r * n + at + k]) * f64::from(ze[k * groups + g]);
            }
        }
        for (j, &(r, g)) in rg.iter().enumerate().take(m) {
            acc[r * stride + offset + g] = a[j];
        }
    }
}

pub(crate) fn add_signed(o: &mut [f32], s: &[f32], negative: bool) {
    if negative {
        o.iter_mut().zip(s).for_each(|(o, v)| *o -= v);
    } else {
        o.iter_mut().zip(s).for_each(|(o, v)| *o += v);
    }
}

pub(crate) fn scale(o: &mut [f32], k: f32) {
    o.iter_mut().for_each(|v| *v *= k);
}

pub(crate) fn all_finite(x: &[f32]) -> bool {
    x.iter().all(|v| v.is_finite())
}

/// `o *= k`, then the largest value, or None if a scaled value is not finite.
pub(crate) fn scale_max(o: &mut [f32], k: f32) -> Option<f32> {
    scale(o, k);
    all_finite(o).then(|| o.iter().copied().fold(f32::NEG_INFINITY, f32::max))
}

/// `acc[i] += f64(x[i])` (exact widening, one rounded add each).
pub(crate) fn add_to_f64(acc: &mut [f64], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, &v)| *a += f64::from(v));
}

/// `out[i] = f32(f16 bits src[i])` (exact: every float16 is a float32).
pub(crate) fn f16_to_f32(src: &[u16], out: &mut [f32]) {
    out.iter_mut()
        .zip(src)
        .for_each(|(o, &b)| *o = f16::from_bits(b).to_f32());
}

/// Below this, [`exp`] returns 0: `e^x < 2^-126`, a softmax weight no sum can see next to the
/// maximum's `e^0 = 1`.
pub(crate) const EXP_LO: f32 = -87.336_55;
/// Inputs are clamped here (`e^x` just below `2^127.5`).
pub(crate) const EXP_HI: f32 = 88.376_26;
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = C1 + C2`, C1 with few mantissa bits so that `n * C1` is exact (Cody and Waite).
pub(crate) const EXP_C1: f32 = 0.693_359_4;
pub(crate) const EXP_C2: f32 = -2.121_944_4e-4;
/// Minimax coefficients of `(e^r - 1 - r) / r^2` on `|r| <= ln(2)/2` (Cephes `expf`), highest
/// first.
pub(crate) const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `e^x` for finite `x` to about 1 ulp (Cephes `expf`): `x = n ln 2 + r`, a degree-7
/// polynomial in `r`, times `2^n` built in the exponent bits. Every operation is a plain
/// float32 multiply or add in a fixed order (no fused multiply-add), so the SIMD twins return
/// the same bits; 0 below [`EXP_LO`].
#[inline]
pub(crate) fn exp(x: f32) -> f32 {
    if x < EXP_LO {
        return 0.0;
    }
    let x = x.min(EXP_HI);
    let n = (x * LOG2E).round_ties_even();
    let r = (x - n * EXP_C1) - n * EXP_C2;
    let z = r * r;
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p * r + c;
    }
    let y = (p * z + r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `x[i] = exp(x[i] - m)`; returns `sum_i x[i]` in float64 over the fixed 8 lanes of
/// `reduce.rs` (lane `i % 8`, then the fixed combining tree).
pub(crate) fn exp_sum(x: &mut [f32], m: f32) -> f64 {
    let mut acc = [0.0f64; LANES];
    exp_sum_tail(x, m, &mut acc);
    combine_f64(&acc)
}

/// [`exp_sum`] onto the lanes `acc`, for values starting at an index that is a multiple of 8
/// (the SIMD paths' tails).
pub(crate) fn exp_sum_tail(x: &mut [f32], m: f32, acc: &mut [f64; LANES]) {
    for (i, v) in x.iter_mut().enumerate() {
        *v = exp(*v - m);
        acc[i % LANES] += f64::from(*v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_the_float64_exponential() {
        let mut x = EXP_LO;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            // Relative error of the normal results; tiny ones are subnormal (absolute error).
            let tol = 2.5 * f64::from(f32::EPSILON) * want + 1e-44;
            assert!((got - want).abs() <= tol, "exp({x}) = {got}, want {want}");
            x += 0.001_37;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!((f64::from(exp(10.0)) / 10f64.exp() - 1.0).abs() < 3e-7);
    }
}
