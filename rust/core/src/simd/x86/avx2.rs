use std::arch::x86_64::*;

use super::finish_dot;
use crate::reduce::{combine_f32, combine_f64, LANES};

/// Sign flip of a float by xor-ing its sign bit: exactly `v * -1.0` for non-NaN `v`.
#[inline]
fn xor_sign(v: f32, bit: u32) -> f32 {
    f32::from_bits(v.to_bits() ^ bit)
}

#[inline]
#[target_feature(enable = "avx2")]
fn store8(acc: __m256) -> [f32; 8] {
    let mut out = [0.0f32; 8];
    // SAFETY: `out` holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
}

#[target_feature(enable = "avx2")]
pub(crate) fn norm_f64(x: &[f32]) -> f64 {
    let n8 = x.len() / 8 * 8;
    let p = x.as_ptr();
    let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= x.len().
        let v = unsafe { _mm256_loadu_ps(p.add(i)) };
        let a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        let b = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
        lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
        i += 8;
    }
    let mut acc = [0.0f64; 8];
    // SAFETY: `acc` holds 8 doubles.
    unsafe {
        _mm256_storeu_pd(acc.as_mut_ptr(), lo);
        _mm256_storeu_pd(acc.as_mut_ptr().add(4), hi);
    }
    for (j, &v) in x[n8..].iter().enumerate() {
        let v = f64::from(v);
        acc[j] += v * v;
    }
    combine_f64(&acc).sqrt()
}

#[target_feature(enable = "avx2")]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let n8 = n / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            let x = _mm256_loadu_ps(a.as_ptr().add(i));
            let y = _mm256_loadu_ps(b.as_ptr().add(i));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
        }
        i += 8;
    }
    finish_dot(store8(acc), &a[n8..n], &b[n8..n])
}

/// `out[r] = dot(mat[r*n..(r+1)*n], x)`, up to four rows at a time so each load of `x`
/// serves every accumulator of the block (a GQA group of 3 query rows is one block).
#[target_feature(enable = "avx2")]
pub(crate) fn dots(mat: &[f32], x: &[f32], out: &mut [f32]) {
    let n = x.len();
    debug_assert!(mat.len() >= out.len() * n);
    for (k, o) in out.chunks_mut(4).enumerate() {
        let m = &mat[4 * k * n..(4 * k + o.len()) * n];
        match o.len() {
            4 => dots_block::<4>(m, x, o),
            3 => dots_block::<3>(m, x, o),
            2 => dots_block::<2>(m, x, o),
            _ => dots_block::<1>(m, x, o),
        }
    }
}

/// [`dots`] for exactly `R` rows (`m` holds `R` rows of `x.len()`).
#[inline]
#[target_feature(enable = "avx2")]
fn dots_block<const R: usize>(m: &[f32], x: &[f32], out: &mut [f32]) {
    let n = x.len();
    let n8 = n / 8 * 8;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut i = 0;
    while i < n8 {
        // SAFETY: row q of the block spans m[q*n..(q+1)*n] and i + 8 <= n.
        unsafe {
            let xv = _mm256_loadu_ps(x.as_ptr().add(i));
            for (q, a) in acc.iter_mut().enumerate() {
                let v = _mm256_loadu_ps(m.as_ptr().add(q * n + i));
                *a = _mm256_add_ps(*a, _mm256_mul_ps(v, xv));
            }
        }
        i += 8;
    }
    for (q, a) in acc.iter().enumerate() {
        out[q] = finish_dot(store8(*a), &m[q * n + n8..(q + 1) * n], &x[n8..]);
    }
}

/// Butterflies of strides 1, 2, 4 inside one 8-float vector. Lane `k` with the partner
/// `s = v[k ^ h]`: the low lane of a pair takes `v + s` (= `a + b`), the high lane `s - v`
/// (= `a - b`), exactly the scalar `(a, b) -> (a + b, a - b)`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn fwht8(v: __m256) -> __m256 {
    let s = _mm256_permute_ps::<0b10_11_00_01>(v);
    let v = _mm256_blend_ps::<0b1010_1010>(_mm256_add_ps(v, s), _mm256_sub_ps(s, v));
    let s = _mm256_permute_ps::<0b01_00_11_10>(v);
    let v = _mm256_blend_ps::<0b1100_1100>(_mm256_add_ps(v, s), _mm256_sub_ps(s, v));
    let s = _mm256_permute2f128_ps::<1>(v, v);
    _mm256_blend_ps::<0b1111_0000>(_mm256_add_ps(v, s), _mm256_sub_ps(s, v))
}

/// Butterfly stages of stride `h0, 2 h0, ...` across vectors (`h0 >= 8`).
#[target_feature(enable = "avx2")]
pub(super) fn cross_stages(x: &mut [f32], h0: usize) {
    let p = x.as_mut_ptr();
    super::super::butterfly_pairs(x.len(), h0, 8, |j, h| {
        // SAFETY: j + h + 8 <= n (the pairs stay inside the row).
        unsafe {
            let a = _mm256_loadu_ps(p.add(j));
            let b = _mm256_loadu_ps(p.add(j + h));
            _mm256_storeu_ps(p.add(j), _mm256_add_ps(a, b));
            _mm256_storeu_ps(p.add(j + h), _mm256_sub_ps(a, b));
        }
    });
}

/// `x *= mult` (when given) then the transform; `x.len()` is a power of two >= 8.
#[target_feature(enable = "avx2")]
pub(crate) fn fwht(x: &mut [f32], mult: Option<&[f32]>) {
    let n = x.len();
    debug_assert!(n >= 8 && n.is_power_of_two() && mult.is_none_or(|m| m.len() >= n));
    let p = x.as_mut_ptr();
    let mut i = 0;
    while i < n {
        // SAFETY: i + 8 <= n <= mult.len().
        unsafe {
            let mut v = _mm256_loadu_ps(p.add(i));
            if let Some(m) = mult {
                v = _mm256_mul_ps(v, _mm256_loadu_ps(m.as_ptr().add(i)));
            }
            _mm256_storeu_ps(p.add(i), fwht8(v));
        }
        i += 8;
    }
    cross_stages(x, 8);
}

