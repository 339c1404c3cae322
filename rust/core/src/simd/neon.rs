//! aarch64 Advanced SIMD versions of the simplest row primitives (norm, dot, transform, Lloyd-Max
//! encode up to 4 bits, the inverse-rotation finish); the others run the scalar reference on
//! this path. Same bit-exactness rules as `x86/mod.rs`: no fused multiply-add (`vmulq` then
//! `vaddq`), 8-lane accumulators as two 4-lane registers, scalar tails on the same accumulators.
//!
//! Safety: `ops` only calls these when NEON was detected; pointer accesses stay inside the
//! slices as each `unsafe` block notes.

use std::arch::aarch64::*;

use crate::reduce::{combine_f32, combine_f64, LANES};

#[target_feature(enable = "neon")]
pub(crate) fn norm_f64(x: &[f32]) -> f64 {
    let n8 = x.len() / 8 * 8;
    let mut acc = [vdupq_n_f64(0.0); 4];
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= x.len().
        let (a, b) = unsafe {
            (
                vld1q_f32(x.as_ptr().add(i)),
                vld1q_f32(x.as_ptr().add(i + 4)),
            )
        };
        let parts = [
            vcvt_f64_f32(vget_low_f32(a)),
            vcvt_high_f64_f32(a),
            vcvt_f64_f32(vget_low_f32(b)),
            vcvt_high_f64_f32(b),
        ];
        for (s, p) in acc.iter_mut().zip(parts) {
            *s = vaddq_f64(*s, vmulq_f64(p, p));
        }
        i += 8;
    }
    let mut a = [0.0f64; LANES];
    for (k, s) in acc.iter().enumerate() {
        // SAFETY: a[2k..2k+2] is in bounds.
        unsafe { vst1q_f64(a.as_mut_ptr().add(2 * k), *s) };
    }
    for (j, &v) in x[n8..].iter().enumerate() {
        let v = f64::from(v);
        a[j] += v * v;
    }
    combine_f64(&a).sqrt()
}

#[target_feature(enable = "neon")]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let n8 = n / 8 * 8;
    let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            lo = vaddq_f32(
                lo,
                vmulq_f32(vld1q_f32(a.as_ptr().add(i)), vld1q_f32(b.as_ptr().add(i))),
            );
            hi = vaddq_f32(
                hi,
                vmulq_f32(
                    vld1q_f32(a.as_ptr().add(i + 4)),
                    vld1q_f32(b.as_ptr().add(i + 4)),
                ),
            );
        }
        i += 8;
    }
    let mut acc = [0.0f32; LANES];
    // SAFETY: `acc` holds 8 floats.
    unsafe {
        vst1q_f32(acc.as_mut_ptr(), lo);
        vst1q_f32(acc.as_mut_ptr().add(4), hi);
    }
    for (j, (x, y)) in a[n8..n].iter().zip(&b[n8..n]).enumerate() {
        acc[j] += x * y;
    }
    combine_f32(&acc)
}

/// Butterflies of strides 1 and 2 inside one 4-float vector: the low lane of a pair takes
/// `v + s`, the high lane `s - v` (`s` the partner), as in `x86::avx2::fwht8`.
#[inline]
#[target_feature(enable = "neon")]
fn fwht4(v: float32x4_t) -> float32x4_t {
    // SAFETY: the masks are 4 lanes read from local arrays.
    let (odd, high) = unsafe {
        (
            vld1q_u32([0u32, !0, 0, !0].as_ptr()),
            vld1q_u32([0u32, 0, !0, !0].as_ptr()),
        )
    };
    let s = vrev64q_f32(v);
    let v = vbslq_f32(odd, vsubq_f32(s, v), vaddq_f32(v, s));
    let s = vextq_f32::<2>(v, v);
    vbslq_f32(high, vsubq_f32(s, v), vaddq_f32(v, s))
}

#[target_feature(enable = "neon")]
fn cross_stages(x: &mut [f32]) {
    let p = x.as_mut_ptr();
    super::butterfly_pairs(x.len(), 4, 4, |j, h| {
        // SAFETY: j + h + 4 <= n (the pairs stay inside the row).
        unsafe {
            let a = vld1q_f32(p.add(j));
            let b = vld1q_f32(p.add(j + h));
            vst1q_f32(p.add(j), vaddq_f32(a, b));
            vst1q_f32(p.add(j + h), vsubq_f32(a, b));
        }
    });
}

/// `x *= mult` (when given) then the transform; `x.len()` is a power of two >= 4.
#[target_feature(enable = "neon")]
pub(crate) fn fwht(x: &mut [f32], mult: Option<&[f32]>) {
    let n = x.len();
    debug_assert!(n >= 4 && mult.is_none_or(|m| m.len() >= n));
    let p = x.as_mut_ptr();
    let mut i = 0;
    while i < n {
        // SAFETY: i + 4 <= n <= mult.len().
        unsafe {
            let mut v = vld1q_f32(p.add(i));
            if let Some(m) = mult {
                v = vmulq_f32(v, vld1q_f32(m.as_ptr().add(i)));
            }
            vst1q_f32(p.add(i), fwht4(v));
        }
        i += 4;
    }
    cross_stages(x);
}

