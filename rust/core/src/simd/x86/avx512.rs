use std::arch::x86_64::*;

use super::finish_dot;
use crate::reduce::{combine_f64, LANES};

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
                let row = |q: usize| _mm256_castps_pd(_mm256_loadu_ps(m.as_ptr().add(q * n + i)));
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
            let idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes.as_ptr().add(i).cast()));
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

/// [`super::super::scalar::axpy_many_f64`] with 64 sums per pass (eight vectors: enough
/// independent adds to hide their latency), the same multiplies and adds: the same bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) fn axpy_many_f64(acc: &mut [f64], w: &[f64], m: &[f32]) {
    super::super::scalar::axpy_many_f64_tiles::<64>(acc, w, m);
}

/// [`super::super::scalar::project_f64`] with 32 outputs per pass (four vectors of sums),
/// the same multiplies and adds: the same bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) fn project_f64(x: &[f64], m: &[f64], out: &mut [f32]) {
    super::super::scalar::project_f64_tiles::<32>(x, m, out);
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
    match bits {
        1 => return decode_packed1(packed, table, out),
        4 => return decode_packed4(packed, table, out),
        _ => {}
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

/// `out[i] = table[code_i]` for a packed row of 1-bit codes (QJL signs): sixteen codes
/// (two bytes, code `i` at bit `i`) are the mask of one blend of `table[0]` and `table[1]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) fn decode_packed1(packed: &[u8], table: &[f32], out: &mut [f32]) {
    let n16 = out.len() / 16 * 16;
    let (zero, one) = (_mm512_set1_ps(table[0]), _mm512_set1_ps(table[1]));
    for (i, pair) in packed[..n16 / 8].chunks_exact(2).enumerate() {
        let mask = u16::from_le_bytes([pair[0], pair[1]]);
        // SAFETY: 16 i + 16 <= n16 <= out.len().
        unsafe {
            _mm512_storeu_ps(
                out.as_mut_ptr().add(16 * i),
                _mm512_mask_blend_ps(mask, zero, one),
            );
        }
    }
    // AVX2 is part of this path's features, so the call needs no `unsafe`.
    if n16 < out.len() {
        super::avx2::decode_packed(&packed[n16 / 8..], 1, table, &mut out[n16..]);
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

/// [`scalar::scale_max`](super::super::scalar::scale_max): `o *= k`, the exponent test and the
/// maximum in one pass, sixteen lanes at a time (the tail masked).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) fn scale_max(o: &mut [f32], k: f32) -> Option<f32> {
    let (kv, e) = (_mm512_set1_ps(k), _mm512_set1_epi32(0x7f80_0000));
    let (mut bad, mut m): (__mmask16, _) = (0, _mm512_set1_ps(f32::NEG_INFINITY));
    let mut i = 0;
    while i < o.len() {
        let km = mask16((o.len() - i).min(16));
        // SAFETY: the masked lanes stay below o.len().
        unsafe {
            let p = o.as_mut_ptr().add(i);
            let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(km, p), kv);
            _mm512_mask_storeu_ps(p, km, v);
            let bits = _mm512_and_si512(_mm512_castps_si512(v), e);
            bad |= _mm512_mask_cmpeq_epi32_mask(km, bits, e);
            m = _mm512_mask_max_ps(m, km, m, v);
        }
        i += 16;
    }
    (bad == 0).then(|| _mm512_reduce_max_ps(m))
}