/// Codes of 8 values as 32-bit counts `#{j : table[j] <= v}` over the `2^bits - 1` real
/// boundaries: a linear count for up to 4 bits, a branch-free binary search (gathers over
/// the `+inf`-padded table) above.
#[inline]
#[target_feature(enable = "avx2")]
fn codes8(v: __m256, table: &[f32], bits: u32) -> __m256i {
    if bits <= 4 {
        let mut cnt = _mm256_setzero_si256();
        for &b in &table[..(1usize << bits) - 1] {
            let m = _mm256_cmp_ps::<_CMP_LE_OQ>(_mm256_set1_ps(b), v);
            cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(m));
        }
        cnt
    } else {
        let mut pos = _mm256_setzero_si256();
        let mut step = 1i32 << (bits - 1);
        while step > 0 {
            let idx = _mm256_add_epi32(pos, _mm256_set1_epi32(step - 1));
            // SAFETY: idx <= 2^bits - 1 < table.len() (binary-search invariant).
            let t = unsafe { _mm256_i32gather_ps::<4>(table.as_ptr(), idx) };
            let m = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(t, v));
            pos = _mm256_add_epi32(pos, _mm256_and_si256(m, _mm256_set1_epi32(step)));
            step >>= 1;
        }
        pos
    }
}

/// Eight 32-bit counts (< 256) as eight bytes.
#[inline]
#[target_feature(enable = "avx2")]
fn bytes8(c: __m256i) -> i64 {
    let w = _mm256_packus_epi32(c, c);
    let b = _mm256_packus_epi16(w, w);
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    _mm_cvtsi128_si64(_mm256_castsi256_si128(b))
}

/// `codes[i] = #{j : table[j] <= x[i] / div}` (`div = None`: no division).
#[target_feature(enable = "avx2")]
pub(crate) fn encode(x: &[f32], div: Option<f32>, table: &[f32], bits: u32, codes: &mut [u8]) {
    let n = x.len().min(codes.len());
    let n8 = n / 8 * 8;
    let dv = _mm256_set1_ps(div.unwrap_or(1.0));
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for x and codes.
        unsafe {
            let mut v = _mm256_loadu_ps(x.as_ptr().add(i));
            if div.is_some() {
                v = _mm256_div_ps(v, dv);
            }
            let c = bytes8(codes8(v, table, bits));
            codes.as_mut_ptr().add(i).cast::<i64>().write_unaligned(c);
        }
        i += 8;
    }
    super::super::scalar::encode(&x[n8..n], div, table, bits, &mut codes[n8..n]);
}

/// `out[i] = table[codes[i]] * mul`; `table` has 256 entries.
#[target_feature(enable = "avx2")]
pub(crate) fn decode(codes: &[u8], table: &[f32], bits: u32, mul: f32, out: &mut [f32]) {
    debug_assert!(table.len() >= 256);
    let n = codes.len().min(out.len());
    let n8 = n / 8 * 8;
    let mv = _mm256_set1_ps(mul);
    // SAFETY: table has 256 >= 16 entries.
    let (lo, hi) = unsafe {
        (
            _mm256_loadu_ps(table.as_ptr()),
            _mm256_loadu_ps(table.as_ptr().add(8)),
        )
    };
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for codes and out; gather indices are bytes < 256.
        unsafe {
            let idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(codes.as_ptr().add(i).cast()));
            let v = if bits <= 3 {
                _mm256_permutevar8x32_ps(lo, idx)
            } else if bits == 4 {
                let sel = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx));
                _mm256_blendv_ps(
                    _mm256_permutevar8x32_ps(lo, idx),
                    _mm256_permutevar8x32_ps(hi, idx),
                    sel,
                )
            } else {
                _mm256_i32gather_ps::<4>(table.as_ptr(), idx)
            };
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(v, mv));
        }
        i += 8;
    }
    for (o, &c) in out[n8..n].iter_mut().zip(&codes[n8..n]) {
        *o = table[usize::from(c)] * mul;
    }
}

/// `out[i] = (y[i] * mul) ^ sign_bit[i]` for `i < out.len()`.
#[target_feature(enable = "avx2")]
pub(crate) fn finish(y: &[f32], sign_bits: &[u32], mul: f32, out: &mut [f32]) {
    let n = out.len();
    debug_assert!(y.len() >= n && sign_bits.len() >= n);
    let n8 = n / 8 * 8;
    let mv = _mm256_set1_ps(mul);
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for all three slices.
        unsafe {
            let v = _mm256_mul_ps(_mm256_loadu_ps(y.as_ptr().add(i)), mv);
            let s = _mm256_loadu_si256(sign_bits.as_ptr().add(i).cast());
            let v = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(v), s));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
        }
        i += 8;
    }
    for i in n8..n {
        out[i] = xor_sign(y[i] * mul, sign_bits[i]);
    }
}

/// Packed sign bits `t[i] < 0` (one byte per 8 values, little-endian bit order).
#[target_feature(enable = "avx2")]
pub(crate) fn sign_bits(t: &[f32], out: &mut [u8]) {
    let n8 = t.len() / 8 * 8;
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= t.len().
        let v = unsafe { _mm256_loadu_ps(t.as_ptr().add(i)) };
        let m = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(v, _mm256_setzero_ps()));
        out[i / 8] = m as u8;
        i += 8;
    }
    super::super::scalar::sign_bits_from(&t[n8..], n8, out);
}

/// Bit `l` of a byte as an all-ones / zero 32-bit lane `l`, shifted into the sign bit.
#[inline]
#[target_feature(enable = "avx2")]
fn sign_mask8(byte: u8) -> __m256i {
    let sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let b = _mm256_and_si256(_mm256_set1_epi32(i32::from(byte)), sel);
    _mm256_slli_epi32::<31>(_mm256_cmpeq_epi32(b, sel))
}

