//! Row primitives of the hot kernels, dispatched on an [`Isa`]. The `scalar` module (and
//! `reduce.rs`) holds the reference of each; the other paths must return the same bits.
//!
//! Every function assumes `isa.is_supported()`: the kernels only pass [`super::active`] or an
//! `Isa` that went through [`Isa::checked`].

#[cfg(target_arch = "aarch64")]
use super::neon;
pub(crate) use super::pack_path::{pack_row_on, unpack_row_on};
#[cfg(target_arch = "x86_64")]
use super::x86::{avx2, avx512};
use super::{scalar, Isa};

/// Euclidean norm accumulated in float64 (`reduce::norm_f64`).
#[inline]
pub(crate) fn norm_f64(isa: Isa, x: &[f32]) -> f64 {
    match isa {
        // SAFETY (all arms): the caller guarantees `isa` is supported by this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::norm_f64(x) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::norm_f64(x) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::norm_f64(x) },
        _ => crate::reduce::norm_f64(x),
    }
}

/// Dot product in the fixed order (`reduce::dot`).
#[inline]
pub(crate) fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::dot(a, b) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::dot(a, b) },
        _ => crate::reduce::dot(a, b),
    }
}

/// `out[r] = dot(mat row r, x)` for the `out.len()` rows of `mat` (row length `x.len()`):
/// on x86 with `n` a multiple of 8, the rows as the tokens of [`dots_tokens`] (the same order,
/// several rows per register and their sums combined without a scalar pass per row).
pub(crate) fn dots(isa: Isa, mat: &[f32], x: &[f32], out: &mut [f32]) {
    let n = x.len();
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if n > 0 && n.is_multiple_of(8) => {
            let rows = out.len();
            dots_tokens(isa, x, &mat[..rows * n], n, out, rows);
        }
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dots(mat, x, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dots(mat, x, out) },
        _ => {
            for (o, row) in out.iter_mut().zip(mat.chunks_exact(n.max(1))) {
                *o = dot(isa, row, x);
            }
        }
    }
}

/// `out[r * stride + k] = dot(q row r, x row k)` (`reduce::dot`) for the `q.len() / n` query
/// rows and the `x.len() / n` rows of `x` (rows of `n` values): the scores of a block of
/// decoded keys, several tokens per register on x86 when `n` is a multiple of 8.
pub(crate) fn dots_tokens(
    isa: Isa,
    q: &[f32],
    x: &[f32],
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    let (rows, count) = (q.len() / n.max(1), x.len() / n.max(1));
    debug_assert!(rows == 0 || out.len() >= (rows - 1) * stride + count);
    match isa {
        // SAFETY (both arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if n.is_multiple_of(8) => unsafe { avx512::dots_tokens(q, x, n, out, stride) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if n.is_multiple_of(8) => unsafe { avx2::dots_tokens(q, x, n, out, stride) },
        _ => {
            for (r, qr) in q.chunks_exact(n).enumerate() {
                for (k, xk) in x.chunks_exact(n).enumerate() {
                    out[r * stride + k] = dot(isa, qr, xk);
                }
            }
        }
    }
}

/// `x *= mult` (when given), then the unnormalised transform (`x.len()` a power of two).
pub(crate) fn fwht(isa: Isa, x: &mut [f32], mult: Option<&[f32]>) {
    let n = x.len();
    match isa {
        // SAFETY (all arms): `isa` is supported; the length conditions are the callee's.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if n >= 16 => unsafe { avx512::fwht(x, mult) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if n >= 8 => unsafe { avx2::fwht(x, mult) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon if n >= 4 => unsafe { neon::fwht(x, mult) },
        _ => {
            if let Some(m) = mult {
                x.iter_mut().zip(m).for_each(|(v, m)| *v *= m);
            }
            scalar::fwht(x);
        }
    }
}

/// Lloyd-Max codes `#{j : table[j] <= x[i] / div}`; `table` holds the float32 boundaries
/// padded with `+inf` to `max(2^bits, 16)` entries.
pub(crate) fn encode(
    isa: Isa,
    x: &[f32],
    div: Option<f32>,
    table: &[f32],
    bits: u32,
    codes: &mut [u8],
) {
    match isa {
        // SAFETY (all arms): `isa` is supported; `table` is padded as the callees require.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::encode(x, div, table, bits, codes) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::encode(x, div, table, bits, codes) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::encode(x, div, table, bits, codes) },
        _ => scalar::encode(x, div, table, bits, codes),
    }
}

/// `out[i] = table[codes[i]] * mul` (`table` has 256 entries, so any byte is in bounds).
/// `bits` only selects the x86 lookup (register permute or gather).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub(crate) fn decode(isa: Isa, codes: &[u8], table: &[f32], bits: u32, mul: f32, out: &mut [f32]) {
    match isa {
        // SAFETY (all arms): `isa` is supported; `table` has 256 entries.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::decode(codes, table, bits, mul, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::decode(codes, table, bits, mul, out) },
        _ => scalar::decode(codes, table, mul, out),
    }
}

/// `out[i] = table[code_i]` for the first `out.len()` codes of a packed row of `bits`-bit codes
/// (`table` has 256 entries): unpack and table decode in one pass, in registers on x86 up to 4
/// bits; exact copies of table entries, so every path agrees.
pub(crate) fn decode_packed(isa: Isa, packed: &[u8], bits: u32, table: &[f32], out: &mut [f32]) {
    match isa {
        // SAFETY (both arms): `isa` is supported; `table` has 256 entries.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if (1..=4).contains(&bits) => unsafe {
            avx512::decode_packed(packed, bits, table, out)
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if bits <= 4 => unsafe {
            avx2::decode_packed(packed, bits, table, out)
        },
        _ => unpack_then_decode(isa, packed, bits, table, out),
    }
}