/// `acc[i] += f64(x[i])`, eight lanes at a time (the tail masked).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) fn add_to_f64(acc: &mut [f64], x: &[f32]) {
    let n = acc.len().min(x.len());
    let mut i = 0;
    while i < n {
        let km = ((1u32 << (n - i).min(8)) - 1) as __mmask8;
        // SAFETY: the masked lanes stay below n for acc and x.
        unsafe {
            let a = acc.as_mut_ptr().add(i);
            let v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(km, x.as_ptr().add(i)));
            _mm512_mask_storeu_pd(a, km, _mm512_add_pd(_mm512_maskz_loadu_pd(km, a), v));
        }
        i += 8;
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
/// and the eight tokens `k0 .. k0 + 8` (the first `keep` stored): two tokens per register
/// (lanes 0..8 and 8..16, each an 8-lane accumulator in the reference order; `pair(k, i)`
/// holds values `i .. i + 8` of tokens `k` and `k + 1`), combined in one transposed pass.
/// A token's lanes never meet another's, so tokens past `keep` change nothing stored.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn dots_tokens8<const R: usize>(
    q: &[f32],
    n: usize,
    pair: &impl Fn(usize, usize) -> __m512,
    (k0, keep): (usize, usize),
    out: &mut [f32],
    stride: usize,
) {
    debug_assert!(q.len() >= R * n && n.is_multiple_of(8) && keep <= 8);
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut i = 0;
    while i < n {
        let t: [__m512; 4] = std::array::from_fn(|p| pair(k0 + 2 * p, i));
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: row r < R of q holds n floats, and i + 8 <= n.
            let qv = unsafe {
                _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(
                    q.as_ptr().add(r * n + i),
                ))))
            };
            for (ap, &tp) in a.iter_mut().zip(&t) {
                *ap = _mm512_add_ps(*ap, _mm512_mul_ps(tp, qv));
            }
        }
        i += 8;
    }
    for (r, a) in acc.iter().enumerate() {
        let v = combine8(a);
        // SAFETY: out holds row r's first `keep` results at r * stride.
        unsafe {
            let o = out.as_mut_ptr().add(r * stride);
            if keep == 8 {
                _mm256_storeu_ps(o, v);
            } else {
                _mm256_mask_storeu_ps(o, ((1u32 << keep) - 1) as __mmask8, v);
            }
        }
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
    let count = x.len() / n;
    let k8 = count / 8 * 8;
    let pair = |k: usize, i: usize| {
        // SAFETY: tokens k, k + 1 < k8 <= count hold n floats each, and i + 8 <= n.
        unsafe {
            let row = |k: usize| _mm256_castps_pd(_mm256_loadu_ps(x.as_ptr().add(k * n + i)));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(row(k)),
                row(k + 1),
            ))
        }
    };
    dots_tokens_with(q, n, k8, &pair, out, stride);
    // The last 1..7 tokens; AVX2 is part of this path's features.
    if k8 < count {
        super::avx2::dots_tokens(q, &x[k8 * n..], n, &mut out[k8..], stride);
    }
}

/// The scores of `count` tokens read through `pair` ([`dots_tokens8`]), up to four query rows
/// and eight tokens at a time (the last group of tokens may be partial).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn dots_tokens_with(
    q: &[f32],
    n: usize,
    count: usize,
    pair: &impl Fn(usize, usize) -> __m512,
    out: &mut [f32],
    stride: usize,
) {
    super::query_blocks((q, n), (out, stride), 4, |qb, ob, rb| {
        for k in (0..count).step_by(8) {
            let (ks, ok) = ((k, (count - k).min(8)), &mut ob[k..]);
            match rb {
                4 => dots_tokens8::<4>(qb, n, pair, ks, ok, stride),
                3 => dots_tokens8::<3>(qb, n, pair, ks, ok, stride),
                2 => dots_tokens8::<2>(qb, n, pair, ks, ok, stride),
                _ => dots_tokens8::<1>(qb, n, pair, ks, ok, stride),
            }
        }
    });
}

/// In-register table decode of sixteen packed codes of 2..=4 bits: lanes below `split` take
/// the 32-bit word at the first pointer, the others the word at the second (two broadcast
/// loads and a blend), each shifted by its lane's bit offset, then one 16-entry permute of the
/// table repeated every `2^bits` entries (the permute reads only the index's low 4 bits, so the
/// bits above the code need no mask). The values are exact copies of table entries.
#[derive(Clone, Copy)]
struct Unpack16 {
    shifts: __m512i,
    split: __mmask16,
    lut: __m512,
}

