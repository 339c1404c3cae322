//! AVX2 and AVX-512 versions of the row primitives in `ops`. Each function performs exactly the
//! floating-point operations of its scalar reference, element by element, in the same order:
//! no fused multiply-add, division kept as division, the fixed 8-lane reduction order of
//! `reduce.rs` (the f32 dot products use 8-lane accumulators even under AVX-512). Ragged tails
//! are finished by the scalar code on the same accumulators.
//!
//! Safety: every function here is `#[target_feature]`; `ops` only calls them for an [`Isa`]
//! that [`Isa::is_supported`] confirmed (the `bmi2` module: a supported `PackPath::Bmi2`). Pointer accesses stay inside the slices, as the
//! comments at each `unsafe` block show.
//!
//! [`Isa`]: super::Isa
//! [`Isa::is_supported`]: super::Isa::is_supported

use std::arch::x86_64::*;

use crate::reduce::{combine_f32, combine_f64, LANES};

/// Finishes an 8-lane f32 accumulator: adds the tail `a[i] * b[i]` to lane `i` (the tail starts
/// at a multiple of 8) and combines in the fixed order.
#[inline]
fn finish_dot(mut acc: [f32; LANES], a: &[f32], b: &[f32]) -> f32 {
    for (j, (x, y)) in a.iter().zip(b).enumerate() {
        acc[j] += x * y;
    }
    combine_f32(&acc)
}

/// Sign flip of a float by xor-ing its sign bit: exactly `v * -1.0` for non-NaN `v`.
#[inline]
fn xor_sign(v: f32, bit: u32) -> f32 {
    f32::from_bits(v.to_bits() ^ bit)
}

/// The BMI2 pack path ([`super::PackPath::Bmi2`]): one `pext`/`pdep` per eight codes.
pub(super) mod bmi2 {
    use std::arch::x86_64::{_pdep_u64, _pext_u64};

    use crate::simd::shift::{pack_groups, unpack_groups};

    /// The mask of the low `bits` bits of each of eight bytes.
    fn code_mask(bits: u32) -> u64 {
        0x0101_0101_0101_0101u64 * ((1u64 << bits) - 1)
    }

    /// Packs with BMI2: `pext` gathers the low `bits` bits of eight code bytes into `8 * bits`
    /// contiguous bits, which is the little-endian bit stream of the format.
    #[target_feature(enable = "bmi2")]
    pub(crate) fn pack_row(codes: &[u8], bits: u32, out: &mut [u8]) {
        let mask = code_mask(bits);
        pack_groups(codes, bits, out, |w| _pext_u64(w, mask));
    }

    /// Unpacks with BMI2 `pdep`, the inverse of [`pack_row`].
    #[target_feature(enable = "bmi2")]
    pub(crate) fn unpack_row(packed: &[u8], bits: u32, out: &mut [u8]) {
        let mask = code_mask(bits);
        unpack_groups(packed, bits, out, |w| _pdep_u64(w, mask));
    }
}