/// [`decode_packed`] through the row primitives of `isa`, 64 codes (a whole number of bytes)
/// at a time: [`unpack_row`] then [`decode`]. Kept here, not in `scalar`, because it dispatches
/// on `isa` (so `scalar` never depends on `ops`).
fn unpack_then_decode(isa: Isa, packed: &[u8], bits: u32, table: &[f32], out: &mut [f32]) {
    let mut codes = [0u8; 64];
    for (k, o) in out.chunks_mut(64).enumerate() {
        let c = &mut codes[..o.len()];
        unpack_row(isa, &packed[8 * k * bits as usize..], bits, c);
        decode(isa, c, table, bits, 1.0, o);
    }
}

/// [`decode_packed`] of `out.len() / len` short rows of `len` codes, row `r` from
/// `packed[r * row_bytes..]` (e.g. one group of tokens of every channel): one call, so the
/// per-call setup of the SIMD decoders is paid once. Exact copies of table entries, as
/// [`decode_packed`].
pub(crate) fn decode_packed_rows(
    isa: Isa,
    packed: &[u8],
    (row_bytes, len): (usize, usize),
    bits: u32,
    table: &[f32],
    out: &mut [f32],
) {
    if len == 0 {
        return;
    }
    match isa {
        // SAFETY: `isa` is supported; `table` has 256 entries.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if (1..=4).contains(&bits) => unsafe {
            avx512::decode_packed_rows(packed, (row_bytes, len), bits, table, out)
        },
        _ => {
            for (r, o) in out.chunks_exact_mut(len).enumerate() {
                decode_packed(isa, &packed[r * row_bytes..], bits, table, o);
            }
        }
    }
}

/// `out[i] = (y[i] * mul) ^ sign_bits[i]` for `i < out.len()`: the sign flip and norm of the
/// inverse rotation (`(y * s) * mul` with `s = +-1` is exactly `+-(y * mul)`).
pub(crate) fn finish(isa: Isa, y: &[f32], sign_bits: &[u32], mul: f32, out: &mut [f32]) {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::finish(y, sign_bits, mul, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::finish(y, sign_bits, mul, out) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::finish(y, sign_bits, mul, out) },
        _ => scalar::finish(y, sign_bits, mul, out),
    }
}

/// The fused MSE encode of one rotated row (norm, rotation, division, search), where a path
/// has one for this `d' = mult.len()`: returns the norm, or `None` to use the primitives.
pub(crate) fn mse_encode_row(
    isa: Isa,
    x: &[f32],
    mult: &[f32],
    table: &[f32],
    bits: u32,
    zero_code: u8,
    codes: &mut [u8],
) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        let f = match mult.len() {
            16 => avx512::mse_encode_row::<1>,
            32 => avx512::mse_encode_row::<2>,
            64 => avx512::mse_encode_row::<4>,
            128 => avx512::mse_encode_row::<8>,
            256 => avx512::mse_encode_row::<16>,
            _ => return None,
        };
        // SAFETY: `isa` is supported; the lengths are the callee's d' = 16 K.
        return Some(unsafe { f(x, mult, table, bits, zero_code, codes) });
    }
    let _ = (isa, x, mult, table, bits, zero_code, codes);
    None
}

/// The fused MSE decode of one rotated row, where a path has one for `d' = codes.len()`;
/// returns `false` to use the primitives.
pub(crate) fn mse_decode_row(
    isa: Isa,
    codes: &[u8],
    table: &[f32],
    bits: u32,
    sign_bits: &[u32],
    norm: f32,
    out: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        let f = match codes.len() {
            16 => avx512::mse_decode_row::<1>,
            32 => avx512::mse_decode_row::<2>,
            64 => avx512::mse_decode_row::<4>,
            128 => avx512::mse_decode_row::<8>,
            256 => avx512::mse_decode_row::<16>,
            _ => return false,
        };
        // SAFETY: `isa` is supported; the lengths are the callee's d' = 16 K.
        unsafe { f(codes, table, bits, sign_bits, norm, out) };
        return true;
    }
    let _ = (isa, codes, table, bits, sign_bits, norm, out);
    false
}

/// Packs one row of codes (`pack::pack_row`) on the pack path of `isa`
/// ([`super::pack_path_for`]).
pub(crate) fn pack_row(isa: Isa, codes: &[u8], bits: u32, out: &mut [u8]) {
    pack_row_on(super::pack_path_for(isa), codes, bits, out);
}

/// Unpacks one row of codes (`pack::unpack_row`) on the pack path of `isa`.
pub(crate) fn unpack_row(isa: Isa, packed: &[u8], bits: u32, out: &mut [u8]) {
    unpack_row_on(super::pack_path_for(isa), packed, bits, out);
}

/// Packed QJL sign bits `t[i] < 0` of one row (`out` has `ceil(t.len() / 8)` bytes).
pub(crate) fn sign_bits(isa: Isa, t: &[f32], out: &mut [u8]) {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::sign_bits(t, out) },
        _ => scalar::sign_bits_from(t, 0, out),
    }
}

/// `sum y[i] * sigma_i` (sigma from packed sign bits) in the fixed 8-lane order.
pub(crate) fn dot_signs(isa: Isa, y: &[f32], packed: &[u8]) -> f32 {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::dot_signs(y, packed) },
        _ => scalar::dot_signs(y, packed),
    }
}

/// `o += s` (or `-= s`).
pub(crate) fn add_signed(isa: Isa, o: &mut [f32], s: &[f32], negative: bool) {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::add_signed(o, s, negative) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::add_signed(o, s, negative) },
        _ => scalar::add_signed(o, s, negative),
    }
}

/// `o *= k`.
pub(crate) fn scale(isa: Isa, o: &mut [f32], k: f32) {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::scale(o, k) },
        _ => scalar::scale(o, k),
    }
}