impl Unpack16 {
    /// Lane `i` holds the code at bit `i * bits` of its word, less `second_bits` from lane
    /// `split` on.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn new(bits: u32, table: &[f32], (split, second_bits): (usize, usize)) -> Self {
        debug_assert!((2..=4).contains(&bits) && table.len() >= 16);
        let b = bits as usize;
        let sh: [i32; 16] = std::array::from_fn(|i| {
            (if i < split {
                i * b
            } else {
                i * b - second_bits
            }) as i32
        });
        let lut: [f32; 16] = std::array::from_fn(|j| table[j & ((1 << b) - 1)]);
        debug_assert!(sh
            .iter()
            .zip(0..)
            .all(|(&s, i)| s >= 0 && s as usize + b <= 32 || i >= 16));
        // SAFETY: sh and lut hold 16 lanes.
        unsafe {
            Self {
                shifts: _mm512_loadu_si512(sh.as_ptr().cast()),
                split: (0xFFFFu32 << split.min(16)) as __mmask16,
                lut: _mm512_loadu_ps(lut.as_ptr()),
            }
        }
    }

    /// # Safety
    /// Four bytes are readable at `lo` and at `hi`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    unsafe fn decode(&self, lo: *const u8, hi: *const u8) -> __m512 {
        // SAFETY: the caller's four bytes at each pointer.
        let (a, b) = unsafe {
            (
                _mm512_set1_epi32(lo.cast::<i32>().read_unaligned()),
                _mm512_set1_epi32(hi.cast::<i32>().read_unaligned()),
            )
        };
        let w = _mm512_mask_blend_epi32(self.split, a, b);
        _mm512_permutexvar_ps(_mm512_srlv_epi32(w, self.shifts), self.lut)
    }
}

/// Sixteen codes of 5 to 8 bits (`2 * bits` bytes) decoded in registers: the bytes broadcast
/// to every 128-bit lane, each 32-bit lane gathering the two bytes its code lies in by a byte
/// shuffle, then a per-lane shift, the code mask and the table lookup (a two-register permute
/// for 5 bits, a gather from the 256-entry table above). The values are exact copies of table
/// entries, as [`decode`] gives them.
#[derive(Clone, Copy)]
struct Wide16 {
    pick: __m512i,
    shifts: __m512i,
    mask: __m512i,
    lo: __m512,
    hi: __m512,
    table: *const f32,
    bits: u32,
}

impl Wide16 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn new(bits: u32, table: &[f32]) -> Self {
        debug_assert!((5..=8).contains(&bits) && table.len() >= 256);
        let b = bits as usize;
        // Lane i's code starts at bit i * b: bytes (i * b) / 8 and the next (when it lies
        // among the 2 * b bytes of the sixteen codes; a code of at most 8 bits spans two).
        let mut pick = [0x80u8; 64];
        let sh: [i32; 16] = std::array::from_fn(|i| (i * b % 8) as i32);
        for i in 0..16 {
            let byte = i * b / 8;
            pick[4 * i] = byte as u8;
            if byte + 1 < 2 * b {
                pick[4 * i + 1] = (byte + 1) as u8;
            }
        }
        // SAFETY: pick holds 64 bytes, sh 16 lanes, table 256 >= 32 entries.
        unsafe {
            Self {
                pick: _mm512_loadu_si512(pick.as_ptr().cast()),
                shifts: _mm512_loadu_si512(sh.as_ptr().cast()),
                mask: _mm512_set1_epi32((1 << b) - 1),
                lo: _mm512_loadu_ps(table.as_ptr()),
                hi: _mm512_loadu_ps(table.as_ptr().add(16)),
                table: table.as_ptr(),
                bits,
            }
        }
    }

    /// The sixteen values whose codes start at `from`, of which the first `bytes` bytes are
    /// read (the codes past them decode as code 0).
    ///
    /// # Safety
    /// `bytes` (at most 16) bytes are readable at `from`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    unsafe fn decode(&self, from: *const u8, bytes: usize) -> __m512 {
        let k = ((1u32 << bytes.min(16)) - 1) as __mmask16;
        // SAFETY: the caller's `bytes` bytes; masked bytes are not accessed.
        let v = unsafe { _mm_maskz_loadu_epi8(k, from.cast()) };
        let w = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(v), self.pick);
        let c = _mm512_and_si512(_mm512_srlv_epi32(w, self.shifts), self.mask);
        if self.bits == 5 {
            _mm512_permutex2var_ps(self.lo, c, self.hi)
        } else {
            // SAFETY: the codes are below 256, the table's length.
            unsafe { _mm512_i32gather_ps::<4>(c, self.table) }
        }
    }
}

/// The first `bytes` (at most 16) bytes from `p`, the rest zero; bytes past them are not read.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn load_bytes(p: *const u8, bytes: usize) -> __m128i {
    // SAFETY: the caller's `bytes` bytes from p are readable; masked lanes are not accessed.
    unsafe { _mm_maskz_loadu_epi8(((1u32 << bytes) - 1) as __mmask16, p.cast()) }
}