pub(super) mod avx2 {
    use super::*;

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
    /// `bits` whole bytes, read as one little-endian word and split by variable shifts (code
    /// `l` sits at bit `l * bits`), then looked up by register permutes as in [`decode`].
    #[target_feature(enable = "avx2")]
    pub(crate) fn decode_packed(packed: &[u8], bits: u32, table: &[f32], out: &mut [f32]) {
        debug_assert!(bits <= 4 && table.len() >= 256);
        let b = bits as usize;
        let n8 = out.len() / 8 * 8;
        let bv = bits as i32;
        let shifts = _mm256_setr_epi32(0, bv, 2 * bv, 3 * bv, 4 * bv, 5 * bv, 6 * bv, 7 * bv);
        let mask = _mm256_set1_epi32((1 << bits) - 1);
        // SAFETY: table has 256 >= 16 entries.
        let (lo, hi) = unsafe {
            (
                _mm256_loadu_ps(table.as_ptr()),
                _mm256_loadu_ps(table.as_ptr().add(8)),
            )
        };
        let mut i = 0;
        while i < n8 {
            let at = i / 8 * b;
            let w = if at + 4 <= packed.len() {
                // SAFETY: at + 4 <= packed.len().
                unsafe { packed.as_ptr().add(at).cast::<i32>().read_unaligned() }
            } else {
                let mut w = [0u8; 4];
                w[..b].copy_from_slice(&packed[at..at + b]);
                i32::from_le_bytes(w)
            };
            let idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), shifts), mask);
            let v = if bits <= 3 {
                _mm256_permutevar8x32_ps(lo, idx)
            } else {
                let sel = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx));
                _mm256_blendv_ps(
                    _mm256_permutevar8x32_ps(lo, idx),
                    _mm256_permutevar8x32_ps(hi, idx),
                    sel,
                )
            };
            // SAFETY: i + 8 <= out.len().
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), v) };
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

    /// `acc[i] += w * f64(x[i])` for `i < acc.len()`: four f64 lanes per register.
    #[target_feature(enable = "avx2")]
    pub(crate) fn axpy_f64(acc: &mut [f64], w: f64, x: &[f32]) {
        let n = acc.len().min(x.len());
        let n8 = n / 8 * 8;
        let wv = _mm256_set1_pd(w);
        let (a, xp) = (acc.as_mut_ptr(), x.as_ptr());
        let mut i = 0;
        while i < n8 {
            // SAFETY: i + 8 <= n for acc and x.
            unsafe {
                let v = _mm256_loadu_ps(xp.add(i));
                let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
                let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
                let s0 = _mm256_add_pd(_mm256_loadu_pd(a.add(i)), _mm256_mul_pd(wv, lo));
                let s1 = _mm256_add_pd(_mm256_loadu_pd(a.add(i + 4)), _mm256_mul_pd(wv, hi));
                _mm256_storeu_pd(a.add(i), s0);
                _mm256_storeu_pd(a.add(i + 4), s1);
            }
            i += 8;
        }
        super::super::scalar::axpy_f64(&mut acc[n8..n], w, &x[n8..n]);
    }

    /// `o[i] += sum_c w[c] * mat[c * stride + i]` in increasing `c`, eight lanes of `o` held
    /// in a register over every `c`.
    #[target_feature(enable = "avx2")]
    pub(crate) fn axpy_rows_f32(o: &mut [f32], w: &[f32], mat: &[f32], stride: usize) {
        let n = o.len();
        let n8 = n / 8 * 8;
        let mut i = 0;
        // Four registers (32 values) per pass: four independent addition chains in flight.
        while i + 32 <= n8 {
            // SAFETY: i + 32 <= n; row c spans mat[c*stride..c*stride+n] (the caller's bound).
            unsafe {
                let mut acc: [__m256; 4] =
                    std::array::from_fn(|v| _mm256_loadu_ps(o.as_ptr().add(i + 8 * v)));
                for (c, &wc) in w.iter().enumerate() {
                    let wv = _mm256_set1_ps(wc);
                    let row = mat.as_ptr().add(c * stride + i);
                    for (v, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, _mm256_loadu_ps(row.add(8 * v))));
                    }
                }
                for (v, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add(i + 8 * v), *a);
                }
            }
            i += 32;
        }
        while i < n8 {
            // SAFETY: i + 8 <= n; row c spans mat[c*stride..c*stride+n] (the caller's bound).
            unsafe {
                let mut acc = _mm256_loadu_ps(o.as_ptr().add(i));
                for (c, &wc) in w.iter().enumerate() {
                    let v = _mm256_loadu_ps(mat.as_ptr().add(c * stride + i));
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(wc), v));
                }
                _mm256_storeu_ps(o.as_mut_ptr().add(i), acc);
            }
            i += 8;
        }
        for (j, oj) in o.iter_mut().enumerate().skip(n8) {
            for (c, &wc) in w.iter().enumerate() {
                *oj += wc * mat[c * stride + j];
            }
        }
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

    /// Eight lanes of [`scalar::exp`](super::super::scalar::exp): the same multiplies and adds in
    /// the same order, round-to-nearest-even for `n`, 0 below `EXP_LO`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn exp8(x: __m256) -> __m256 {
        use super::super::scalar::{EXP_C1, EXP_C2, EXP_HI, EXP_LO, EXP_P, LOG2E};
        let low = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
        let x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
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

    /// `out[r * stride + k] = dot(q row r, x row k)` for `R` query rows of `n` (a multiple of 8)
    /// and four rows of `x`, one 8-lane accumulator per (row, token); the four accumulators of
    /// a query row are combined in one transposed pass in the order of `combine_f32`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dots_tokens4<const R: usize>(
        q: &[f32],
        x: &[f32],
        n: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        debug_assert!(q.len() >= R * n && x.len() >= 4 * n && n.is_multiple_of(8));
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let mut i = 0;
        while i < n {
            // SAFETY: rows r < R of q and k < 4 of x hold n floats each, and i + 8 <= n.
            unsafe {
                let t: [__m256; 4] =
                    std::array::from_fn(|k| _mm256_loadu_ps(x.as_ptr().add(k * n + i)));
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(r * n + i));
                    for (ak, &tk) in a.iter_mut().zip(&t) {
                        *ak = _mm256_add_ps(*ak, _mm256_mul_ps(tk, qv));
                    }
                }
            }
            i += 8;
        }
        for (r, a) in acc.iter().enumerate() {
            let v = combine4(a);
            // SAFETY: out holds row r's four results at r * stride.
            unsafe { _mm_storeu_ps(out.as_mut_ptr().add(r * stride), v) };
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
        let (rows, count) = (q.len() / n, x.len() / n);
        let mut r = 0;
        while r < rows {
            let rb = (rows - r).min(3);
            let (qb, ob) = (&q[r * n..(r + rb) * n], &mut out[r * stride..]);
            let mut k = 0;
            while k + 4 <= count {
                let (xk, ok) = (&x[k * n..(k + 4) * n], &mut ob[k..]);
                match rb {
                    3 => dots_tokens4::<3>(qb, xk, n, ok, stride),
                    2 => dots_tokens4::<2>(qb, xk, n, ok, stride),
                    _ => dots_tokens4::<1>(qb, xk, n, ok, stride),
                }
                k += 4;
            }
            for k in k..count {
                for j in 0..rb {
                    ob[j * stride + k] = dot(&qb[j * n..(j + 1) * n], &x[k * n..(k + 1) * n]);
                }
            }
            r += rb;
        }
    }

    /// [`super::super::ops::axpy_rows_grouped`] for `group` and `o.len()` multiples of 8: each
    /// register lies in one group; four registers per pass.
    #[target_feature(enable = "avx2")]
    pub(crate) fn axpy_rows_grouped(
        o: &mut [f32],
        w: &[f32],
        (groups, group): (usize, usize),
        mat: &[f32],
        stride: usize,
    ) {
        let n = o.len();
        debug_assert!(n.is_multiple_of(8));
        let rows = w.len() / groups;
        let mut i = 0;
        while i < n {
            let regs = ((n - i) / 8).min(4);
            // SAFETY: i + 8 * regs <= n; row c spans mat[c*stride..c*stride+n].
            unsafe {
                let mut acc: [__m256; 4] = std::array::from_fn(|v| {
                    if v < regs {
                        _mm256_loadu_ps(o.as_ptr().add(i + 8 * v))
                    } else {
                        _mm256_setzero_ps()
                    }
                });
                for c in 0..rows {
                    let row = mat.as_ptr().add(c * stride + i);
                    for (v, a) in acc.iter_mut().enumerate().take(regs) {
                        let wv = _mm256_set1_ps(w[c * groups + (i + 8 * v) / group]);
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, _mm256_loadu_ps(row.add(8 * v))));
                    }
                }
                for (v, a) in acc.iter().enumerate().take(regs) {
                    _mm256_storeu_ps(o.as_mut_ptr().add(i + 8 * v), *a);
                }
            }
            i += 8 * regs;
        }
    }
}