/// `sum_i y[i] * sigma_i` with `sigma_i = -1` where bit i of `packed` is set, in the fixed
/// 8-lane order (multiplying by +-1 is exact, so it is a sign flip).
#[target_feature(enable = "avx2")]
pub(crate) fn dot_signs(y: &[f32], packed: &[u8]) -> f32 {
    let n8 = y.len() / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= y.len().
        let v = unsafe { _mm256_loadu_ps(y.as_ptr().add(i)) };
        let v = _mm256_xor_ps(v, _mm256_castsi256_ps(sign_mask8(packed[i / 8])));
        acc = _mm256_add_ps(acc, v);
        i += 8;
    }
    let mut acc = store8(acc);
    for (j, &v) in y[n8..].iter().enumerate() {
        let i = n8 + j;
        let sigma = 1.0 - 2.0 * f32::from((packed[i / 8] >> (i % 8)) & 1);
        acc[j] += v * sigma;
    }
    combine_f32(&acc)
}

/// `o += s` or `o -= s` elementwise.
#[target_feature(enable = "avx2")]
pub(crate) fn add_signed(o: &mut [f32], s: &[f32], negative: bool) {
    let n = o.len().min(s.len());
    let n8 = n / 8 * 8;
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            let a = _mm256_loadu_ps(o.as_ptr().add(i));
            let b = _mm256_loadu_ps(s.as_ptr().add(i));
            let r = if negative {
                _mm256_sub_ps(a, b)
            } else {
                _mm256_add_ps(a, b)
            };
            _mm256_storeu_ps(o.as_mut_ptr().add(i), r);
        }
        i += 8;
    }
    super::super::scalar::add_signed(&mut o[n8..n], &s[n8..n], negative);
}

/// `out[i] = table[code_i]` for a packed row of codes of at most 4 bits: eight codes span
/// `bits` whole bytes, read as one little-endian word and decoded by [`Unpack8`].
#[target_feature(enable = "avx2")]
pub(crate) fn decode_packed(packed: &[u8], bits: u32, table: &[f32], out: &mut [f32]) {
    debug_assert!(bits <= 4 && table.len() >= 256);
    let b = bits as usize;
    let n8 = out.len() / 8 * 8;
    let dec = Unpack8::new(bits, table);
    let mut i = 0;
    while i < n8 {
        let at = i / 8 * b;
        let w = if at + 4 <= packed.len() {
            // SAFETY: at + 4 <= packed.len().
            unsafe { packed.as_ptr().add(at).cast::<i32>().read_unaligned() }
        } else {
            // SAFETY: the b bytes of the eight codes lie in packed.
            unsafe { word(packed[at..at + b].as_ptr(), b) }
        };
        // SAFETY: i + 8 <= out.len().
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), dec.decode(w)) };
        i += 8;
    }
    if n8 == out.len() {
        return; // no tail: a block decode calls this once per row
    }
    let mut codes = [0u8; 8];
    let rest = &mut codes[..out.len() - n8];
    super::super::scalar::unpack_row(&packed[n8 / 8 * b..], bits, rest);
    for (o, &c) in out[n8..].iter_mut().zip(rest.iter()) {
        *o = table[usize::from(c)];
    }
}

/// [`super::super::scalar::axpy_many_f64`] with 32 sums per pass (eight vectors: enough
/// independent adds to hide their latency), the same multiplies and adds: the same bits.
#[target_feature(enable = "avx2")]
pub(crate) fn axpy_many_f64(acc: &mut [f64], w: &[f64], m: &[f32]) {
    super::super::scalar::axpy_many_f64_tiles::<32>(acc, w, m);
}

/// [`super::super::scalar::project_f64`] with 16 outputs per pass (four vectors of sums),
/// the same multiplies and adds: the same bits.
#[target_feature(enable = "avx2")]
pub(crate) fn project_f64(x: &[f64], m: &[f64], out: &mut [f32]) {
    super::super::scalar::project_f64_tiles::<16>(x, m, out);
}

/// `o *= k` elementwise.
#[target_feature(enable = "avx2")]
pub(crate) fn scale(o: &mut [f32], k: f32) {
    let n8 = o.len() / 8 * 8;
    let kv = _mm256_set1_ps(k);
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= o.len().
        unsafe {
            let p = o.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(p), kv));
        }
        i += 8;
    }
    o[n8..].iter_mut().for_each(|v| *v *= k);
}

/// `sum_i qu[i] * (s * (codes[i] - h))` in the fixed 8-lane order (HeadQ correction).
#[target_feature(enable = "avx2")]
pub(crate) fn dot_side(qu: &[f32], codes: &[u8], s: f32, h: f32) -> f32 {
    let n = qu.len().min(codes.len());
    let n8 = n / 8 * 8;
    let (sv, hv) = (_mm256_set1_ps(s), _mm256_set1_ps(h));
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for qu and codes.
        unsafe {
            let c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                codes.as_ptr().add(i).cast(),
            )));
            let z = _mm256_mul_ps(sv, _mm256_sub_ps(c, hv));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(qu.as_ptr().add(i)), z));
        }
        i += 8;
    }
    let mut acc = store8(acc);
    for (j, (&q, &c)) in qu[n8..n].iter().zip(&codes[n8..n]).enumerate() {
        acc[j] += q * (s * (f32::from(c) - h));
    }
    combine_f32(&acc)
}

/// Whether every value is finite (exponent not all ones).
#[target_feature(enable = "avx2")]
pub(crate) fn all_finite(x: &[f32]) -> bool {
    let n8 = x.len() / 8 * 8;
    let e = _mm256_set1_epi32(0x7f80_0000);
    let mut bad = _mm256_setzero_si256();
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= x.len().
        let v = unsafe { _mm256_loadu_si256(x.as_ptr().add(i).cast()) };
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(v, e), e));
        i += 8;
    }
    _mm256_testz_si256(bad, bad) == 1 && x[n8..].iter().all(|v| v.is_finite())
}