/// Lloyd-Max codes by a linear count over the boundaries (up to 4 bits; scalar above).
#[target_feature(enable = "neon")]
pub(crate) fn encode(x: &[f32], div: Option<f32>, table: &[f32], bits: u32, codes: &mut [u8]) {
    let n = x.len().min(codes.len());
    if bits > 4 {
        return super::scalar::encode(&x[..n], div, table, bits, &mut codes[..n]);
    }
    let n4 = n / 4 * 4;
    let dv = vdupq_n_f32(div.unwrap_or(1.0));
    let mut i = 0;
    while i < n4 {
        // SAFETY: i + 4 <= n.
        let mut v = unsafe { vld1q_f32(x.as_ptr().add(i)) };
        if div.is_some() {
            v = vdivq_f32(v, dv);
        }
        let mut cnt = vdupq_n_u32(0);
        for &b in &table[..(1usize << bits) - 1] {
            // An all-ones lane is -1: subtracting counts it.
            cnt = vsubq_u32(cnt, vcleq_f32(vdupq_n_f32(b), v));
        }
        let mut c = [0u32; 4];
        // SAFETY: `c` holds 4 lanes.
        unsafe { vst1q_u32(c.as_mut_ptr(), cnt) };
        for (o, v) in codes[i..i + 4].iter_mut().zip(c) {
            *o = v as u8;
        }
        i += 4;
    }
    super::scalar::encode(&x[n4..n], div, table, bits, &mut codes[n4..n]);
}

/// `out[i] = (y[i] * mul) ^ sign_bit[i]` for `i < out.len()`.
#[target_feature(enable = "neon")]
pub(crate) fn finish(y: &[f32], sign_bits: &[u32], mul: f32, out: &mut [f32]) {
    let n = out.len();
    let n4 = n / 4 * 4;
    let mv = vdupq_n_f32(mul);
    let mut i = 0;
    while i < n4 {
        // SAFETY: i + 4 <= n <= y.len(), sign_bits.len().
        unsafe {
            let v = vreinterpretq_u32_f32(vmulq_f32(vld1q_f32(y.as_ptr().add(i)), mv));
            let v = veorq_u32(v, vld1q_u32(sign_bits.as_ptr().add(i)));
            vst1q_f32(out.as_mut_ptr().add(i), vreinterpretq_f32_u32(v));
        }
        i += 4;
    }
    for i in n4..n {
        out[i] = f32::from_bits((y[i] * mul).to_bits() ^ sign_bits[i]);
    }
}

/// [`super::scalar::axpy_many_f64`] with 16 sums per pass (eight vectors: enough
/// independent adds to hide their latency), the same multiplies and adds: the same bits.
#[target_feature(enable = "neon")]
pub(crate) fn axpy_many_f64(acc: &mut [f64], w: &[f64], m: &[f32]) {
    super::scalar::axpy_many_f64_tiles::<16>(acc, w, m);
}

/// Four lanes of [`scalar::exp`](super::scalar::exp): the same multiplies and adds in the same
/// order (`vmulq` then `vaddq`, never `vfmaq`), `n` rounded to nearest even, 0 below `EXP_LO`.
#[inline]
#[target_feature(enable = "neon")]
fn exp4(x: float32x4_t) -> float32x4_t {
    use super::scalar::{EXP_C1, EXP_C2, EXP_HI, EXP_LO, EXP_P, LOG2E};
    let low = vcltq_f32(x, vdupq_n_f32(EXP_LO));
    let x = vminnmq_f32(x, vdupq_n_f32(EXP_HI));
    let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(LOG2E)));
    let r = vsubq_f32(
        vsubq_f32(x, vmulq_f32(n, vdupq_n_f32(EXP_C1))),
        vmulq_f32(n, vdupq_n_f32(EXP_C2)),
    );
    let z = vmulq_f32(r, r);
    let mut p = vdupq_n_f32(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(c));
    }
    let y = vaddq_f32(vaddq_f32(vmulq_f32(p, z), r), vdupq_n_f32(1.0));
    let e = vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)));
    let v = vmulq_f32(y, vreinterpretq_f32_s32(e));
    vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(v), low))
}

/// `x[i] = exp(x[i] - m)`, returning their float64 sum over the fixed 8 lanes.
#[target_feature(enable = "neon")]
pub(crate) fn exp_sum(x: &mut [f32], m: f32) -> f64 {
    let n8 = x.len() / 8 * 8;
    let mv = vdupq_n_f32(m);
    let mut acc = [vdupq_n_f64(0.0); 4];
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= x.len().
        unsafe {
            let p = x.as_mut_ptr().add(i);
            let a = exp4(vsubq_f32(vld1q_f32(p), mv));
            let b = exp4(vsubq_f32(vld1q_f32(p.add(4)), mv));
            vst1q_f32(p, a);
            vst1q_f32(p.add(4), b);
            let parts = [
                vcvt_f64_f32(vget_low_f32(a)),
                vcvt_high_f64_f32(a),
                vcvt_f64_f32(vget_low_f32(b)),
                vcvt_high_f64_f32(b),
            ];
            for (s, q) in acc.iter_mut().zip(parts) {
                *s = vaddq_f64(*s, q);
            }
        }
        i += 8;
    }
    let mut lanes = [0.0f64; LANES];
    for (k, s) in acc.iter().enumerate() {
        // SAFETY: lanes[2k..2k+2] is in bounds.
        unsafe { vst1q_f64(lanes.as_mut_ptr().add(2 * k), *s) };
    }
    super::scalar::exp_sum_tail(&mut x[n8..], m, &mut lanes);
    combine_f64(&lanes)
}