pub(super) mod avx512 {
    use super::*;

    /// Tail mask of the first `n` lanes (n <= 16).
    #[inline]
    fn mask16(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    /// The lane masks of four 16-lane registers from index `i` of a row of `n` values (0 for a
    /// register wholly past the end).
    #[inline]
    fn masks4(n: usize, i: usize) -> [__mmask16; 4] {
        std::array::from_fn(|v| mask16(n.saturating_sub(i + 16 * v).min(16)))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn norm_f64(x: &[f32]) -> f64 {
        let n8 = x.len() / 8 * 8;
        let mut acc = _mm512_setzero_pd();
        let mut i = 0;
        while i < n8 {
            // SAFETY: i + 8 <= x.len().
            let v = _mm512_cvtps_pd(unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) });
            acc = _mm512_add_pd(acc, _mm512_mul_pd(v, v));
            i += 8;
        }
        let mut a = [0.0f64; 8];
        // SAFETY: `a` holds 8 doubles.
        unsafe { _mm512_storeu_pd(a.as_mut_ptr(), acc) };
        for (j, &v) in x[n8..].iter().enumerate() {
            let v = f64::from(v);
            a[j] += v * v;
        }
        combine_f64(&a).sqrt()
    }

    /// Two matrix rows side by side in one 16-lane register: lanes 0..8 accumulate row `r`,
    /// lanes 8..16 row `r + 1`, each still an 8-lane accumulator in the reference order.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn dots(mat: &[f32], x: &[f32], out: &mut [f32]) {
        let n = x.len();
        let n8 = n / 8 * 8;
        let rows = out.len();
        debug_assert!(mat.len() >= rows * n);
        let mut r = 0;
        while r + 4 <= rows {
            let m = &mat[r * n..(r + 4) * n];
            let (mut a01, mut a23) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut i = 0;
            while i < n8 {
                // SAFETY: row q of the block spans m[q*n..(q+1)*n] and i + 8 <= n.
                unsafe {
                    let xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(
                        _mm256_loadu_ps(x.as_ptr().add(i)),
                    )));
                    let row =
                        |q: usize| _mm256_castps_pd(_mm256_loadu_ps(m.as_ptr().add(q * n + i)));
                    let v01 = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                        _mm512_castpd256_pd512(row(0)),
                        row(1),
                    ));
                    let v23 = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                        _mm512_castpd256_pd512(row(2)),
                        row(3),
                    ));
                    a01 = _mm512_add_ps(a01, _mm512_mul_ps(v01, xv));
                    a23 = _mm512_add_ps(a23, _mm512_mul_ps(v23, xv));
                }
                i += 8;
            }
            let mut acc = [[0.0f32; 8]; 4];
            // SAFETY: each pair of `acc` rows is 16 contiguous floats.
            unsafe {
                _mm512_storeu_ps(acc.as_mut_ptr().cast(), a01);
                _mm512_storeu_ps(acc.as_mut_ptr().add(2).cast(), a23);
            }
            for (q, a) in acc.into_iter().enumerate() {
                out[r + q] = finish_dot(a, &m[q * n + n8..(q + 1) * n], &x[n8..]);
            }
            r += 4;
        }
        // The last 1..3 rows as one block; AVX2 is part of this path's features, so the call
        // needs no `unsafe`.
        super::avx2::dots(&mat[r * n..], x, &mut out[r..]);
    }

    /// Butterflies of strides 1, 2, 4, 8 inside one 16-float vector (see `avx2::fwht8`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fwht16(v: __m512) -> __m512 {
        let s = _mm512_permute_ps::<0b10_11_00_01>(v);
        let v = _mm512_mask_sub_ps(_mm512_add_ps(v, s), 0xAAAA, s, v);
        let s = _mm512_permute_ps::<0b01_00_11_10>(v);
        let v = _mm512_mask_sub_ps(_mm512_add_ps(v, s), 0xCCCC, s, v);
        let s = _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v);
        let v = _mm512_mask_sub_ps(_mm512_add_ps(v, s), 0xF0F0, s, v);
        let s = _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v);
        _mm512_mask_sub_ps(_mm512_add_ps(v, s), 0xFF00, s, v)
    }

    /// Butterfly stages of stride `h0, 2 h0, ...` across vectors (`h0 >= 16`).
    #[target_feature(enable = "avx512f")]
    fn cross_stages(x: &mut [f32], h0: usize) {
        let p = x.as_mut_ptr();
        super::super::butterfly_pairs(x.len(), h0, 16, |j, h| {
            // SAFETY: j + h + 16 <= n (the pairs stay inside the row).
            unsafe {
                let a = _mm512_loadu_ps(p.add(j));
                let b = _mm512_loadu_ps(p.add(j + h));
                _mm512_storeu_ps(p.add(j), _mm512_add_ps(a, b));
                _mm512_storeu_ps(p.add(j + h), _mm512_sub_ps(a, b));
            }
        });
    }

    /// `x *= mult` (when given) then the transform; `x.len()` is a power of two >= 16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn fwht(x: &mut [f32], mult: Option<&[f32]>) {
        let n = x.len();
        debug_assert!(n >= 16 && n.is_power_of_two() && mult.is_none_or(|m| m.len() >= n));
        let p = x.as_mut_ptr();
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= n <= mult.len().
            unsafe {
                let mut v = _mm512_loadu_ps(p.add(i));
                if let Some(m) = mult {
                    v = _mm512_mul_ps(v, _mm512_loadu_ps(m.as_ptr().add(i)));
                }
                _mm512_storeu_ps(p.add(i), fwht16(v));
            }
            i += 16;
        }
        cross_stages(x, 16);
    }

    /// Codes of 16 values: a branch-free binary search over the `+inf`-padded boundary table,
    /// held in a register for up to 4 bits (16 entries), gathered above.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn codes16(v: __m512, t16: __m512, table: &[f32], bits: u32) -> __m512i {
        let mut pos = _mm512_setzero_si512();
        let mut step = 1i32 << (bits - 1);
        while step > 0 {
            let idx = _mm512_add_epi32(pos, _mm512_set1_epi32(step - 1));
            let t = if bits <= 4 {
                _mm512_permutexvar_ps(idx, t16)
            } else {
                // SAFETY: idx <= 2^bits - 1 < table.len() (binary-search invariant).
                unsafe { _mm512_i32gather_ps::<4>(idx, table.as_ptr()) }
            };
            let m = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(t, v);
            pos = _mm512_mask_add_epi32(pos, m, pos, _mm512_set1_epi32(step));
            step >>= 1;
        }
        pos
    }

    /// `codes[i] = #{j : table[j] <= x[i] / div}` (`div = None`: no division); `table` is the
    /// boundary table padded with `+inf` to at least 16 entries.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn encode(x: &[f32], div: Option<f32>, table: &[f32], bits: u32, codes: &mut [u8]) {
        debug_assert!(table.len() >= 16);
        let n = x.len().min(codes.len());
        let dv = _mm512_set1_ps(div.unwrap_or(1.0));
        // SAFETY: table has at least 16 entries.
        let t16 = unsafe { _mm512_loadu_ps(table.as_ptr()) };
        let mut i = 0;
        while i < n {
            let k = mask16((n - i).min(16));
            // SAFETY: the masked lanes stay below n for x and codes.
            unsafe {
                let mut v = _mm512_maskz_loadu_ps(k, x.as_ptr().add(i));
                if div.is_some() {
                    v = _mm512_div_ps(v, dv);
                }
                let c = codes16(v, t16, table, bits);
                _mm512_mask_cvtepi32_storeu_epi8(codes.as_mut_ptr().add(i).cast(), k, c);
            }
            i += 16;
        }
    }

    /// `out[i] = table[codes[i]] * mul`; `table` has 256 entries.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn decode(codes: &[u8], table: &[f32], bits: u32, mul: f32, out: &mut [f32]) {
        debug_assert!(table.len() >= 256);
        let n = codes.len().min(out.len());
        let mv = _mm512_set1_ps(mul);
        // SAFETY: table has 256 >= 32 entries.
        let (t0, t1) = unsafe {
            (
                _mm512_loadu_ps(table.as_ptr()),
                _mm512_loadu_ps(table.as_ptr().add(16)),
            )
        };
        let mut i = 0;
        while i < n {
            let k = mask16((n - i).min(16));
            // SAFETY: the masked lanes stay below n; gather indices are bytes < 256.
            unsafe {
                let idx =
                    _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes.as_ptr().add(i).cast()));
                let v = if bits <= 4 {
                    _mm512_permutexvar_ps(idx, t0)
                } else if bits == 5 {
                    _mm512_permutex2var_ps(t0, idx, t1)
                } else {
                    _mm512_i32gather_ps::<4>(idx, table.as_ptr())
                };
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), k, _mm512_mul_ps(v, mv));
            }
            i += 16;
        }
    }

    /// The butterfly stages across the `K` registers of a row held in registers (strides of
    /// 16, 32, ... floats), after `fwht16` did the strides inside each register.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn cross_stages_regs<const K: usize>(v: &mut [__m512; K]) {
        let mut h = 1;
        while h < K {
            for block in (0..K).step_by(2 * h) {
                for j in block..block + h {
                    let (a, b) = (v[j], v[j + h]);
                    v[j] = _mm512_add_ps(a, b);
                    v[j + h] = _mm512_sub_ps(a, b);
                }
            }
            h *= 2;
        }
    }

    /// The whole MSE encode of one row with the rotation, in registers, for `d' = 16 K`:
    /// the float64 norm (8 lanes, the reference order; masked-off lanes add `+0.0`), the sign
    /// and scale, all butterflies, the division by the norm and the code search, with no
    /// round trip through memory. Returns the norm (non-finite: the caller reports it).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn mse_encode_row<const K: usize>(
        x: &[f32],
        mult: &[f32],
        table: &[f32],
        bits: u32,
        zero_code: u8,
        codes: &mut [u8],
    ) -> f32 {
        let d = x.len();
        debug_assert!(
            d <= 16 * K && mult.len() >= 16 * K && codes.len() >= 16 * K && table.len() >= 16
        );
        let mut v = [_mm512_setzero_ps(); K];
        let mut acc = _mm512_setzero_pd();
        for (k, vk) in v.iter_mut().enumerate() {
            let m = mask16(d.saturating_sub(16 * k).min(16));
            // SAFETY: the masked load reads only lanes below d; mult has 16 K entries.
            let (xv, mv) = unsafe {
                (
                    _mm512_maskz_loadu_ps(m, x.as_ptr().add(16 * k)),
                    _mm512_loadu_ps(mult.as_ptr().add(16 * k)),
                )
            };
            let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(xv));
            let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(xv),
            )));
            acc = _mm512_add_pd(acc, _mm512_mul_pd(lo, lo));
            acc = _mm512_add_pd(acc, _mm512_mul_pd(hi, hi));
            *vk = fwht16(_mm512_mul_ps(xv, mv));
        }
        let mut a = [0.0f64; 8];
        // SAFETY: `a` holds 8 doubles.
        unsafe { _mm512_storeu_pd(a.as_mut_ptr(), acc) };
        let norm = combine_f64(&a).sqrt() as f32;
        if !norm.is_finite() {
            return norm;
        }
        if norm == 0.0 {
            codes[..16 * K].fill(zero_code);
            return norm;
        }
        cross_stages_regs(&mut v);
        // SAFETY: table has at least 16 entries.
        let t16 = unsafe { _mm512_loadu_ps(table.as_ptr()) };
        let nv = _mm512_set1_ps(norm);
        for (k, vk) in v.iter().enumerate() {
            let c = codes16(_mm512_div_ps(*vk, nv), t16, table, bits);
            // SAFETY: codes has 16 K bytes.
            unsafe {
                _mm_storeu_si128(
                    codes.as_mut_ptr().add(16 * k).cast(),
                    _mm512_cvtepi32_epi8(c),
                )
            };
        }
        norm
    }

    /// The whole MSE decode of one row with the rotation, in registers, for `d' = 16 K`:
    /// lookup in the table of `centroid * scale`, all butterflies, then `+-(v * norm)` for the
    /// first `out.len()` coordinates.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn mse_decode_row<const K: usize>(
        codes: &[u8],
        table: &[f32],
        bits: u32,
        sign_bits: &[u32],
        norm: f32,
        out: &mut [f32],
    ) {
        let d = out.len();
        debug_assert!(
            d <= 16 * K && codes.len() >= 16 * K && sign_bits.len() >= 16 * K && table.len() >= 256
        );
        // SAFETY: table has 256 >= 32 entries.
        let (t0, t1) = unsafe {
            (
                _mm512_loadu_ps(table.as_ptr()),
                _mm512_loadu_ps(table.as_ptr().add(16)),
            )
        };
        let mut v = [_mm512_setzero_ps(); K];
        for (k, vk) in v.iter_mut().enumerate() {
            // SAFETY: codes has 16 K bytes; gather indices are bytes < 256.
            unsafe {
                let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr().add(16 * k).cast()));
                let t = if bits <= 4 {
                    _mm512_permutexvar_ps(idx, t0)
                } else if bits == 5 {
                    _mm512_permutex2var_ps(t0, idx, t1)
                } else {
                    _mm512_i32gather_ps::<4>(idx, table.as_ptr())
                };
                *vk = fwht16(t);
            }
        }
        cross_stages_regs(&mut v);
        let nv = _mm512_set1_ps(norm);
        for (k, vk) in v.iter().enumerate() {
            let m = mask16(d.saturating_sub(16 * k).min(16));
            // SAFETY: sign_bits has 16 K entries; the masked store writes lanes below d only.
            unsafe {
                let s = _mm512_loadu_si512(sign_bits.as_ptr().add(16 * k).cast());
                let r = _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(*vk, nv)), s);
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(16 * k), m, _mm512_castsi512_ps(r));
            }
        }
    }

    /// `out[i] = (y[i] * mul) ^ sign_bit[i]` for `i < out.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn finish(y: &[f32], sign_bits: &[u32], mul: f32, out: &mut [f32]) {
        let n = out.len();
        debug_assert!(y.len() >= n && sign_bits.len() >= n);
        let mv = _mm512_set1_ps(mul);
        let mut i = 0;
        while i < n {
            let k = mask16((n - i).min(16));
            // SAFETY: the masked lanes stay below n for all three slices.
            unsafe {
                let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, y.as_ptr().add(i)), mv);
                let s = _mm512_maskz_loadu_epi32(k, sign_bits.as_ptr().add(i).cast());
                let v = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), s));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), k, v);
            }
            i += 16;
        }
    }

    /// `o += s` or `o -= s` elementwise.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn add_signed(o: &mut [f32], s: &[f32], negative: bool) {
        let n = o.len().min(s.len());
        let mut i = 0;
        while i < n {
            let k = mask16((n - i).min(16));
            // SAFETY: the masked lanes stay below n for both slices.
            unsafe {
                let a = _mm512_maskz_loadu_ps(k, o.as_ptr().add(i));
                let b = _mm512_maskz_loadu_ps(k, s.as_ptr().add(i));
                let r = if negative {
                    _mm512_sub_ps(a, b)
                } else {
                    _mm512_add_ps(a, b)
                };
                _mm512_mask_storeu_ps(o.as_mut_ptr().add(i), k, r);
            }
            i += 16;
        }
    }

    /// `acc[i] += w * f64(x[i])` for `i < acc.len()`: eight f64 lanes, masked tail.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn axpy_f64(acc: &mut [f64], w: f64, x: &[f32]) {
        let n = acc.len().min(x.len());
        let wv = _mm512_set1_pd(w);
        let mut i = 0;
        while i < n {
            let k = ((1u32 << (n - i).min(8)) - 1) as __mmask8;
            // SAFETY: the masked lanes stay below n for acc and x.
            unsafe {
                let v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(k, x.as_ptr().add(i)));
                let a = _mm512_maskz_loadu_pd(k, acc.as_ptr().add(i));
                let r = _mm512_add_pd(a, _mm512_mul_pd(wv, v));
                _mm512_mask_storeu_pd(acc.as_mut_ptr().add(i), k, r);
            }
            i += 8;
        }
    }

    /// `o[i] += sum_c w[c] * mat[c * stride + i]` in increasing `c`, sixteen lanes of `o` held
    /// in a register over every `c`, masked tail.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn axpy_rows_f32(o: &mut [f32], w: &[f32], mat: &[f32], stride: usize) {
        let n = o.len();
        let mut i = 0;
        // Up to four registers (64 values) per pass: independent addition chains in flight.
        while i < n {
            let regs = (n - i).div_ceil(16).min(4);
            let k = masks4(n, i);
            // SAFETY: the masked lanes stay below n in o and in each row c of mat (at c*stride).
            unsafe {
                let mut acc: [__m512; 4] = std::array::from_fn(|v| {
                    _mm512_maskz_loadu_ps(k[v], o.as_ptr().add(i + 16 * v.min(regs - 1)))
                });
                for (c, &wc) in w.iter().enumerate() {
                    let wv = _mm512_set1_ps(wc);
                    let row = mat.as_ptr().add(c * stride + i);
                    for (v, a) in acc.iter_mut().enumerate().take(regs) {
                        let x = _mm512_maskz_loadu_ps(k[v], row.add(16 * v));
                        *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, x));
                    }
                }
                for (v, a) in acc.iter().enumerate().take(regs) {
                    _mm512_mask_storeu_ps(o.as_mut_ptr().add(i + 16 * v), k[v], *a);
                }
            }
            i += 16 * regs;
        }
    }

    /// [`decode_packed`] of short rows `row_bytes` apart (`out` holds rows x `len`): the
    /// row decoder inlined into one loop, its constants loaded once.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn decode_packed_rows(
        packed: &[u8],
        (row_bytes, len): (usize, usize),
        bits: u32,
        table: &[f32],
        out: &mut [f32],
    ) {
        for (r, o) in out.chunks_exact_mut(len).enumerate() {
            decode_packed(&packed[r * row_bytes..], bits, table, o);
        }
    }

    /// `out[i] = table[code_i]` for a packed row of `bits`-bit codes (`bits <= 3`): sixteen
    /// codes per step from one 8-byte read; lane `i` takes the two bytes holding bits
    /// `i * bits ..` as a 16-bit word (a byte shuffle), widened, shifted and masked, then one
    /// 16-entry permute. Four bits: [`decode_packed4`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn decode_packed(packed: &[u8], bits: u32, table: &[f32], out: &mut [f32]) {
        debug_assert!((1..=4).contains(&bits) && table.len() >= 256);
        if bits == 4 {
            return decode_packed4(packed, table, out);
        }
        let b = bits as usize;
        let (mut pat, mut sh) = ([0i8; 32], [0i32; 16]);
        for i in 0..16 {
            let bit = i * b;
            // Byte indices within a 128-bit half: both halves hold the same 8 bytes.
            pat[2 * i] = (bit / 8) as i8;
            pat[2 * i + 1] = pat[2 * i] + 1;
            sh[i] = (bit % 8) as i32;
        }
        // SAFETY: pat holds 32 bytes, sh 16 lanes, table 256 >= 16 entries.
        let (pat, shifts, lut) = unsafe {
            (
                _mm256_loadu_si256(pat.as_ptr().cast()),
                _mm512_loadu_si512(sh.as_ptr().cast()),
                _mm512_loadu_ps(table.as_ptr()),
            )
        };
        let mask = _mm512_set1_epi32((1 << bits) - 1);
        // Steps whose 8-byte read stays inside `packed` (16 codes take 2 * bits bytes).
        let steps = (out.len() / 16).min((packed.len() + 2 * b).saturating_sub(8) / (2 * b));
        for k in 0..steps {
            // SAFETY: 2 b k + 8 <= packed.len() (the bound of `steps`); 16k + 16 <= out.len().
            unsafe {
                let x = _mm_loadl_epi64(packed.as_ptr().add(2 * b * k).cast());
                let words = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(x), pat);
                let idx = _mm512_and_si512(
                    _mm512_srlv_epi32(_mm512_cvtepu16_epi32(words), shifts),
                    mask,
                );
                _mm512_storeu_ps(
                    out.as_mut_ptr().add(16 * k),
                    _mm512_permutexvar_ps(idx, lut),
                );
            }
        }
        let done = 16 * steps;
        // AVX2 is part of this path's features, so the call needs no `unsafe`.
        if done < out.len() {
            super::avx2::decode_packed(&packed[done * b / 8..], bits, table, &mut out[done..]);
        }
    }

    /// `out[i] = table[code_i]` for a packed row of 4-bit codes: sixteen codes (eight bytes)
    /// per step, each byte duplicated, widened to 32-bit lanes and shifted by 0 or 4, then one
    /// 16-entry permute.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn decode_packed4(packed: &[u8], table: &[f32], out: &mut [f32]) {
        debug_assert!(table.len() >= 256);
        let n16 = out.len() / 16 * 16;
        let dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        let shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        let mask = _mm512_set1_epi32(15);
        // SAFETY: table has 256 >= 16 entries.
        let lut = unsafe { _mm512_loadu_ps(table.as_ptr()) };
        let mut i = 0;
        while i < n16 {
            // SAFETY: the 8 bytes of codes i .. i + 16 are in the row (i + 16 <= out.len());
            // i + 16 <= out.len() for the store.
            unsafe {
                let b = _mm_loadl_epi64(packed.as_ptr().add(i / 2).cast());
                let idx = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(b, dup));
                let idx = _mm512_and_si512(_mm512_srlv_epi32(idx, shifts), mask);
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_permutexvar_ps(idx, lut));
            }
            i += 16;
        }
        // AVX2 is part of this path's features, so the call needs no `unsafe`.
        if n16 < out.len() {
            super::avx2::decode_packed(&packed[n16 / 2..], 4, table, &mut out[n16..]);
        }
    }

    /// Whether every value is finite (exponent not all ones).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn all_finite(x: &[f32]) -> bool {
        let e = _mm512_set1_epi32(0x7f80_0000);
        let mut bad: __mmask16 = 0;
        let mut i = 0;
        while i < x.len() {
            let k = mask16((x.len() - i).min(16));
            // SAFETY: the masked lanes stay below x.len().
            let v = unsafe { _mm512_maskz_loadu_epi32(k, x.as_ptr().add(i).cast()) };
            bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, e), e);
            i += 16;
        }
        bad == 0
    }

    /// Sixteen lanes of [`scalar::exp`](super::super::scalar::exp) (see `avx2::exp8`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn exp16(x: __m512) -> __m512 {
        use super::super::scalar::{EXP_C1, EXP_C2, EXP_HI, EXP_LO, EXP_P, LOG2E};
        let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(EXP_LO));
        let x = _mm512_min_ps(x, _mm512_set1_ps(EXP_HI));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_sub_ps(
            _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_C1))),
            _mm512_mul_ps(n, _mm512_set1_ps(EXP_C2)),
        );
        let z = _mm512_mul_ps(r, r);
        let mut p = _mm512_set1_ps(EXP_P[0]);
        for &c in &EXP_P[1..] {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, z), r), _mm512_set1_ps(1.0));
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(e))
    }

    /// `x[i] = exp(x[i] - m)`, returning their float64 sum over the fixed 8 lanes (the two
    /// halves of each 16 added in token order).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn exp_sum(x: &mut [f32], m: f32) -> f64 {
        let n16 = x.len() / 16 * 16;
        let mv = _mm512_set1_ps(m);
        let mut acc8 = _mm512_setzero_pd();
        let mut i = 0;
        while i < n16 {
            // SAFETY: i + 16 <= x.len().
            unsafe {
                let p = x.as_mut_ptr().add(i);
                let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p), mv));
                _mm512_storeu_ps(p, e);
                let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
                let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(e),
                )));
                acc8 = _mm512_add_pd(_mm512_add_pd(acc8, lo), hi);
            }
            i += 16;
        }
        let mut acc = [0.0f64; LANES];
        // SAFETY: acc holds 8 doubles.
        unsafe { _mm512_storeu_pd(acc.as_mut_ptr(), acc8) };
        super::super::scalar::exp_sum_tail(&mut x[n16..], m, &mut acc);
        combine_f64(&acc)
    }

    /// Float16 bit patterns to float32, sixteen at a time, masked tail.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn f16_to_f32(src: &[u16], out: &mut [f32]) {
        let n = out.len().min(src.len());
        let mut i = 0;
        while i < n {
            let k = mask16((n - i).min(16));
            // SAFETY: the masked lanes stay below n for src and out.
            unsafe {
                let h = _mm256_maskz_loadu_epi16(k, src.as_ptr().add(i).cast());
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), k, _mm512_cvtph_ps(h));
            }
            i += 16;
        }
    }

    /// `out[r * stride + k] = dot(q row r, x row k)` for `R` query rows of `n` (a multiple of 8)
    /// and eight rows of `x`: two tokens per register (lanes 0..8 and 8..16, each an 8-lane
    /// accumulator in the reference order), combined in one transposed pass.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn dots_tokens8<const R: usize>(
        q: &[f32],
        x: &[f32],
        n: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        debug_assert!(q.len() >= R * n && x.len() >= 8 * n && n.is_multiple_of(8));
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        let mut i = 0;
        while i < n {
            // SAFETY: rows r < R of q and k < 8 of x hold n floats each, and i + 8 <= n.
            unsafe {
                let row = |k: usize| _mm256_castps_pd(_mm256_loadu_ps(x.as_ptr().add(k * n + i)));
                let t: [__m512; 4] = std::array::from_fn(|p| {
                    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                        _mm512_castpd256_pd512(row(2 * p)),
                        row(2 * p + 1),
                    ))
                });
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(
                        _mm256_loadu_ps(q.as_ptr().add(r * n + i)),
                    )));
                    for (ap, &tp) in a.iter_mut().zip(&t) {
                        *ap = _mm512_add_ps(*ap, _mm512_mul_ps(tp, qv));
                    }
                }
            }
            i += 8;
        }
        for (r, a) in acc.iter().enumerate() {
            let v = combine8(a);
            // SAFETY: out holds row r's eight results at r * stride.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), v) };
        }
    }

    /// The `combine_f32` of eight 8-lane accumulators (two per register) at once: lane `j`
    /// plus lane `j + 4`, then lanes `0 + 2` and `1 + 3` of those, then their sum; returns
    /// the eight results in token order.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn combine8(a: &[__m512; 4]) -> __m256 {
        // 128-bit blocks: token k's lanes j + (j + 4), tokens 0..4 and 4..8.
        let s01 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a[0], a[1]),
            _mm512_shuffle_f32x4::<0xDD>(a[0], a[1]),
        );
        let s23 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a[2], a[3]),
            _mm512_shuffle_f32x4::<0xDD>(a[2], a[3]),
        );
        // block k: [token k: b0 + b2, b1 + b3, token k + 4: b0 + b2, b1 + b3]
        let t = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(s01, s23),
            _mm512_shuffle_ps::<0xEE>(s01, s23),
        );
        // lane 4k: token k, lane 4k + 2: token k + 4
        let u = _mm512_add_ps(t, _mm512_shuffle_ps::<0xB1>(t, t));
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, u))
    }

    /// [`super::avx2::dots_tokens`] eight tokens at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn dots_tokens(q: &[f32], x: &[f32], n: usize, out: &mut [f32], stride: usize) {
        let (rows, count) = (q.len() / n, x.len() / n);
        let k8 = count / 8 * 8;
        let mut r = 0;
        while r < rows {
            let rb = (rows - r).min(4);
            let (qb, ob) = (&q[r * n..(r + rb) * n], &mut out[r * stride..]);
            let mut k = 0;
            while k < k8 {
                let (xk, ok) = (&x[k * n..(k + 8) * n], &mut ob[k..]);
                match rb {
                    4 => dots_tokens8::<4>(qb, xk, n, ok, stride),
                    3 => dots_tokens8::<3>(qb, xk, n, ok, stride),
                    2 => dots_tokens8::<2>(qb, xk, n, ok, stride),
                    _ => dots_tokens8::<1>(qb, xk, n, ok, stride),
                }
                k += 8;
            }
            r += rb;
        }
        // The last 1..7 tokens; AVX2 is part of this path's features.
        if k8 < count {
            super::avx2::dots_tokens(q, &x[k8 * n..], n, &mut out[k8..], stride);
        }
    }

    /// [`super::super::ops::axpy_rows_grouped`] for `group` a multiple of 16: each register
    /// lies in one group; four registers per pass, the tail masked.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(crate) fn axpy_rows_grouped(
        o: &mut [f32],
        w: &[f32],
        (groups, group): (usize, usize),
        mat: &[f32],
        stride: usize,
    ) {
        let n = o.len();
        let rows = w.len() / groups;
        let mut i = 0;
        while i < n {
            let regs = (n - i).div_ceil(16).min(4);
            let k = masks4(n, i);
            // SAFETY: the masked lanes stay below n in o and in each row c of mat (at c*stride).
            unsafe {
                let mut acc: [__m512; 4] = std::array::from_fn(|v| {
                    _mm512_maskz_loadu_ps(k[v], o.as_ptr().add(i + 16 * v.min(regs - 1)))
                });
                for c in 0..rows {
                    let row = mat.as_ptr().add(c * stride + i);
                    for (v, a) in acc.iter_mut().enumerate().take(regs) {
                        let wv = _mm512_set1_ps(w[c * groups + (i + 16 * v) / group]);
                        let x = _mm512_maskz_loadu_ps(k[v], row.add(16 * v));
                        *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, x));
                    }
                }
                for (v, a) in acc.iter().enumerate().take(regs) {
                    _mm512_mask_storeu_ps(o.as_mut_ptr().add(i + 16 * v), k[v], *a);
                }
            }
            i += 16 * regs;
        }
    }
}