/// [`scalar::scale_max`](super::super::scalar::scale_max): `o *= k`, the exponent test and the
/// maximum in one pass, eight lanes at a time.
#[target_feature(enable = "avx2")]
pub(crate) fn scale_max(o: &mut [f32], k: f32) -> Option<f32> {
    let n8 = o.len() / 8 * 8;
    let (kv, e) = (_mm256_set1_ps(k), _mm256_set1_epi32(0x7f80_0000));
    let (mut bad, mut m) = (_mm256_setzero_si256(), _mm256_set1_ps(f32::NEG_INFINITY));
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= o.len().
        unsafe {
            let p = o.as_mut_ptr().add(i);
            let v = _mm256_mul_ps(_mm256_loadu_ps(p), kv);
            _mm256_storeu_ps(p, v);
            let bits = _mm256_and_si256(_mm256_castps_si256(v), e);
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(bits, e));
            m = _mm256_max_ps(m, v);
        }
        i += 8;
    }
    let tail = super::super::scalar::scale_max(&mut o[n8..], k)?;
    let lanes = store8(m);
    (_mm256_testz_si256(bad, bad) == 1).then(|| lanes.iter().fold(tail, |a, &v| a.max(v)))
}

/// `acc[i] += f64(x[i])`, four lanes at a time.
#[target_feature(enable = "avx2")]
pub(crate) fn add_to_f64(acc: &mut [f64], x: &[f32]) {
    let n = acc.len().min(x.len());
    let n4 = n / 4 * 4;
    let mut i = 0;
    while i < n4 {
        // SAFETY: i + 4 <= n for acc and x.
        unsafe {
            let a = acc.as_mut_ptr().add(i);
            let v = _mm256_cvtps_pd(_mm_loadu_ps(x.as_ptr().add(i)));
            _mm256_storeu_pd(a, _mm256_add_pd(_mm256_loadu_pd(a), v));
        }
        i += 4;
    }
    super::super::scalar::add_to_f64(&mut acc[n4..n], &x[n4..n]);
}

/// Eight lanes of [`scalar::exp`](super::super::scalar::exp): the same multiplies and adds in
/// the same order, round-to-nearest-even for `n`, 0 below `EXP_LO`.
#[inline]
#[target_feature(enable = "avx2")]
fn exp8(x: __m256) -> __m256 {
    use super::super::scalar::{EXP_C1, EXP_C2, EXP_HI, EXP_LO, EXP_P, LOG2E};
    let low = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
    let x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C1))),
        _mm256_mul_ps(n, _mm256_set1_ps(EXP_C2)),
    );
    let z = _mm256_mul_ps(r, r);
    let mut p = _mm256_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, z), r), _mm256_set1_ps(1.0));
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_andnot_ps(low, _mm256_mul_ps(y, _mm256_castsi256_ps(e)))
}

/// `x[i] = exp(x[i] - m)`, returning their float64 sum over the fixed 8 lanes.
#[target_feature(enable = "avx2")]
pub(crate) fn exp_sum(x: &mut [f32], m: f32) -> f64 {
    let n8 = x.len() / 8 * 8;
    let mv = _mm256_set1_ps(m);
    let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= x.len().
        unsafe {
            let p = x.as_mut_ptr().add(i);
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), mv));
            _mm256_storeu_ps(p, e);
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
        }
        i += 8;
    }
    let mut acc = [0.0f64; LANES];
    // SAFETY: acc holds 8 doubles.
    unsafe {
        _mm256_storeu_pd(acc.as_mut_ptr(), lo);
        _mm256_storeu_pd(acc.as_mut_ptr().add(4), hi);
    }
    super::super::scalar::exp_sum_tail(&mut x[n8..], m, &mut acc);
    combine_f64(&acc)
}

/// Float16 bit patterns to float32 (F16C), eight at a time.
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn f16_to_f32(src: &[u16], out: &mut [f32]) {
    let n = out.len().min(src.len());
    let n8 = n / 8 * 8;
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for src and out.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    super::super::scalar::f16_to_f32(&src[n8..n], &mut out[n8..n]);
}

/// `out[r * stride + k] = dot(q row r, token k)` for `R` query rows of `n` (a multiple of 8)
/// and the four tokens `k0 .. k0 + 4` (the first `keep` stored), `row(k, i)` holding values
/// `i .. i + 8` of token `k`: one 8-lane accumulator per (row, token); the four accumulators
/// of a query row are combined in one transposed pass in the order of `combine_f32`. A
/// token's lanes never meet another's, so tokens past `keep` change nothing stored.
#[inline]
#[target_feature(enable = "avx2")]
fn dots_tokens4<const R: usize>(
    q: &[f32],
    n: usize,
    row: &impl Fn(usize, usize) -> __m256,
    (k0, keep): (usize, usize),
    out: &mut [f32],
    stride: usize,
) {
    debug_assert!(q.len() >= R * n && n.is_multiple_of(8) && keep <= 4);
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut i = 0;
    while i < n {
        let t: [__m256; 4] = std::array::from_fn(|k| row(k0 + k, i));
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: row r < R of q holds n floats, and i + 8 <= n.
            let qv = unsafe { _mm256_loadu_ps(q.as_ptr().add(r * n + i)) };
            for (ak, &tk) in a.iter_mut().zip(&t) {
                *ak = _mm256_add_ps(*ak, _mm256_mul_ps(tk, qv));
            }
        }
        i += 8;
    }
    for (r, a) in acc.iter().enumerate() {
        let v = combine4(a);
        if keep == 4 {
            // SAFETY: out holds row r's four results at r * stride.
            unsafe { _mm_storeu_ps(out.as_mut_ptr().add(r * stride), v) };
        } else {
            let mut s = [0.0f32; 4];
            // SAFETY: s holds four floats.
            unsafe { _mm_storeu_ps(s.as_mut_ptr(), v) };
            out[r * stride..r * stride + keep].copy_from_slice(&s[..keep]);
        }
    }
}