/// [`super::super::ops::dots_tokens_packed`]: the block's codes are decoded in registers (the
/// values [`decode_packed`] stores) and fed to the arithmetic of [`dots_tokens`], so the
/// results are its bits. `n` a multiple of 8, `bits` 1..=4.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) fn dots_tokens_packed(
    q: &[f32],
    (packed, count): (&[u8], usize),
    (bits, table): (u32, &[f32]),
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    let b = bits as usize;
    let used = count * n * b / 8;
    debug_assert!(n.is_multiple_of(8) && packed.len() >= used);
    if bits > 1 && packed.len() < used + 4 {
        // The last token's 4-byte reads would leave `packed`: a padded copy (the end of a
        // buffer only).
        let mut padded = packed[..used].to_vec();
        padded.resize(used + 4, 0);
        return dots_tokens_packed(q, (&padded, count), (bits, table), n, out, stride);
    }
    // Values i .. i + 8 of tokens k and k + 1 from their first bytes: one bit per value
    // selects a table entry, wider codes decode through `Unpack16`.
    let (zero, one) = (_mm512_set1_ps(table[0]), _mm512_set1_ps(table[1]));
    let dec = Unpack16::new(bits.max(2), table, (8, 8 * b.max(2)));
    let pair = |lo: *const u8, hi: *const u8| {
        // SAFETY: the caller's pointers hold the eight values' codes and, for 2..=4 bits,
        // four readable bytes each.
        unsafe {
            if bits == 1 {
                _mm512_mask_blend_ps(u16::from_le_bytes([*lo, *hi]), zero, one)
            } else {
                dec.decode(lo, hi)
            }
        }
    };
    // Whole blocks of eight tokens: row pointers stepped, no per-code bounds choice.
    let full = count / 8 * 8;
    let token_bytes = n * b / 8;
    dots_tokens_blocks(
        q,
        n,
        (&pair, packed.as_ptr(), token_bytes, b),
        full,
        out,
        stride,
    );
    if full == count {
        return;
    }
    // The last 1..7 tokens; those past `count` read a zeroed word.
    let (packed, count, out) = (
        &packed[full * token_bytes..],
        count - full,
        &mut out[full..],
    );
    let (p, zeros) = (packed.as_ptr(), [0u8; 4]);
    let word = |k: usize, i: usize| {
        if k < count {
            p.wrapping_add((k * n + i) * b / 8)
        } else {
            zeros.as_ptr()
        }
    };
    let pair = |k: usize, i: usize| pair(word(k, i), word(k + 1, i));
    dots_tokens_with(q, n, count, &pair, out, stride);
}

/// [`dots_tokens_with`] of the first `full` (a multiple of 8) tokens of a packed stream whose
/// token `k` starts at byte `k * token_bytes` of `base`: `pair(lo, hi)` decodes eight values
/// of two tokens from their bytes at pointers stepped by `bits` bytes per eight values, the
/// arithmetic of [`dots_tokens8`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn dots_tokens_blocks(
    q: &[f32],
    n: usize,
    (pair, base, token_bytes, b): (
        &impl Fn(*const u8, *const u8) -> __m512,
        *const u8,
        usize,
        usize,
    ),
    full: usize,
    out: &mut [f32],
    stride: usize,
) {
    super::query_blocks((q, n), (out, stride), 4, |qb, ob, rb| {
        for k in (0..full).step_by(8) {
            let at = (base.wrapping_add(k * token_bytes), token_bytes, b);
            match rb {
                4 => dots_tokens8_packed::<4>(qb, n, pair, at, &mut ob[k..], stride),
                3 => dots_tokens8_packed::<3>(qb, n, pair, at, &mut ob[k..], stride),
                2 => dots_tokens8_packed::<2>(qb, n, pair, at, &mut ob[k..], stride),
                _ => dots_tokens8_packed::<1>(qb, n, pair, at, &mut ob[k..], stride),
            }
        }
    });
}