/// `acc[j] += w[i] * f64(m[i * acc.len() + j])` for each row `i` of `m` in order, a multiply
/// then an add each (never fused): the same bits on every path.
pub(crate) fn axpy_many_f64(isa: Isa, acc: &mut [f64], w: &[f64], m: &[f32]) {
    debug_assert!(m.len() >= w.len() * acc.len());
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::axpy_many_f64(acc, w, m) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::axpy_many_f64(acc, w, m) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::axpy_many_f64(acc, w, m) },
        _ => scalar::axpy_many_f64(acc, w, m),
    }
}

/// `out[i] = f32(sum_c x[c] m[c * n + i])` for `n = out.len()` (`m` row-major `x.len() x n`,
/// float64): each sum in float64 over `c` in order, a multiply then an add, rounded once; the
/// same bits on every path (the `matched` transform `(x - mu) U` of the native encoders).
pub(crate) fn project_f64(isa: Isa, x: &[f64], m: &[f64], out: &mut [f32]) {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::project_f64(x, m, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::project_f64(x, m, out) },
        _ => scalar::project_f64(x, m, out),
    }
}

/// `o[r][i] += sum_c w[(r * count + c) * groups + i / group] * mat[c * stride + i]` for each
/// of `rows` rows of `o` (rows x n), the terms added in increasing `c` for each `(r, i)`: the
/// weighted sums of `count` rows of `mat` (row `c` starts at `c * stride` and holds at least
/// n values) with one weight per query row, token and group of `group` consecutive values
/// (`groups = ceil(n / group)`; `(1, n)` for one weight per token, e.g. softmax weights; the
/// per-token groups of a uniform code, whose scale differs per group). The rows' sums are
/// kept in registers together, so each row of `mat` is read once for every query row.
pub(crate) fn axpy_rows(
    isa: Isa,
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    mat: &[f32],
    stride: usize,
) {
    if o.is_empty() || rows == 0 {
        return;
    }
    let n = o.len() / rows;
    debug_assert!(o.len() == rows * n && groups == n.div_ceil(group));
    debug_assert!(w.len().is_multiple_of(rows * groups));
    let count = w.len() / (rows * groups);
    debug_assert!(count == 0 || mat.len() >= (count - 1) * stride + n);
    match isa {
        // SAFETY (both arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if groups == 1 || group.is_multiple_of(16) => unsafe {
            avx512::axpy_rows((o, rows), w, (groups, group), mat, stride)
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if groups == 1 || group.is_multiple_of(8) => unsafe {
            avx2::axpy_rows((o, rows), w, (groups, group), mat, stride)
        },
        _ => scalar::axpy_rows((o, rows), w, (groups, group), mat, stride),
    }
}

/// `acc[r * stride + offset + g] += f64(p[r * n + at + k]) * f64(ze[k * groups + g])` for the
/// query rows `r < p.len() / n`, groups `g < groups` and tokens `k < count` in increasing `k`,
/// in float64 (a float32 sum of zero points near its limit would overflow): the zero points'
/// share of a block's value sums. A float32 product is exact in float64 and each sum is its own
/// lane, so every path gives the reference's bits.
pub(crate) fn zero_point_sums(
    isa: Isa,
    pn: (&[f32], usize, usize),
    zg: (&[f32], usize),
    count: usize,
    out: (&mut [f64], usize, usize),
) {
    match isa {
        // SAFETY: `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::zero_point_sums(pn, zg, count, out) },
        _ => scalar::zero_point_sums(pn, zg, count, out),
    }
}

/// Whether [`dots_tokens_packed`] and [`axpy_rows_packed`] decode `bits`-bit codes in registers
/// on `isa` (for [`dots_tokens_packed`] with rows of a multiple of 8 values, for
/// [`axpy_rows_packed`] with `groups == 1` or `group` a multiple of 16); elsewhere they decode
/// into a buffer first, so a caller with its own buffer keeps it.
pub(crate) fn fuses_packed(isa: Isa, bits: u32) -> bool {
    cfg!(target_arch = "x86_64")
        && matches!(isa, Isa::Avx512 | Isa::Avx2)
        && (1..=4).contains(&bits)
}

/// Whether [`axpy_rows_packed`] decodes `bits`-bit codes in registers on `isa`: as
/// [`fuses_packed`], and 5 to 8 bits on AVX-512.
pub(crate) fn fuses_packed_rows(isa: Isa, bits: u32) -> bool {
    fuses_packed(isa, bits)
        || (cfg!(target_arch = "x86_64") && isa == Isa::Avx512 && (5..=8).contains(&bits))
}

/// [`dots_tokens`] of the `count` rows of `n` codes of a packed bit stream (`packed`, row `k`
/// from bit `k * n * bits`; `table` has 256 entries): the reference is [`decode_packed`] of
/// the stream, then [`dots_tokens`]; on AVX-512 and AVX2 (up to 4 bits, `n` a multiple of 8)
/// the codes are decoded in registers and fed to the same arithmetic, so every path agrees.
pub(crate) fn dots_tokens_packed(
    isa: Isa,
    q: &[f32],
    (packed, count): (&[u8], usize),
    (bits, table): (u32, &[f32]),
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    match isa {
        // SAFETY: `isa` is supported; `table` has 256 entries.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if fuses_packed(isa, bits) && n.is_multiple_of(8) && n > 0 => unsafe {
            avx512::dots_tokens_packed(q, (packed, count), (bits, table), n, out, stride)
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if fuses_packed(isa, bits) && n.is_multiple_of(8) && n > 0 => unsafe {
            avx2::dots_tokens_packed(q, (packed, count), (bits, table), n, out, stride)
        },
        _ => {
            let mut x = vec![0.0f32; count * n];
            decode_packed(isa, packed, bits, table, &mut x);
            dots_tokens(isa, q, &x, n, out, stride);
        }
    }
}