/// The `combine_f32` of four 8-lane accumulators at once: lane `j` plus lane `j + 4`, then
/// lanes `0 + 2` and `1 + 3` of those, then their sum; returns the four results in order.
#[inline]
#[target_feature(enable = "avx2")]
fn combine4(a: &[__m256; 4]) -> __m128 {
    // [t0 lanes 0..4 + 4..8 | t1 ...], [t2 | t3]
    let s01 = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(a[0], a[1]),
        _mm256_permute2f128_ps::<0x31>(a[0], a[1]),
    );
    let s23 = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(a[2], a[3]),
        _mm256_permute2f128_ps::<0x31>(a[2], a[3]),
    );
    // [t0: b0 + b2, b1 + b3, t2: .., .. | t1: .., .., t3: .., ..]
    let t = _mm256_add_ps(
        _mm256_shuffle_ps::<0x44>(s01, s23),
        _mm256_shuffle_ps::<0xEE>(s01, s23),
    );
    // lanes 0, 2, 4, 6: t0, t2, t1, t3
    let u = _mm256_add_ps(t, _mm256_shuffle_ps::<0xB1>(t, t));
    let u = _mm256_permutevar8x32_ps(u, _mm256_setr_epi32(0, 4, 2, 6, 1, 3, 5, 7));
    _mm256_castps256_ps128(u)
}

/// `out[r * stride + k] = dot(q row r, x row k)` (the order of `reduce::dot`) for the
/// `q.len() / n` query rows and `x.len() / n` rows of `x`, `n` a multiple of 8: four
/// tokens at a time, up to three query rows sharing each load.
#[target_feature(enable = "avx2")]
pub(crate) fn dots_tokens(q: &[f32], x: &[f32], n: usize, out: &mut [f32], stride: usize) {
    let count = x.len() / n;
    let k4 = count / 4 * 4;
    // SAFETY: tokens k < k4 <= count hold n floats each, and i + 8 <= n.
    let row = |k: usize, i: usize| unsafe { _mm256_loadu_ps(x.as_ptr().add(k * n + i)) };
    dots_tokens_with(q, n, k4, &row, out, stride);
    // The last 1..3 tokens: one `dot` each (the same sums).
    for (r, qr) in q.chunks_exact(n).enumerate() {
        for k in k4..count {
            out[r * stride + k] = dot(qr, &x[k * n..(k + 1) * n]);
        }
    }
}

/// The scores of `count` tokens read through `row` ([`dots_tokens4`]), up to three query rows
/// and four tokens at a time (the last group of tokens may be partial).
#[inline]
#[target_feature(enable = "avx2")]
fn dots_tokens_with(
    q: &[f32],
    n: usize,
    count: usize,
    row: &impl Fn(usize, usize) -> __m256,
    out: &mut [f32],
    stride: usize,
) {
    super::query_blocks((q, n), (out, stride), 3, |qb, ob, rb| {
        for k in (0..count).step_by(4) {
            let (ks, ok) = ((k, (count - k).min(4)), &mut ob[k..]);
            match rb {
                3 => dots_tokens4::<3>(qb, n, row, ks, ok, stride),
                2 => dots_tokens4::<2>(qb, n, row, ks, ok, stride),
                _ => dots_tokens4::<1>(qb, n, row, ks, ok, stride),
            }
        }
    });
}

/// In-register table decode of eight packed codes of at most 4 bits from one little-endian word
/// (code `l` at bit `l * bits`): a broadcast, a variable shift per lane, then one 8-entry
/// permute of the table repeated every `2^bits` entries (the permute reads only the index's
/// low 3 bits, so the bits above the code need no mask); 4-bit codes permute both halves of
/// the table and blend on the code's bit 3. The values are exact copies of table entries.
#[derive(Clone, Copy)]
struct Unpack8 {
    shifts: __m256i,
    lo: __m256,
    hi: __m256,
    four: bool,
}

impl Unpack8 {
    #[inline]
    #[target_feature(enable = "avx2")]
    fn new(bits: u32, table: &[f32]) -> Self {
        debug_assert!(bits <= 4 && table.len() >= 16);
        let b = bits as i32;
        let lut: [f32; 8] = std::array::from_fn(|j| table[j & ((1 << b) - 1)]);
        // SAFETY: lut holds 8 floats, table at least 16.
        let (lo, hi) = unsafe {
            (
                _mm256_loadu_ps(lut.as_ptr()),
                _mm256_loadu_ps(table.as_ptr().add(8)),
            )
        };
        Self {
            shifts: _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b),
            lo,
            hi,
            four: bits == 4,
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn decode(&self, w: i32) -> __m256 {
        let idx = _mm256_srlv_epi32(_mm256_set1_epi32(w), self.shifts);
        let v = _mm256_permutevar8x32_ps(self.lo, idx);
        if !self.four {
            return v;
        }
        let sel = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx));
        _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(self.hi, idx), sel)
    }
}

/// The `bytes` (at most 4) bytes from `p` as a little-endian word, the rest zero; no byte
/// past them is read.
///
/// # Safety
/// `bytes` bytes are readable at `p`.
#[inline(always)]
unsafe fn word(p: *const u8, bytes: usize) -> i32 {
    let mut w = [0u8; 4];
    // SAFETY: the caller's `bytes` <= 4 bytes at p; w holds 4.
    unsafe { std::ptr::copy_nonoverlapping(p, w.as_mut_ptr(), bytes) };
    i32::from_le_bytes(w)
}

/// [`super::super::ops::dots_tokens_packed`]: eight codes at a time decoded in registers (the
/// values [`decode_packed`] stores) and fed to the arithmetic of [`dots_tokens`], so the
/// results are its bits; the last 1..3 tokens are a partial group of four. `n` a multiple of
/// 8, `bits` 1..=4; reads never pass the codes' `count * n * bits / 8` bytes.
#[target_feature(enable = "avx2")]
pub(crate) fn dots_tokens_packed(
    q: &[f32],
    (packed, count): (&[u8], usize),
    (bits, table): (u32, &[f32]),
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    let codes = (packed, count);
    match bits {
        1 => dots_tokens_packed_b::<1>(q, codes, table, n, out, stride),
        2 => dots_tokens_packed_b::<2>(q, codes, table, n, out, stride),
        3 => dots_tokens_packed_b::<3>(q, codes, table, n, out, stride),
        _ => dots_tokens_packed_b::<4>(q, codes, table, n, out, stride),
    }
}