/// [`dots_tokens8`] of eight whole tokens from `p` (token `k` at `p + k * token_bytes`, read
/// by `pair` as in [`dots_tokens_blocks`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn dots_tokens8_packed<const R: usize>(
    q: &[f32],
    n: usize,
    pair: &impl Fn(*const u8, *const u8) -> __m512,
    (p, token_bytes, b): (*const u8, usize, usize),
    out: &mut [f32],
    stride: usize,
) {
    debug_assert!(q.len() >= R * n && n.is_multiple_of(8));
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut at = p;
    let mut i = 0;
    while i < n {
        // Values i .. i + 8 of tokens 2 pp and 2 pp + 1.
        let t: [__m512; 4] = std::array::from_fn(|pp| {
            let lo = at.wrapping_add(2 * pp * token_bytes);
            pair(lo, lo.wrapping_add(token_bytes))
        });
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: row r < R of q holds n floats, and i + 8 <= n.
            let qv = unsafe {
                _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(
                    q.as_ptr().add(r * n + i),
                ))))
            };
            for (ap, &tp) in a.iter_mut().zip(&t) {
                *ap = _mm512_add_ps(*ap, _mm512_mul_ps(tp, qv));
            }
        }
        at = at.wrapping_add(b);
        i += 8;
    }
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: out holds row r's eight results at r * stride.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), combine8(a)) };
    }
}

/// [`super::super::ops::axpy_rows`] for one weight per token (`groups == 1`) or `group` a
/// multiple of 16 (each register lies in one group): up to four query rows at once, four
/// registers (64 values) of each per pass, the tail masked. Each row of `mat` is loaded once
/// for every query row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) fn axpy_rows(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    mat: &[f32],
    stride: usize,
) {
    // SAFETY: the `valid` lanes from `at` lie in row c of mat (at c * stride).
    let x = |c: usize, at: usize, valid: usize| unsafe {
        _mm512_maskz_loadu_ps(mask16(valid), mat.as_ptr().add(c * stride + at))
    };
    axpy_rows_with((o, rows), w, (groups, group), &x);
}

/// [`super::super::ops::axpy_rows_packed`]: the rows' codes are decoded in registers (the values
/// [`decode_packed`] stores) and fed to the arithmetic of [`axpy_rows`], so the results are its
/// bits. `bits` 1..=4, `groups == 1` or `group` a multiple of 16; row `c` from byte
/// `c * row_bytes`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) fn axpy_rows_packed(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    (packed, row_bytes, bits, table): (&[u8], usize, u32, &[f32]),
) {
    let (b, n) = (bits as usize, o.len() / rows);
    let count = w.len() / (rows * groups);
    debug_assert!(
        count == 0 || packed.len() >= (count - 1) * row_bytes + (n * b).div_ceil(8),
        "packed rows"
    );
    if bits > 4 {
        let rows_at = (packed, row_bytes, bits, table);
        return axpy_rows_wide((o, rows), w, (groups, group), rows_at);
    }
    let p = packed.as_ptr();
    // The first byte of the codes of row c from code `at` (a multiple of 16: a whole byte).
    let start = move |c: usize, at: usize| c * row_bytes + at * b / 8;
    // SAFETY (both loads): the bytes of the `valid` codes of row c from `at` lie in `packed`.
    let bytes = |c: usize, at: usize, valid: usize| unsafe {
        load_bytes(p.add(start(c, at)), (valid * b).div_ceil(8))
    };
    // The second word of sixteen codes: none (2 bits), codes 10.. from byte 2 (3 bits),
    // codes 8.. from byte 4 (4 bits); neither read leaves the 2 * bits bytes of the codes.
    let second = [0, 0, 0, 2, 4][b];
    let split = [16, 16, 16, 10, 8][b];
    let dec = Unpack16::new(bits.max(2), table, (split, 8 * second));
    let (zero, one) = (_mm512_set1_ps(table[0]), _mm512_set1_ps(table[1]));
    // Sixteen values from the first byte of their codes: one bit per value selects a table
    // entry, wider codes decode through `Unpack16`.
    let sixteen = |from: *const u8| {
        // SAFETY: the caller's pointer holds the 2 * bits bytes of sixteen codes.
        unsafe {
            if bits == 1 {
                _mm512_mask_blend_ps(from.cast::<u16>().read_unaligned(), zero, one)
            } else {
                dec.decode(from, from.add(second))
            }
        }
    };
    if n.is_multiple_of(64) {
        // SAFETY: the `count` rows' codes lie in `packed` (checked above).
        return unsafe {
            packed64_blocks((o, rows), w, (groups, group), &sixteen, (p, row_bytes, b))
        };
    }
    if bits == 1 {
        let x = |c: usize, at: usize, valid: usize| {
            let m = _mm_cvtsi128_si32(bytes(c, at, valid)) as u16;
            _mm512_mask_blend_ps(m, zero, one)
        };
        return axpy_rows_with((o, rows), w, (groups, group), &x);
    }
    let x = |c: usize, at: usize, valid: usize| {
        let from = p.wrapping_add(start(c, at));
        if valid == 16 {
            // SAFETY: the 2 * bits bytes of the sixteen codes lie in `packed`.
            unsafe { dec.decode(from, from.wrapping_add(second)) }
        } else {
            // A row's tail: its bytes copied to a zeroed buffer.
            let mut buf = [0u8; 16];
            // SAFETY: buf holds 16 bytes; the codes' bytes lie in `packed`, as above.
            unsafe {
                _mm_storeu_si128(buf.as_mut_ptr().cast(), bytes(c, at, valid));
                dec.decode(buf.as_ptr(), buf.as_ptr().add(second))
            }
        }
    };
    axpy_rows_with((o, rows), w, (groups, group), &x);
}