/// [`axpy_rows`] of the `count = w.len() / (rows * groups)` rows of `n = o.len() / rows` codes
/// of packed rows (`packed`, row `c` from byte `c * row_bytes`: `n * bits / 8` for one bit
/// stream, more for the first codes of longer rows; `table` has 256 entries): the reference is
/// [`decode_packed_rows`], then [`axpy_rows`] (stride `n`); on AVX-512 (up to 8 bits) and AVX2
/// (up to 4 bits), `groups == 1` or `group` a multiple of 16 (of 8 on AVX2), the codes are
/// decoded in registers and fed to the same arithmetic, so every path agrees.
pub(crate) fn axpy_rows_packed(
    isa: Isa,
    (o, rows): (&mut [f32], usize),
    w: &[f32],
    (groups, group): (usize, usize),
    (packed, row_bytes, bits, table): (&[u8], usize, u32, &[f32]),
) {
    if o.is_empty() || rows == 0 {
        return;
    }
    let n = o.len() / rows;
    debug_assert!(row_bytes * 8 >= n * bits as usize);
    match isa {
        // SAFETY: `isa` is supported; `table` has 256 entries.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512
            if fuses_packed_rows(isa, bits) && (groups == 1 || group.is_multiple_of(16)) =>
        unsafe {
            avx512::axpy_rows_packed(
                (o, rows),
                w,
                (groups, group),
                (packed, row_bytes, bits, table),
            )
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if fuses_packed(isa, bits) && (groups == 1 || group.is_multiple_of(8)) => unsafe {
            avx2::axpy_rows_packed(
                (o, rows),
                w,
                (groups, group),
                (packed, row_bytes, bits, table),
            )
        },
        _ => {
            let count = w.len() / (rows * groups);
            let mut x = vec![0.0f32; count * n];
            decode_packed_rows(isa, packed, (row_bytes, n), bits, table, &mut x);
            axpy_rows(isa, (o, rows), w, (groups, group), &x, n);
        }
    }
}

/// HeadQ correction `sum qu[i] * (s * (codes[i] - h))` in the fixed 8-lane order.
pub(crate) fn dot_side(isa: Isa, qu: &[f32], codes: &[u8], s: f32, h: f32) -> f32 {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::dot_side(qu, codes, s, h) },
        _ => scalar::dot_side(qu, codes, s, h),
    }
}

/// Whether every value is finite.
pub(crate) fn all_finite(isa: Isa, x: &[f32]) -> bool {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::all_finite(x) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::all_finite(x) },
        _ => scalar::all_finite(x),
    }
}

/// `o *= k`, then the largest value, or None if a scaled value is not finite (the caller finds
/// it). The maximum of finite values does not depend on the order, but for the sign of a zero.
pub(crate) fn scale_max(isa: Isa, o: &mut [f32], k: f32) -> Option<f32> {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::scale_max(o, k) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::scale_max(o, k) },
        _ => scalar::scale_max(o, k),
    }
}

/// `acc[i] += f64(x[i])`: exact widening, then one rounded add per element, the same bits on
/// every path.
pub(crate) fn add_to_f64(isa: Isa, acc: &mut [f64], x: &[f32]) {
    debug_assert!(acc.len() == x.len());
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::add_to_f64(acc, x) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::add_to_f64(acc, x) },
        _ => scalar::add_to_f64(acc, x),
    }
}

/// `x[i] = exp(x[i] - m)` ([`scalar::exp`], a fixed polynomial, so every path agrees); returns
/// the float64 sum of the results in the fixed 8-lane order of `reduce.rs`.
pub(crate) fn exp_sum(isa: Isa, x: &mut [f32], m: f32) -> f64 {
    match isa {
        // SAFETY (all arms): `isa` is supported.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::exp_sum(x, m) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::exp_sum(x, m) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::exp_sum(x, m) },
        _ => scalar::exp_sum(x, m),
    }
}

/// Float16 bit patterns to float32, `out.len()` of them (exact on every path: F16C on x86;
/// aarch64 runs the scalar conversion).
pub(crate) fn f16_to_f32(isa: Isa, src: &[u16], out: &mut [f32]) {
    debug_assert!(src.len() >= out.len());
    match isa {
        // SAFETY (all arms): `isa` is supported (F16C is part of the AVX2 path).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::f16_to_f32(src, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::f16_to_f32(src, out) },
        _ => scalar::f16_to_f32(src, out),
    }
}

#[cfg(test)]
mod tests {
    //! Each primitive on each supported path against its scalar reference, bit for bit, over
    //! every tail length (0..=70) and values of mixed scale, including +-0, subnormals and
    //! values near the float32 maximum.
    use super::*;
    use crate::simd::PackPath;

    fn simd_isas() -> Vec<Isa> {
        Isa::available()
            .into_iter()
            .filter(|&i| i != Isa::Scalar)
            .collect()
    }