/// [`dots_tokens_packed`] of `B`-bit codes (the word reads of a known size).
#[inline]
#[target_feature(enable = "avx2")]
fn dots_tokens_packed_b<const B: usize>(
    q: &[f32],
    (packed, count): (&[u8], usize),
    table: &[f32],
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    assert!(n.is_multiple_of(8) && packed.len() >= count * n * B / 8);
    let (dec, p) = (Unpack8::new(B as u32, table), packed.as_ptr());
    // Whole groups of four tokens: row pointers stepped, no per-code bounds choice.
    let full = count / 4 * 4;
    dots_tokens_blocks::<B>(q, n, (&dec, p), full, out, stride);
    if full == count {
        return;
    }
    // Eight codes (B bytes from byte (k n + i) B / 8) of token k from value i; tokens past
    // `count` are never stored and read nothing.
    let row = |k: usize, i: usize| {
        let w = if k < count {
            // SAFETY: k < count and i + 8 <= n: the B bytes lie in the asserted codes.
            unsafe { word(p.add((k * n + i) * B / 8), B) }
        } else {
            0
        };
        dec.decode(w)
    };
    let (rest, ob) = (count - full, &mut out[full..]);
    let row = |k: usize, i: usize| row(full + k, i);
    dots_tokens_with(q, n, rest, &row, ob, stride);
}

/// [`dots_tokens_with`] of the first `full` (a multiple of 4) tokens of `B`-bit codes from
/// `p` (token `k` at byte `k * n * B / 8`), read by [`dots_tokens4_packed`].
#[inline]
#[target_feature(enable = "avx2")]
fn dots_tokens_blocks<const B: usize>(
    q: &[f32],
    n: usize,
    (dec, p): (&Unpack8, *const u8),
    full: usize,
    out: &mut [f32],
    stride: usize,
) {
    let token_bytes = n * B / 8;
    super::query_blocks((q, n), (out, stride), 3, |qb, ob, rb| {
        for k in (0..full).step_by(4) {
            let at = p.wrapping_add(k * token_bytes);
            // SAFETY: tokens k .. k + 4 <= full lie in the caller's codes.
            unsafe {
                match rb {
                    3 => dots_tokens4_packed::<3, B>(qb, n, dec, at, &mut ob[k..], stride),
                    2 => dots_tokens4_packed::<2, B>(qb, n, dec, at, &mut ob[k..], stride),
                    _ => dots_tokens4_packed::<1, B>(qb, n, dec, at, &mut ob[k..], stride),
                }
            }
        }
    });
}

/// [`dots_tokens4`] of four whole tokens of `B`-bit codes from `p` (token `k` at
/// `p + k * n * B / 8`).
///
/// # Safety
/// The four tokens' `4 n B / 8` bytes are readable from `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dots_tokens4_packed<const R: usize, const B: usize>(
    q: &[f32],
    n: usize,
    dec: &Unpack8,
    p: *const u8,
    out: &mut [f32],
    stride: usize,
) {
    debug_assert!(q.len() >= R * n && n.is_multiple_of(8));
    let token_bytes = n * B / 8;
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut at = p;
    let mut i = 0;
    while i < n {
        // SAFETY: values i .. i + 8 of token k: B bytes inside the caller's codes.
        let t: [__m256; 4] =
            std::array::from_fn(|k| dec.decode(unsafe { word(at.add(k * token_bytes), B) }));
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: row r < R of q holds n floats, and i + 8 <= n.
            let qv = unsafe { _mm256_loadu_ps(q.as_ptr().add(r * n + i)) };
            for (ak, &tk) in a.iter_mut().zip(&t) {
                *ak = _mm256_add_ps(*ak, _mm256_mul_ps(tk, qv));
            }
        }
        at = at.wrapping_add(B);
        i += 8;
    }
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: out holds row r's four results at r * stride.
        unsafe { _mm_storeu_ps(out.as_mut_ptr().add(r * stride), combine4(a)) };
    }
}

/// [`super::super::ops::axpy_rows`] for one weight per token (`groups == 1`) or `group` a
/// multiple of 8 (each register lies in one group): up to three query rows at once, four
/// registers (32 values) of each per pass, the last `n % 8` values in scalar lanes.
#[target_feature(enable = "avx2")]
pub(crate) fn axpy_rows(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    mat: &[f32],
    stride: usize,
) {
    let x = |c: usize, at: usize, valid: usize| {
        let row = &mat[c * stride + at..];
        if valid == 8 {
            // SAFETY: row holds at least 8 floats (at + 8 <= n).
            unsafe { _mm256_loadu_ps(row.as_ptr()) }
        } else {
            let mut b = [0.0f32; 8];
            b[..valid].copy_from_slice(&row[..valid]);
            // SAFETY: b holds 8 floats.
            unsafe { _mm256_loadu_ps(b.as_ptr()) }
        }
    };
    axpy_rows_with((o, rows), w, (groups, group), &x);
}

/// [`super::super::ops::axpy_rows_packed`]: the rows' codes are decoded in registers (the values
/// [`decode_packed`] stores) and fed to the arithmetic of [`axpy_rows`], so the results are its
/// bits. `bits` 1..=4, `groups == 1` or `group` a multiple of 8; row `c` from byte
/// `c * row_bytes`; reads never pass a row's `ceil(n * bits / 8)` bytes.
#[target_feature(enable = "avx2")]
pub(crate) fn axpy_rows_packed(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    (packed, row_bytes, bits, table): (&[u8], usize, u32, &[f32]),
) {
    let (ow, gs, rows_) = ((o, rows), (groups, group), (packed, row_bytes, table));
    match bits {
        1 => axpy_rows_packed_b::<1>(ow, w, gs, rows_),
        2 => axpy_rows_packed_b::<2>(ow, w, gs, rows_),
        3 => axpy_rows_packed_b::<3>(ow, w, gs, rows_),
        _ => axpy_rows_packed_b::<4>(ow, w, gs, rows_),
    }
}