/// [`axpy_rows_packed64`] over blocks of up to four query rows (rows of a multiple of 64
/// values), one weight per token or per group.
///
/// # Safety
/// The rows' codes lie in one allocation, `2 * b` bytes per sixteen values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn packed64_blocks(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    gs: (usize, usize),
    sixteen: &impl Fn(*const u8) -> __m512,
    rows_at: (*const u8, usize, usize),
) {
    super::row_blocks((o, rows), w, 4, |ob, wb, rb| {
        // SAFETY: the caller's codes.
        unsafe {
            match (rb, gs.0) {
                (4, 1) => axpy_rows_packed64::<4, false>(ob, wb, gs, sixteen, rows_at),
                (3, 1) => axpy_rows_packed64::<3, false>(ob, wb, gs, sixteen, rows_at),
                (2, 1) => axpy_rows_packed64::<2, false>(ob, wb, gs, sixteen, rows_at),
                (_, 1) => axpy_rows_packed64::<1, false>(ob, wb, gs, sixteen, rows_at),
                (4, _) => axpy_rows_packed64::<4, true>(ob, wb, gs, sixteen, rows_at),
                (3, _) => axpy_rows_packed64::<3, true>(ob, wb, gs, sixteen, rows_at),
                (2, _) => axpy_rows_packed64::<2, true>(ob, wb, gs, sixteen, rows_at),
                _ => axpy_rows_packed64::<1, true>(ob, wb, gs, sixteen, rows_at),
            }
        }
    })
}

/// [`axpy_rows_packed`] of codes of 5 to 8 bits, decoded sixteen at a time by [`Wide16`]
/// (rows of a multiple of 64 values by [`axpy_rows_packed64`], others by [`axpy_rows_with`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn axpy_rows_wide(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    (packed, row_bytes, bits, table): (&[u8], usize, u32, &[f32]),
) {
    let (b, n) = (bits as usize, o.len() / rows);
    let dec = Wide16::new(bits, table);
    let p = packed.as_ptr();
    if n.is_multiple_of(64) {
        // SAFETY: the caller's pointer holds the 2 * b bytes of sixteen codes.
        let sixteen = |from: *const u8| unsafe { dec.decode(from, 2 * b) };
        // SAFETY: the `count` rows' codes lie in `packed` (the caller's contract).
        return unsafe {
            packed64_blocks((o, rows), w, (groups, group), &sixteen, (p, row_bytes, b))
        };
    }
    // A row's tail reads only its codes' bytes (the masked load).
    let x = |c: usize, at: usize, valid: usize| {
        // SAFETY: the bytes of the `valid` codes of row c from `at` lie in `packed`.
        unsafe { dec.decode(p.add(c * row_bytes + at * b / 8), (valid * b).div_ceil(8)) }
    };
    axpy_rows_with((o, rows), w, (groups, group), &x);
}