    /// Deterministic values: a hash mapped to mixed magnitudes and signs.
    fn values(seed: u64, n: usize) -> Vec<f32> {
        (0..n as u64)
            .map(|i| {
                let h = (seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                    .wrapping_mul(0xD6E8_FEB8_6659_FD93);
                let u = (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                match h % 9 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => u * 1e-40,
                    3 => u * 3e38,
                    4 => u * 1e19,
                    _ => u * 4.0,
                }
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn reductions_match_to_the_last_bit() {
        for isa in simd_isas() {
            for n in 0..=70 {
                let (a, b) = (values(n as u64, n), values(1000 + n as u64, n));
                assert_eq!(
                    norm_f64(isa, &a).to_bits(),
                    norm_f64(Isa::Scalar, &a).to_bits(),
                    "{isa:?} n={n}"
                );
                // Moderate values, where the reduction order shows in the last bits of the f64.
                let m: Vec<f32> = (0..n)
                    .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 3.0)
                    .collect();
                assert_eq!(
                    norm_f64(isa, &m).to_bits(),
                    norm_f64(Isa::Scalar, &m).to_bits(),
                    "{isa:?} n={n}"
                );
                let small: Vec<f32> = a.iter().map(|v| v * 1e-20).collect();
                assert_eq!(
                    dot(isa, &small, &b).to_bits(),
                    dot(Isa::Scalar, &small, &b).to_bits(),
                    "{isa:?} n={n}"
                );
                for rows in [0, 1, 3, 4, 5, 8, 9] {
                    let m: Vec<f32> = values(7 + n as u64, rows * n)
                        .iter()
                        .map(|v| v * 1e-20)
                        .collect();
                    let (mut o1, mut o2) = (vec![0.0; rows], vec![0.0; rows]);
                    dots(isa, &m, &b, &mut o1);
                    dots(Isa::Scalar, &m, &b, &mut o2);
                    assert_eq!(bits(&o1), bits(&o2), "{isa:?} n={n} rows={rows}");
                }
                let sign_bytes: Vec<u8> = (0..n.div_ceil(8)).map(|i| (i * 37 + n) as u8).collect();
                assert_eq!(
                    dot_signs(isa, &small, &sign_bytes).to_bits(),
                    dot_signs(Isa::Scalar, &small, &sign_bytes).to_bits()
                );
                let codes: Vec<u8> = (0..n).map(|i| (i * 29 % 256) as u8).collect();
                for (s, h) in [(0.37f32, 127.5f32), (0.0, 0.5), (1e-3, 1.5)] {
                    assert_eq!(
                        dot_side(isa, &small, &codes, s, h).to_bits(),
                        dot_side(Isa::Scalar, &small, &codes, s, h).to_bits()
                    );
                }
            }
        }
    }

    /// Scores of blocks of tokens: every row count, token count (the SIMD groups of 4 and 8
    /// and their remainders) and row length, against the scalar `dot` of each pair; entries
    /// between the rows of `out` stay untouched.
    #[test]
    fn token_block_dots_match_to_the_last_bit() {
        for isa in simd_isas() {
            for n in [7, 8, 12, 16, 24, 64, 72, 128] {
                for rows in [1, 2, 3, 4, 5, 9] {
                    for count in (0..=19).chain([32, 33]) {
                        let q: Vec<f32> = (0..rows * n)
                            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 3.0)
                            .collect();
                        let x: Vec<f32> = values(n as u64 + 31 * count as u64, count * n)
                            .iter()
                            .map(|v| v * 1e-20)
                            .collect();
                        let stride = count + 3;
                        let mut got = vec![7.0f32; rows * stride];
                        dots_tokens(isa, &q, &x, n, &mut got, stride);
                        let mut want = vec![7.0f32; rows * stride];
                        for r in 0..rows {
                            for k in 0..count {
                                want[r * stride + k] = dot(
                                    Isa::Scalar,
                                    &q[r * n..(r + 1) * n],
                                    &x[k * n..(k + 1) * n],
                                );
                            }
                        }
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{isa:?} n={n} rows={rows} count={count}"
                        );
                    }
                }
            }
        }
    }

    /// The packed-row ops on every path against their reference (the scalar decode of the
    /// stream, then the scalar op): every width, token counts with every tail of a group of 8,
    /// query rows 1..=5, row lengths with a tail register, one weight per token or per group
    /// (groups of 8 and 24: AVX2's fused path only).
    #[test]
    fn packed_row_ops_match_decode_then_op() {
        let table: Vec<f32> = (0..256).map(|i| (i as f32 - 7.5) * 0.37).collect();
        let signs: Vec<f32> = [1.0f32, -1.0].into_iter().chain([0.0; 254]).collect();
        let bits_of = bits;
        for isa in Isa::available() {
            for bits in 1..=8u32 {
                let table = if bits == 1 { &signs } else { &table };
                for n in [8usize, 16, 24, 40, 64, 72, 128, 4, 6, 2, 12, 20] {
                    if !(n * bits as usize).is_multiple_of(8) {
                        continue;
                    }
                    for count in (0..=19).chain([31, 32, 33]) {
                        let len = (count * n * bits as usize).div_ceil(8);
                        let packed: Vec<u8> = (0..len)
                            .map(|i| ((i as u64 * 0x9E37_79B9) >> 7) as u8)
                            .collect();
                        let mut x = vec![0.0f32; count * n];
                        decode_packed(Isa::Scalar, &packed, bits, table, &mut x);
                        // The stream alone, and running on into other bytes (as a block of a
                        // longer buffer).
                        let mut longer = packed.clone();
                        longer.extend([0xA7u8; 9]);
                        for packed in [&packed[..], &longer[..]] {
                            for rows in 1..=5 {
                                let at =
                                    format!("{isa:?} bits={bits} n={n} count={count} rows={rows}");
                                if n.is_multiple_of(8) {
                                    let q: Vec<f32> = values(n as u64 + 5, rows * n);
                                    let stride = count + 3;
                                    let mut got = vec![7.0f32; rows * stride];
                                    let codes = (bits, &table[..]);
                                    dots_tokens_packed(
                                        isa,
                                        &q,
                                        (packed, count),
                                        codes,
                                        n,
                                        &mut got,
                                        stride,
                                    );
                                    let mut want = vec![7.0f32; rows * stride];
                                    dots_tokens(Isa::Scalar, &q, &x, n, &mut want, stride);
                                    assert_eq!(bits_of(&got), bits_of(&want), "dots {at}");
                                }
                                for group in [0, 8, 16, 24, 32] {
                                    let (groups, group) = match group {
                                        0 => (1, n),
                                        g => (n.div_ceil(g), g),
                                    };
                                    let w: Vec<f32> = values(300 + n as u64, rows * count * groups);
                                    let o = values(40 + n as u64, rows * n);
                                    let (mut a, mut b) = (o.clone(), o);
                                    let shape = (groups, group);
                                    axpy_rows_packed(
                                        isa,
                                        (&mut a, rows),
                                        &w,
                                        shape,
                                        (packed, n * bits as usize / 8, bits, table),
                                    );
                                    axpy_rows(Isa::Scalar, (&mut b, rows), &w, shape, &x, n);
                                    assert_eq!(bits_of(&a), bits_of(&b), "axpy {at} group={group}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// [`zero_point_sums`] on every path against the scalar reference: query rows 0..=6 (blocks
    /// of four and a partial one), 1..=9 groups (registers of four and every tail), any token
    /// count, a block inside longer rows, sums inside longer rows of `acc`.
    #[test]
    fn zero_point_sums_match_scalar() {
        let bits_of = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for isa in Isa::available() {
            for rows in 0..=6usize {
                for groups in 1..=9usize {
                    for count in [0usize, 1, 2, 7, 33] {
                        let (n, at) = (count + 5, 3);
                        let p = values(rows as u64 + 11, rows * n);
                        let ze: Vec<f32> = values(groups as u64 + 3, count * groups)
                            .iter()
                            .map(|z| z * 1e30)
                            .collect();
                        let (stride, offset) = (groups + 4, 2);
                        let acc: Vec<f64> =
                            (0..rows * stride).map(|i| i as f64 * 0.1 - 1.0).collect();
                        let (mut a, mut b) = (acc.clone(), acc);
                        let pn = (&p[..], n, at);
                        zero_point_sums(isa, pn, (&ze, groups), count, (&mut a, stride, offset));
                        scalar::zero_point_sums(pn, (&ze, groups), count, (&mut b, stride, offset));
                        assert_eq!(
                            bits_of(&a),
                            bits_of(&b),
                            "{isa:?} rows={rows} groups={groups} count={count}"
                        );
                    }
                }
            }
        }
    }

    /// [`axpy_rows_packed`] over rows longer than their codes (a group of tokens of each
    /// channel's row, as KIVI keys read them): any code count, rows of more bytes, the last row
    /// ending the buffer.
    #[test]
    fn strided_packed_rows_match_decode_then_op() {
        let bits_of = bits;
        let table: Vec<f32> = (0..256).map(|i| (i as f32 - 7.5) * 0.37).collect();
        let signs: Vec<f32> = [1.0f32, -1.0].into_iter().chain([0.0; 254]).collect();
        for isa in Isa::available() {
            for bits in 1..=4u32 {
                let table = if bits == 1 { &signs } else { &table };
                for n in [1usize, 5, 15, 16, 17, 31, 32, 33, 40, 64, 72] {
                    for extra in [0usize, 1, 3] {
                        let rb = (n * bits as usize).div_ceil(8) + extra;
                        for count in [0usize, 1, 2, 5, 9, 17] {
                            let packed: Vec<u8> = (0..count * rb)
                                .map(|i| ((i as u64 * 0x9E37_79B9) >> 5) as u8)
                                .collect();
                            let mut x = vec![0.0f32; count * n];
                            for (c, xc) in x.chunks_exact_mut(n).enumerate() {
                                decode_packed(Isa::Scalar, &packed[c * rb..], bits, table, xc);
                            }
                            for rows in 1..=5 {
                                let w: Vec<f32> = values(70 + n as u64, rows * count);
                                let o = values(9 + n as u64, rows * n);
                                let (mut a, mut b) = (o.clone(), o);
                                let codes = (&packed[..], rb, bits, &table[..]);
                                axpy_rows_packed(isa, (&mut a, rows), &w, (1, n), codes);
                                axpy_rows(Isa::Scalar, (&mut b, rows), &w, (1, n), &x, n);
                                assert_eq!(
                                    bits_of(&a),
                                    bits_of(&b),
                                    "{isa:?} bits={bits} n={n} rb={rb} count={count} rows={rows}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn transforms_match_to_the_last_bit() {
        for isa in simd_isas() {
            for log in 1..=11 {
                let n = 1usize << log;
                let x: Vec<f32> = values(log, n).iter().map(|v| v * 1e-5).collect();
                let mult = values(99 + log, n);
                for m in [None, Some(&mult[..])] {
                    let (mut a, mut b) = (x.clone(), x.clone());
                    fwht(isa, &mut a, m);
                    fwht(Isa::Scalar, &mut b, m);
                    assert_eq!(bits(&a), bits(&b), "{isa:?} n={n}");
                }
            }
        }
    }

    #[test]
    fn elementwise_primitives_match_to_the_last_bit() {
        for isa in simd_isas() {
            for n in 0..=70 {
                let x = values(n as u64, n);
                let s = values(500 + n as u64, n);
                let sb: Vec<u32> = (0..n)
                    .map(|i| if i % 3 == 0 { 0x8000_0000 } else { 0 })
                    .collect();
                for mul in [1.0f32, 0.0, 2.5e-3, 7.0e20] {
                    let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
                    finish(isa, &x, &sb, mul, &mut a);
                    finish(Isa::Scalar, &x, &sb, mul, &mut b);
                    assert_eq!(bits(&a), bits(&b));
                    let (mut a, mut b) = (x.clone(), x.clone());
                    scale(isa, &mut a, mul);
                    scale(Isa::Scalar, &mut b, mul);
                    assert_eq!(bits(&a), bits(&b));
                }
                // Five axpys in one pass against the same axpys one at a time in f64.
                let rows = values(500 + n as u64, 5 * n);
                for w in [1.0f32, -0.37, 1e-30, 3e20] {
                    let ws: Vec<f64> = (0..5)
                        .map(|i| f64::from(w) * (1.1 - 0.3 * i as f64))
                        .collect();
                    let acc: Vec<f64> = x.iter().map(|&v| f64::from(v) * 1e-3).collect();
                    let mut want = acc.clone();
                    for (&wi, row) in ws.iter().zip(rows.chunks_exact(n.max(1))) {
                        for (a, &v) in want.iter_mut().zip(row) {
                            *a += wi * f64::from(v);
                        }
                    }
                    let mut a = acc;
                    axpy_many_f64(isa, &mut a, &ws, &rows);
                    let b64 = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(b64(&a), b64(&want), "{isa:?} n={n}");
                }
                let m: Vec<f64> = values(300 + n as u64, 9 * n)
                    .iter()
                    .map(|&v| f64::from(v) * 1.3)
                    .collect();
                let xs: Vec<f64> = values(400 + n as u64, 9)
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect();
                let (mut a, mut b) = (vec![0.0f32; n], vec![0.0f32; n]);
                project_f64(isa, &xs, &m, &mut a);
                project_f64(Isa::Scalar, &xs, &m, &mut b);
                assert_eq!(bits(&a), bits(&b), "project_f64 {isa:?} n={n}");
                let mat = values(77 + n as u64, 5 * n + 12);
                for (stride, rows) in [(n, 1), (n + 3, 3), (n, 5)] {
                    let o = values(40 + n as u64, rows * n);
                    for group in [0, 1, 8, 16, 32, 48] {
                        // group 0: one weight per token, (1, n).
                        let (groups, group) = match group {
                            0 => (1, n.max(1)),
                            g => (n.div_ceil(g), g),
                        };
                        let w: Vec<f32> = values(300 + n as u64, rows * 5 * groups)
                            .iter()
                            .map(|v| v * 1e-20)
                            .collect();
                        let (mut a, mut b) = (o.clone(), o.clone());
                        let shape = (groups, group);
                        axpy_rows(isa, (&mut a, rows), &w, shape, &mat, stride);
                        axpy_rows(Isa::Scalar, (&mut b, rows), &w, shape, &mat, stride);
                        let at = format!("{isa:?} n={n} rows={rows} group={group}");
                        assert_eq!(bits(&a), bits(&b), "{at}");
                    }
                }
                for negative in [false, true] {
                    let (mut a, mut b) = (x.clone(), x.clone());
                    add_signed(isa, &mut a, &s, negative);
                    add_signed(Isa::Scalar, &mut b, &s, negative);
                    assert_eq!(bits(&a), bits(&b));
                }
                let (mut a, mut b) = (vec![0u8; n.div_ceil(8)], vec![0u8; n.div_ceil(8)]);
                sign_bits(isa, &x, &mut a);
                sign_bits(Isa::Scalar, &x, &mut b);
                assert_eq!(a, b);
                assert!(all_finite(isa, &x));
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    for pos in [0, n / 2, n.saturating_sub(1)]
                        .into_iter()
                        .filter(|&p| p < n)
                    {
                        let mut y = x.clone();
                        y[pos] = bad;
                        assert!(!all_finite(isa, &y), "{isa:?} n={n} pos={pos}");
                    }
                }
            }
        }
    }

    #[test]
    fn scale_max_and_widening_sums_match_the_scalar_path() {
        for isa in simd_isas() {
            for n in 0..=70 {
                let x = values(5000 + n as u64, n);
                for k in [0.125f32, -3.0, 1e30] {
                    let (mut a, mut b) = (x.clone(), x.clone());
                    let (ma, mb) = (scale_max(isa, &mut a, k), scale_max(Isa::Scalar, &mut b, k));
                    assert_eq!(bits(&a), bits(&b), "{isa:?} n={n} k={k}");
                    // Equal values (a zero's sign may differ with the order of the comparisons).
                    assert_eq!(ma, mb, "{isa:?} n={n} k={k}");
                    assert_eq!(
                        ma.is_none(),
                        !b.iter().all(|v| v.is_finite()),
                        "{isa:?} n={n} k={k}"
                    );
                    if n > 0 && mb.is_some() {
                        let want = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        assert_eq!(mb, Some(want));
                    }
                }
                if n > 0 {
                    let mut y = x.clone();
                    y[n / 2] = f32::NAN;
                    assert_eq!(scale_max(isa, &mut y, 1.0), None, "{isa:?} n={n}");
                }
                let acc0: Vec<f64> = values(7000 + n as u64, n)
                    .iter()
                    .map(|&v| f64::from(v) * 1.5)
                    .collect();
                let (mut a, mut b) = (acc0.clone(), acc0);
                add_to_f64(isa, &mut a, &x);
                add_to_f64(Isa::Scalar, &mut b, &x);
                let bits64 = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits64(&a), bits64(&b), "{isa:?} n={n}");
            }
        }
    }

    #[test]
    fn exp_sums_and_float16_blocks_match_to_the_last_bit() {
        for isa in simd_isas() {
            for n in 0..=70 {
                // Logits below a maximum, down past the underflow bound, and exact ties.
                let x: Vec<f32> = values(n as u64, n)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| if i % 5 == 0 { 0.0 } else { -(v.abs() % 120.0) })
                    .collect();
                for m in [0.0f32, 0.37, 30.0] {
                    let (mut a, mut b) = (x.clone(), x.clone());
                    let (sa, sb) = (exp_sum(isa, &mut a, m), exp_sum(Isa::Scalar, &mut b, m));
                    assert_eq!(bits(&a), bits(&b), "{isa:?} n={n} m={m}");
                    assert_eq!(sa.to_bits(), sb.to_bits(), "{isa:?} n={n} m={m}");
                }
                // Every class of float16: zero, subnormal, normal, the largest, infinities.
                let h: Vec<u16> = (0..n as u32)
                    .map(|i| {
                        (i.wrapping_mul(40_503) >> 3) as u16
                            ^ [0, 0x7c00, 0x0001, 0x7bff][i as usize % 4]
                    })
                    .collect();
                let (mut a, mut b) = (vec![0.0f32; n], vec![0.0f32; n]);
                f16_to_f32(isa, &h, &mut a);
                f16_to_f32(Isa::Scalar, &h, &mut b);
                assert_eq!(bits(&a), bits(&b), "{isa:?} n={n}");
            }
        }
    }

    /// Every pack path this CPU runs (whatever the dispatcher picks), every width, lengths
    /// with every tail of a group of 8 and past the 8-byte word reads at the row's end, codes
    /// covering each width's range: the scalar bytes, and unpacking gives the codes back.
    #[test]
    fn every_pack_path_matches_the_scalar_bytes() {
        let paths = PackPath::available();
        assert!(paths.contains(&PackPath::Shift));
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            paths.contains(&PackPath::Bmi2),
            std::is_x86_feature_detected!("bmi2")
        );
        for bits in 1..=8u32 {
            let mask = (1u64 << bits) - 1;
            for count in (0..=72).chain([127, 128, 129, 1000, 1031]) {
                let codes: Vec<u8> = (0..count as u64)
                    .map(|i| ((i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 29) & mask) as u8)
                    .collect();
                let len = (count * bits as usize).div_ceil(8);
                let mut want = vec![0u8; len];
                scalar::pack_row(&codes, bits, &mut want);
                for &path in &paths {
                    let mut got = vec![0xA5u8; len];
                    pack_row_on(path, &codes, bits, &mut got);
                    assert_eq!(got, want, "{path:?} bits={bits} count={count}");
                    let mut back = vec![0xA5u8; count];
                    unpack_row_on(path, &want, bits, &mut back);
                    assert_eq!(back, codes, "{path:?} bits={bits} count={count}");
                    // A short read of the codes of a longer row (the trailing bytes belong
                    // to later codes and must not leak into these).
                    let mut part = vec![0u8; count / 2];
                    unpack_row_on(path, &want, bits, &mut part);
                    assert_eq!(
                        part,
                        codes[..count / 2],
                        "{path:?} bits={bits} count={count}"
                    );
                }
            }
        }
    }

    #[test]
    fn search_and_lookup_match_for_every_width() {
        for bits_ in 1..=8u32 {
            // Increasing boundaries padded with +inf to 16 entries, a 256-entry lookup.
            let levels = 1usize << bits_;
            let bounds: Vec<f32> = (1..levels)
                .map(|i| (i as f32 - levels as f32 / 2.0) / 7.0)
                .collect();
            let mut table = bounds.clone();
            table.resize(table.len().max(16).max(levels), f32::INFINITY);
            let lookup: Vec<f32> = (0..256).map(|i| (i as f32 - 3.5) * 0.37).collect();
            let (table, lookup) = (&table[..], &lookup[..]);
            let mut x = values(u64::from(bits_), 67);
            for &b in &bounds {
                x.extend([b, -b, f32::from_bits(b.to_bits() + 1)]);
            }
            let codes: Vec<u8> = (0..x.len()).map(|i| (i % (1 << bits_)) as u8).collect();
            for isa in simd_isas() {
                for div in [None, Some(3.0f32), Some(1e-30)] {
                    let (mut a, mut b) = (vec![0u8; x.len()], vec![0u8; x.len()]);
                    encode(isa, &x, div, table, bits_, &mut a);
                    encode(Isa::Scalar, &x, div, table, bits_, &mut b);
                    assert_eq!(a, b, "{isa:?} bits={bits_} div={div:?}");
                }
                for mul in [1.0f32, -0.5, 1e30] {
                    let (mut a, mut b) = (vec![0.0; x.len()], vec![0.0; x.len()]);
                    decode(isa, &codes, lookup, bits_, mul, &mut a);
                    decode(Isa::Scalar, &codes, lookup, bits_, mul, &mut b);
                    assert_eq!(bits(&a), bits(&b), "{isa:?} bits={bits_}");
                }
                for count in (0..=40).chain([64, codes.len()]) {
                    let c = &codes[..count];
                    let len = (count * bits_ as usize).div_ceil(8);
                    let (mut p1, mut p2) = (vec![0u8; len], vec![0u8; len]);
                    pack_row(isa, c, bits_, &mut p1);
                    pack_row(Isa::Scalar, c, bits_, &mut p2);
                    assert_eq!(p1, p2, "{isa:?} bits={bits_} count={count}");
                    let mut u = vec![0u8; count];
                    unpack_row(isa, &p1, bits_, &mut u);
                    assert_eq!(u, c);
                    let (mut a, mut b) = (vec![0.0; count], vec![0.0; count]);
                    decode_packed(isa, &p1, bits_, lookup, &mut a);
                    decode_packed(Isa::Scalar, &p1, bits_, lookup, &mut b);
                    assert_eq!(bits(&a), bits(&b), "{isa:?} bits={bits_} count={count}");
                    let want: Vec<f32> = c.iter().map(|&k| lookup[usize::from(k)]).collect();
                    assert_eq!(bits(&b), bits(&want), "bits={bits_} count={count}");
                }
                // Short rows of a strided buffer, as the per-channel keys read one group.
                let rb = (codes.len() * bits_ as usize).div_ceil(8);
                let mut packed = vec![0u8; 5 * rb];
                for r in 0..5 {
                    let row: Vec<u8> = codes
                        .iter()
                        .map(|&k| k ^ (r as u8 & ((1u32 << bits_) - 1) as u8))
                        .collect();
                    pack_row(Isa::Scalar, &row, bits_, &mut packed[r * rb..(r + 1) * rb]);
                }
                for len in [1usize, 7, 16, 24, 32, 33, codes.len()] {
                    let (mut a, mut b) = (vec![0.0; 5 * len], vec![0.0; 5 * len]);
                    decode_packed_rows(isa, &packed, (rb, len), bits_, lookup, &mut a);
                    for (r, o) in b.chunks_exact_mut(len).enumerate() {
                        decode_packed(Isa::Scalar, &packed[r * rb..], bits_, lookup, o);
                    }
                    assert_eq!(bits(&a), bits(&b), "{isa:?} bits={bits_} len={len}");
                }
            }
        }
    }
}