/// [`axpy_rows_packed`] of `B`-bit codes (the word reads of a known size).
#[inline]
#[target_feature(enable = "avx2")]
fn axpy_rows_packed_b<const B: usize>(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    (packed, row_bytes, table): (&[u8], usize, &[f32]),
) {
    let n = o.len() / rows;
    let count = w.len() / (rows * groups);
    assert!(count == 0 || packed.len() >= (count - 1) * row_bytes + (n * B).div_ceil(8));
    let (dec, p) = (Unpack8::new(B as u32, table), packed.as_ptr());
    if n.is_multiple_of(16) {
        let (gs, at) = ((groups, group), (p, row_bytes));
        return super::row_blocks((o, rows), w, 3, |ob, wb, rb| {
            // SAFETY: the `count` rows' codes lie in `packed` (asserted above).
            unsafe {
                match (rb, groups) {
                    (3, 1) => axpy_rows_packed16::<3, B, false>(ob, wb, gs, &dec, at),
                    (2, 1) => axpy_rows_packed16::<2, B, false>(ob, wb, gs, &dec, at),
                    (_, 1) => axpy_rows_packed16::<1, B, false>(ob, wb, gs, &dec, at),
                    (3, _) => axpy_rows_packed16::<3, B, true>(ob, wb, gs, &dec, at),
                    (2, _) => axpy_rows_packed16::<2, B, true>(ob, wb, gs, &dec, at),
                    _ => axpy_rows_packed16::<1, B, true>(ob, wb, gs, &dec, at),
                }
            }
        });
    }
    // Codes `at .. at + valid` of row c (`at` a multiple of 8: from a whole byte).
    let x = |c: usize, at: usize, valid: usize| {
        // SAFETY: the (valid B).div_ceil(8) bytes of the codes lie in row c (asserted above).
        let w = unsafe { word(p.add(c * row_bytes + at * B / 8), (valid * B).div_ceil(8)) };
        dec.decode(w)
    };
    axpy_rows_with((o, rows), w, (groups, group), &x);
}

/// [`axpy_pass`] over rows of a multiple of 16 values of `B`-bit codes (row `c` at
/// `p + c * row_bytes`): every pass of two registers, the row pointer stepped; one weight per
/// token (`GROUPS` false) or per group of `group` (a multiple of 8) values.
///
/// # Safety
/// The rows' codes lie in one allocation.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn axpy_rows_packed16<const R: usize, const B: usize, const GROUPS: bool>(
    o: &mut [f32],
    w: &[f32],
    (groups, group): (usize, usize),
    dec: &Unpack8,
    (p, row_bytes): (*const u8, usize),
) {
    let (n, count) = (o.len() / R, w.len() / (R * groups));
    debug_assert!(o.len() == R * n && n.is_multiple_of(16) && groups == n.div_ceil(group));
    let mut i = 0;
    while i < n {
        // Each register's group (a register lies in one group).
        let g: [usize; 2] = std::array::from_fn(|v| if GROUPS { (i + 8 * v) / group } else { 0 });
        // SAFETY: lanes i .. i + 16 lie in each of the R rows of o; w holds R x count x groups
        // weights and g[v] < groups; the rows' codes are the caller's, B bytes per eight
        // values.
        unsafe {
            let mut acc: [[__m256; 2]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|v| _mm256_loadu_ps(o.as_ptr().add(r * n + i + 8 * v)))
            });
            let mut at = p.add(i * B / 8);
            for c in 0..count {
                let xs: [__m256; 2] = std::array::from_fn(|v| dec.decode(word(at.add(v * B), B)));
                for (r, a) in acc.iter_mut().enumerate() {
                    let wr = w.as_ptr().add((r * count + c) * groups);
                    let one = _mm256_set1_ps(*wr);
                    for ((av, &xv), &gv) in a.iter_mut().zip(&xs).zip(&g) {
                        let wv = if GROUPS {
                            _mm256_set1_ps(*wr.add(gv))
                        } else {
                            one
                        };
                        *av = _mm256_add_ps(*av, _mm256_mul_ps(wv, xv));
                    }
                }
                at = at.wrapping_add(row_bytes);
            }
            for (r, a) in acc.iter().enumerate() {
                for (v, av) in a.iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add(r * n + i + 8 * v), *av);
                }
            }
        }
        i += 16;
    }
}

/// [`axpy_rows`] with row `c`'s values `at .. at + 8` (the first `valid`; the other lanes are
/// never stored) read by `x(c, at, valid)`.
#[inline]
#[target_feature(enable = "avx2")]
fn axpy_rows_with(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    x: &impl Fn(usize, usize, usize) -> __m256,
) {
    let shape = (o.len() / rows, w.len() / (rows * groups), groups, group);
    super::row_blocks((o, rows), w, 3, |ob, wb, rb| match rb {
        3 => axpy_rows_r::<3>(ob, wb, shape, x),
        2 => axpy_rows_r::<2>(ob, wb, shape, x),
        _ => axpy_rows_r::<1>(ob, wb, shape, x),
    });
}