/// [`axpy_rows_r`] for rows of a multiple of 64 values read from packed rows of `b`-bit codes
/// (row `c` at `p + c * row_bytes`): sixty-four values of each row per pass, the row pointer
/// stepped, `sixteen(from)` decoding sixteen values; one weight per token (`GROUPS` false) or
/// per group of `group` (a multiple of 16) values.
///
/// # Safety
/// The rows' codes lie in one allocation.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn axpy_rows_packed64<const R: usize, const GROUPS: bool>(
    o: &mut [f32],
    w: &[f32],
    (groups, group): (usize, usize),
    sixteen: &impl Fn(*const u8) -> __m512,
    (p, row_bytes, b): (*const u8, usize, usize),
) {
    let (n, count) = (o.len() / R, w.len() / (R * groups));
    debug_assert!(o.len() == R * n && n.is_multiple_of(64) && groups == n.div_ceil(group));
    let mut i = 0;
    while i < n {
        // Each register's group (a register lies in one group).
        let g: [usize; 4] = std::array::from_fn(|v| if GROUPS { (i + 16 * v) / group } else { 0 });
        // SAFETY: lanes i .. i + 64 lie in each of the R rows of o; w holds R x count x groups
        // weights and g[v] < groups; the rows' codes are the caller's, 2 * b bytes per
        // sixteen values.
        unsafe {
            let mut acc: [[__m512; 4]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|v| _mm512_loadu_ps(o.as_ptr().add(r * n + i + 16 * v)))
            });
            let mut at = p.add(i * b / 8);
            for c in 0..count {
                let xs: [__m512; 4] = std::array::from_fn(|v| sixteen(at.add(2 * b * v)));
                for (r, a) in acc.iter_mut().enumerate() {
                    let wr = w.as_ptr().add((r * count + c) * groups);
                    let one = _mm512_set1_ps(*wr);
                    for ((av, &xv), &gv) in a.iter_mut().zip(&xs).zip(&g) {
                        let wv = if GROUPS {
                            _mm512_set1_ps(*wr.add(gv))
                        } else {
                            one
                        };
                        *av = _mm512_add_ps(*av, _mm512_mul_ps(wv, xv));
                    }
                }
                at = at.wrapping_add(row_bytes);
            }
            for (r, a) in acc.iter().enumerate() {
                for (v, av) in a.iter().enumerate() {
                    _mm512_storeu_ps(o.as_mut_ptr().add(r * n + i + 16 * v), *av);
                }
            }
        }
        i += 64;
    }
}

/// [`axpy_rows`] with row `c`'s values `at .. at + 16` (the first `valid`; the other lanes are
/// never stored) read by `x(c, at, valid)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn axpy_rows_with(
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    x: &impl Fn(usize, usize, usize) -> __m512,
) {
    let shape = (o.len() / rows, w.len() / (rows * groups), groups, group);
    super::row_blocks((o, rows), w, 4, |ob, wb, rb| match rb {
        4 => axpy_rows_r::<4>(ob, wb, shape, x),
        3 => axpy_rows_r::<3>(ob, wb, shape, x),
        2 => axpy_rows_r::<2>(ob, wb, shape, x),
        _ => axpy_rows_r::<1>(ob, wb, shape, x),
    });
}

/// [`axpy_rows`] of `R` query rows (`o`: R x n, `w`: R x count x groups).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn axpy_rows_r<const R: usize>(
    o: &mut [f32],
    w: &[f32],
    (n, count, groups, group): (usize, usize, usize, usize),
    x: &impl Fn(usize, usize, usize) -> __m512,
) {
    debug_assert!(o.len() == R * n && w.len() == R * count * groups);
    let mut i = 0;
    while i < n {
        let regs = (n - i).div_ceil(16).min(4);
        let k = masks4(n, i);
        let valid: [usize; 4] = std::array::from_fn(|v| n.saturating_sub(i + 16 * v).min(16));
        // The register's group (the tail registers past n repeat the last one).
        let g: [usize; 4] = std::array::from_fn(|v| (i + 16 * v.min(regs - 1)) / group);
        // SAFETY: the masked lanes stay below n in each row of o; w holds R x count x groups
        // weights and g[v] < groups.
        unsafe {
            let mut acc: [[__m512; 4]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|v| {
                    _mm512_maskz_loadu_ps(k[v], o.as_ptr().add(r * n + i + 16 * v.min(regs - 1)))
                })
            });
            for c in 0..count {
                let xs: [__m512; 4] = std::array::from_fn(|v| {
                    if v < regs {
                        x(c, i + 16 * v, valid[v])
                    } else {
                        _mm512_setzero_ps()
                    }
                });
                for (r, a) in acc.iter_mut().enumerate() {
                    let wr = w.as_ptr().add((r * count + c) * groups);
                    for v in 0..regs {
                        let wv = _mm512_set1_ps(*wr.add(g[v]));
                        a[v] = _mm512_add_ps(a[v], _mm512_mul_ps(wv, xs[v]));
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for (v, av) in a.iter().enumerate().take(regs) {
                    _mm512_mask_storeu_ps(o.as_mut_ptr().add(r * n + i + 16 * v), k[v], *av);
                }
            }
        }
        i += 16 * regs;
    }
}