/// [`axpy_rows`] of `R` query rows (`o`: R x n, `w`: R x count x groups): passes of two
/// registers (16 values) over every token, so the 2 R accumulators, the decoded values and the
/// table stay in the 16 ymm registers (four registers a pass spill on AVX2).
#[inline]
#[target_feature(enable = "avx2")]
fn axpy_rows_r<const R: usize>(
    o: &mut [f32],
    w: &[f32],
    shape: (usize, usize, usize, usize),
    x: &impl Fn(usize, usize, usize) -> __m256,
) {
    let (n, count, groups, group) = shape;
    debug_assert!(o.len() == R * n && w.len() == R * count * groups);
    let n8 = n / 8 * 8;
    let mut i = 0;
    while i + 16 <= n8 {
        axpy_pass::<R, 2>(o, w, shape, x, i);
        i += 16;
    }
    if i < n8 {
        axpy_pass::<R, 1>(o, w, shape, x, i);
    }
    if n8 < n {
        // The last n % 8 values: each row's term in scalar lanes, in increasing c.
        for c in 0..count {
            let mut xs = [0.0f32; 8];
            // SAFETY: xs holds 8 floats.
            unsafe { _mm256_storeu_ps(xs.as_mut_ptr(), x(c, n8, n - n8)) };
            for (r, or) in o.chunks_exact_mut(n).enumerate() {
                let wc = &w[(r * count + c) * groups..(r * count + c + 1) * groups];
                for (j, a) in or.iter_mut().enumerate().skip(n8) {
                    *a += wc[j / group] * xs[j - n8];
                }
            }
        }
    }
}

/// One pass of [`axpy_rows_r`]: values `i .. i + 8 V` of the `R` rows, every token's term
/// added in increasing token order (the reference's order per value).
#[inline]
#[target_feature(enable = "avx2")]
fn axpy_pass<const R: usize, const V: usize>(
    o: &mut [f32],
    w: &[f32],
    (n, count, groups, group): (usize, usize, usize, usize),
    x: &impl Fn(usize, usize, usize) -> __m256,
    i: usize,
) {
    let g: [usize; V] = std::array::from_fn(|v| (i + 8 * v) / group);
    // SAFETY: i + 8 V <= n in each row of o (the caller's passes); w holds R x count x groups
    // weights and g[v] < groups.
    unsafe {
        let mut acc: [[__m256; V]; R] = std::array::from_fn(|r| {
            std::array::from_fn(|v| _mm256_loadu_ps(o.as_ptr().add(r * n + i + 8 * v)))
        });
        for c in 0..count {
            let xs: [__m256; V] = std::array::from_fn(|v| x(c, i + 8 * v, 8));
            for (r, a) in acc.iter_mut().enumerate() {
                let wr = w.as_ptr().add((r * count + c) * groups);
                for v in 0..V {
                    let wv = _mm256_set1_ps(*wr.add(g[v]));
                    a[v] = _mm256_add_ps(a[v], _mm256_mul_ps(wv, xs[v]));
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (v, av) in a.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(r * n + i + 8 * v), *av);
            }
        }
    }
}

/// [`super::super::ops::zero_point_sums`]: four groups of up to four query rows per pass, one
/// f64 register per row (lane `g`), so each token's zero points are loaded and converted once
/// for every row; each sum is its own lane, added in increasing `k` as in the reference.
#[target_feature(enable = "avx2")]
pub(crate) fn zero_point_sums(
    (p, n, at): (&[f32], usize, usize),
    (ze, groups): (&[f32], usize),
    count: usize,
    (acc, stride, offset): (&mut [f64], usize, usize),
) {
    let rows = p.len() / n;
    assert!(ze.len() >= count * groups && (rows == 0 || at + count <= n));
    let mut g0 = 0;
    while g0 < groups {
        let w = (groups - g0).min(4);
        let mut r0 = 0;
        while r0 < rows {
            let rb = (rows - r0).min(4);
            let (pb, ab) = (
                &p[r0 * n..(r0 + rb) * n],
                &mut acc[r0 * stride + offset + g0..],
            );
            let shape = (n, at, groups, g0, w, count, stride);
            match rb {
                4 => zero_point_block::<4>(pb, ze, shape, ab),
                3 => zero_point_block::<3>(pb, ze, shape, ab),
                2 => zero_point_block::<2>(pb, ze, shape, ab),
                _ => zero_point_block::<1>(pb, ze, shape, ab),
            }
            r0 += rb;
        }
        g0 += w;
    }
}

/// [`zero_point_sums`] of `R` query rows (`p`: R x n) and the `w` (1..=4) groups from `g0`;
/// `acc` from the first row's first sum.
#[inline]
#[target_feature(enable = "avx2")]
fn zero_point_block<const R: usize>(
    p: &[f32],
    ze: &[f32],
    (n, at, groups, g0, w, count, stride): (usize, usize, usize, usize, usize, usize, usize),
    acc: &mut [f64],
) {
    let mut buf = [0.0f64; 4];
    let mut a: [__m256d; R] = std::array::from_fn(|r| {
        buf[..w].copy_from_slice(&acc[r * stride..r * stride + w]);
        // SAFETY: buf holds 4 f64.
        unsafe { _mm256_loadu_pd(buf.as_ptr()) }
    });
    let z = ze.as_ptr().wrapping_add(g0);
    for k in 0..count {
        // SAFETY: the w floats from k * groups + g0 lie in ze (count * groups <= ze.len(),
        // g0 + w <= groups); lanes past w are zero and never stored.
        let zk = unsafe {
            let zp = z.add(k * groups);
            match w {
                4 => _mm_loadu_ps(zp),
                2 => _mm_castpd_ps(_mm_load_sd(zp.cast())),
                1 => _mm_load_ss(zp),
                _ => _mm_setr_ps(*zp, *zp.add(1), *zp.add(2), 0.0),
            }
        };
        let zk = _mm256_cvtps_pd(zk);
        for (r, ar) in a.iter_mut().enumerate() {
            let pk = _mm256_set1_pd(f64::from(p[r * n + at + k]));
            *ar = _mm256_add_pd(*ar, _mm256_mul_pd(pk, zk));
        }
    }
    for (r, ar) in a.iter().enumerate() {
        // SAFETY: buf holds 4 f64.
        unsafe { _mm256_storeu_pd(buf.as_mut_ptr(), *ar) };
        acc[r * stride..r * stride + w].copy_from_slice(&buf[..w]);
    }
}
