//! Norm-and-direction quantization, the MSE stage (docs/kernels.md section 5):
//! store `||x||` (or the least-squares or norm-preserving scale of the decoded direction), quantize the rotated
//! unit vector coordinate-wise with the Lloyd-Max codebook.
//! Composes the hadamard and lloyd_max kernels.

use std::sync::Arc;

use super::hadamard::Rotation;
use super::lloyd_max::{codebook, Codebook};
use super::pack::packed_len;
use super::{check_bits, check_codes, check_finite, check_head_dim, check_len, rows_of};
use crate::alloc::output_vec;
use crate::error::{KvqError, Result};
use crate::par;
use crate::reduce::norm_f64;
use crate::scalars::{ScalarPlane, ScalarView};
use crate::simd::{ops, Isa, IsaChoice};

/// The per-row scalar the MSE stage stores (docs/kernels.md section 5, step 5). The decode is
/// the same for both (`scale * R^T c`): only the stored value differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowScale {
    /// `||x||` (the reference, TurboQuant's stored norm).
    #[default]
    Norm,
    /// `s = dot(x, r) / dot(r, r)` with `r` the decoded direction (the decode with scale 1),
    /// the scale minimising `||x - s r||^2`; 0 when `dot(x, r) <= 0` (a zero row).
    LeastSquares,
    /// `s = ||x|| / sqrt(dot(r, r))`: the decoded row keeps the input's norm. The Lloyd-Max
    /// centroids are conditional means, so `||r|| < 1` and the plain norm shrinks every decoded
    /// row by `sqrt(1 - D)` (`D` the codebook's distortion); this scale removes that bias.
    PreserveNorm,
}

impl RowScale {
    /// The mode of a name: `"norm"`, `"least_squares"` or `"preserve_norm"`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "norm" => Some(RowScale::Norm),
            "least_squares" => Some(RowScale::LeastSquares),
            "preserve_norm" => Some(RowScale::PreserveNorm),
            _ => None,
        }
    }
}

/// The MSE quantizer for one (head_dim, bits, rotation seed).
#[derive(Debug, Clone)]
pub struct MseQuantizer {
    head_dim: usize,
    /// `None` for schemes without rotation (`kv`): codes then live in R^head_dim.
    rotation: Option<Rotation>,
    codebook: Arc<Codebook>,
    /// 256-entry decode table of the SIMD paths: `centroid * (1/sqrt(d'))` with a rotation
    /// (the same float32 product the reference forms as the inverse's first step), the plain
    /// centroids without.
    decode_table: Vec<f32>,
    /// Code of a zero coordinate (every code of a zero row).
    zero_code: u8,
    /// What each row stores: its norm, the least-squares or the norm-preserving scale.
    scale: RowScale,
    isa: IsaChoice,
}

/// Codes and stored norms of a batch of rows.
#[derive(Debug, Clone, PartialEq)]
pub struct MseCodes {
    /// rows x code_dim codes, one byte each (unpacked).
    pub codes: Vec<u8>,
    /// One stored norm per row.
    pub norms: ScalarPlane,
}

impl MseQuantizer {
    /// Builds the quantizer; `seed = None` means no rotation (codebook dimension = head_dim).
    pub fn new(head_dim: usize, bits: u32, seed: Option<u64>) -> Result<Self> {
        check_bits("bits", bits)?;
        check_head_dim("head_dim", head_dim)?;
        let rotation = seed.map(|s| Rotation::new(head_dim, Some(s))).transpose()?;
        let code_dim = rotation.as_ref().map_or(head_dim, Rotation::padded_dim);
        let codebook = codebook(code_dim, bits)?;
        let decode_table = match &rotation {
            Some(r) => codebook
                .lookup_table()
                .iter()
                .map(|c| c * r.scale())
                .collect(),
            None => codebook.lookup_table().to_vec(),
        };
        Ok(Self {
            head_dim,
            rotation,
            zero_code: codebook.encode_value(0.0),
            codebook,
            decode_table,
            scale: RowScale::Norm,
            isa: IsaChoice::default(),
        })
    }

    /// Sets what the encoders store per row (the decoders do not depend on it).
    pub fn with_scale(mut self, scale: RowScale) -> Self {
        self.scale = scale;
        self
    }

    /// What the encoders store per row.
    pub fn scale(&self) -> RowScale {
        self.scale
    }

    /// Pins the instruction set (tests, benches); errors if this CPU lacks it.
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        self.isa = IsaChoice::pinned(isa)?;
        Ok(self)
    }

    /// The instruction set calls use now.
    pub fn isa(&self) -> Isa {
        self.isa.get()
    }

    /// Codes per row: d' with rotation, d without.
    pub fn code_dim(&self) -> usize {
        self.codebook.dim
    }

    /// The codebook in use.
    pub fn codebook(&self) -> &Codebook {
        &self.codebook
    }

    /// Unit direction of one row in the code domain: `R x / ||x||` (zeros for a zero row).
    /// Returns the norm.
    pub fn direction_row(&self, x: &[f32], row: usize, unit: &mut [f32]) -> Result<f32> {
        let norm = norm_f64(x) as f32;
        if !norm.is_finite() {
            return Err(KvqError::NormOverflow { arg: "x", row });
        }
        match &self.rotation {
            Some(r) => r.forward_row_isa(Isa::Scalar, x, unit),
            None => unit.copy_from_slice(x),
        }
        if norm > 0.0 {
            unit.iter_mut().for_each(|v| *v /= norm);
        } else {
            unit.fill(0.0);
        }
        Ok(norm)
    }

    /// Codes of one row (`unit`: code_dim values of scratch); `None` if the norm overflows or
    /// the row is not finite.
    fn encode_row(&self, isa: Isa, x: &[f32], unit: &mut [f32], codes: &mut [u8]) -> Option<f32> {
        if isa == Isa::Scalar {
            let norm = self.direction_row(x, 0, unit).ok()?;
            self.codebook.encode_into_isa(Isa::Scalar, unit, codes);
            return Some(norm);
        }
        let table = self.codebook.search_table();
        let bits = self.codebook.bits;
        if let Some(r) = &self.rotation {
            if let Some(norm) =
                ops::mse_encode_row(isa, x, r.mult(), table, bits, self.zero_code, codes)
            {
                return norm.is_finite().then_some(norm);
            }
        }
        // Same steps as the reference: float64 norm, rotation, float32 division, search.
        let norm = ops::norm_f64(isa, x) as f32;
        if !norm.is_finite() {
            return None;
        }
        if norm > 0.0 {
            match &self.rotation {
                Some(r) => {
                    r.forward_row_isa(isa, x, unit);
                    ops::encode(isa, unit, Some(norm), table, bits, codes);
                }
                None => ops::encode(isa, x, Some(norm), table, bits, codes),
            }
        } else {
            codes.fill(self.zero_code);
        }
        Some(norm)
    }

    /// Encodes rows of head_dim values. Errors on ragged or non-finite input.
    pub fn encode(&self, x: &[f32]) -> Result<MseCodes> {
        let rows = rows_of("x", x.len(), self.head_dim)?;
        let mut codes = vec![0u8; rows * self.code_dim()];
        let mut norms = vec![0.0f32; rows];
        self.encode_into(x, &mut codes, &mut norms)?;
        Ok(MseCodes {
            codes,
            norms: ScalarPlane::store(&norms),
        })
    }

    /// [`MseQuantizer::encode`] into a caller's buffers: `rows * code_dim` codes and `rows`
    /// float32 norms (before the storage rounding of [`ScalarPlane::store`]).
    pub fn encode_into(&self, x: &[f32], codes: &mut [u8], norms: &mut [f32]) -> Result<()> {
        self.encode_rows(x, (codes, "codes"), norms, false)
    }

    /// Bytes of one packed row: `packed_len(code_dim, bits)`.
    pub fn packed_row_len(&self) -> usize {
        packed_len(self.code_dim(), self.codebook.bits)
    }

    /// Encodes rows straight to packed codes, `packed_row_len()` bytes per row (docs/kernels.md section 2 bit
    /// order): the bytes of [`MseQuantizer::encode`] followed by [`super::pack::pack`], without
    /// the rows x code_dim buffer of unpacked codes (each row is packed from per-task scratch,
    /// so the output is written once). Errors as [`MseQuantizer::encode`].
    pub fn encode_packed(&self, x: &[f32]) -> Result<(Vec<u8>, ScalarPlane)> {
        let rows = rows_of("x", x.len(), self.head_dim)?;
        let mut packed = vec![0u8; rows * self.packed_row_len()];
        let mut norms = vec![0.0f32; rows];
        self.encode_packed_into(x, &mut packed, &mut norms)?;
        Ok((packed, ScalarPlane::store(&norms)))
    }

    /// [`MseQuantizer::encode_packed`] into a caller's buffers: `rows * packed_row_len()` bytes
    /// and `rows` float32 norms.
    pub fn encode_packed_into(
        &self,
        x: &[f32],
        packed: &mut [u8],
        norms: &mut [f32],
    ) -> Result<()> {
        self.encode_rows(x, (packed, "packed"), norms, true)
    }

    /// The row loop of both encoders: codes are written unpacked, or packed from a scratch row.
    fn encode_rows(
        &self,
        x: &[f32],
        (out, arg): (&mut [u8], &'static str),
        norms: &mut [f32],
        packed: bool,
    ) -> Result<()> {
        let isa = self.isa();
        let (d, cd, bits) = (self.head_dim, self.code_dim(), self.codebook.bits);
        let width = if packed { self.packed_row_len() } else { cd };
        let rows = rows_of("x", x.len(), d)?;
        check_len(arg, out.len(), rows * width, "rows x row width")?;
        check_len("norms", norms.len(), rows, "one per row")?;
        // A finite norm implies a finite row (the float64 sum of squares cannot overflow), so
        // the full input scan runs only to name an error, as the reference reports it.
        let ls = self.scale != RowScale::Norm;
        let done = par::rows2(
            rows,
            cd,
            (x, d),
            (out, width),
            (norms, 1),
            || {
                (
                    vec![0.0f32; cd],
                    vec![0u8; if packed { cd } else { 0 }],
                    vec![0.0f32; if ls { d } else { 0 }],
                )
            },
            |(unit, row_codes, dir), first, xs, cs, ns| {
                for (k, ((src, dst), n)) in xs
                    .chunks_exact(d)
                    .zip(cs.chunks_exact_mut(width))
                    .zip(ns.iter_mut())
                    .enumerate()
                {
                    let norm = if packed {
                        let norm = self.encode_row(isa, src, unit, row_codes);
                        ops::pack_row(isa, row_codes, bits, dst);
                        norm
                    } else {
                        self.encode_row(isa, src, unit, dst)
                    };
                    let norm = norm.ok_or(first + k)?;
                    *n = if ls {
                        let codes: &[u8] = if packed { row_codes } else { dst };
                        self.scale_row(isa, (src, norm), codes, unit, dir)
                            .ok_or(first + k)?
                    } else {
                        norm
                    };
                }
                Ok(())
            },
        );
        if let Err(row) = done {
            check_finite("x", x, d)?;
            return Err(KvqError::NormOverflow { arg: "x", row });
        }
        Ok(())
    }

    /// The stored scale of one coded row `x` of norm `norm`, from `r` = the decoded direction
    /// (the decode of `codes` with scale 1, into `dir`; `buf`: code_dim values of scratch) and
    /// section 8 float32 dot products: least squares `s = dot(x, r) / dot(r, r)` (0 when
    /// `dot(x, r) <= 0`), norm-preserving `s = norm / sqrt(dot(r, r))` (`norm` when
    /// `dot(r, r) = 0`), one float32 division. `None` when `s` is not finite (a row near
    /// float32's top).
    fn scale_row(
        &self,
        isa: Isa,
        (x, norm): (&[f32], f32),
        codes: &[u8],
        buf: &mut [f32],
        dir: &mut [f32],
    ) -> Option<f32> {
        self.decode_row_isa(isa, codes, 1.0, buf, dir);
        let den = ops::dot(isa, dir, dir);
        let s = if self.scale == RowScale::PreserveNorm {
            if den > 0.0 {
                norm / den.sqrt()
            } else {
                norm
            }
        } else {
            let num = ops::dot(isa, x, dir);
            if num > 0.0 && den > 0.0 {
                num / den
            } else {
                0.0
            }
        };
        s.is_finite().then_some(s)
    }

    /// Decodes `norm * R^T centroids[codes]` into rows of head_dim values.
    pub fn decode(&self, codes: &MseCodes) -> Result<Vec<f32>> {
        self.decode_parts(&codes.codes, codes.norms.view())
    }

    /// [`MseQuantizer::decode`] from borrowed codes and norms (no copy of the caller's buffers).
    pub fn decode_parts(&self, codes: &[u8], norms: ScalarView<'_>) -> Result<Vec<f32>> {
        let rows = rows_of("codes", codes.len(), self.code_dim())?;
        let mut out = output_vec(rows * self.head_dim);
        self.decode_into(codes, norms, &mut out)?;
        Ok(out)
    }

    /// [`MseQuantizer::decode_parts`] into a caller's buffer of `rows * head_dim` values.
    pub fn decode_into(&self, codes: &[u8], norms: ScalarView<'_>, out: &mut [f32]) -> Result<()> {
        let cd = self.code_dim();
        let rows = rows_of("codes", codes.len(), cd)?;
        self.decode_rows((codes, cd, rows), norms, out, false)
    }

    /// Decodes packed rows of `packed_row_len()` bytes (from [`MseQuantizer::encode_packed`]):
    /// the values of [`super::pack::unpack`] followed by [`MseQuantizer::decode_parts`], each
    /// row unpacked into per-task scratch (no rows x code_dim buffer). Every packed code is in
    /// range by construction; bits past the last code of a row are ignored, as `unpack` does.
    pub fn decode_packed(&self, packed: &[u8], norms: ScalarView<'_>) -> Result<Vec<f32>> {
        let rows = rows_of("packed", packed.len(), self.packed_row_len())?;
        let mut out = output_vec(rows * self.head_dim);
        self.decode_packed_into(packed, norms, &mut out)?;
        Ok(out)
    }

    /// [`MseQuantizer::decode_packed`] into a caller's buffer of `rows * head_dim` values.
    pub fn decode_packed_into(
        &self,
        packed: &[u8],
        norms: ScalarView<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        let width = self.packed_row_len();
        let rows = rows_of("packed", packed.len(), width)?;
        self.decode_rows((packed, width, rows), norms, out, true)
    }

    /// The row loop of both decoders; checks norms, unpacked codes and `out`.
    fn decode_rows(
        &self,
        (input, width, rows): (&[u8], usize, usize),
        norms: ScalarView<'_>,
        out: &mut [f32],
        packed: bool,
    ) -> Result<()> {
        let isa = self.isa();
        let (d, cd, bits) = (self.head_dim, self.code_dim(), self.codebook.bits);
        norms.validate("norms", rows)?;
        if !packed {
            check_codes("codes", input, cd, bits)?;
        }
        check_len("out", out.len(), rows * d, "rows x head_dim")?;
        // Valid codes and norms decode to `norm * R^T c`, which passes float32's range only for
        // norms near its top: checked per row while the row is in cache (no output scan).
        let done = par::rows1(
            rows,
            cd,
            (input, width),
            (out, d),
            || (vec![0.0f32; cd], vec![0u8; if packed { cd } else { 0 }]),
            |(buf, row_codes), first, cs, os| {
                for (k, (src, dst)) in cs
                    .chunks_exact(width)
                    .zip(os.chunks_exact_mut(d))
                    .enumerate()
                {
                    let codes = if packed {
                        ops::unpack_row(isa, src, bits, row_codes);
                        &row_codes[..]
                    } else {
                        src
                    };
                    self.decode_row_isa(isa, codes, norms.get(first + k), buf, dst);
                    if !ops::all_finite(isa, dst) {
                        return Err(first + k);
                    }
                }
                Ok(())
            },
        );
        done.map_err(|row| KvqError::NormOverflow { arg: "norms", row })
    }

    /// Decodes one row; `buf` has code_dim values of scratch.
    pub fn decode_row(&self, codes: &[u8], norm: f32, buf: &mut [f32], out: &mut [f32]) {
        self.decode_row_isa(self.isa(), codes, norm, buf, out);
    }

    fn decode_row_isa(&self, isa: Isa, codes: &[u8], norm: f32, buf: &mut [f32], out: &mut [f32]) {
        if isa != Isa::Scalar {
            let bits = self.codebook.bits;
            return match &self.rotation {
                // `(v * sign) * norm` is exactly `v * norm` with the sign bit flipped.
                Some(r)
                    if ops::mse_decode_row(
                        isa,
                        codes,
                        &self.decode_table,
                        bits,
                        r.sign_bits(),
                        norm,
                        out,
                    ) => {}
                Some(r) => {
                    ops::decode(isa, codes, &self.decode_table, bits, 1.0, buf);
                    ops::fwht(isa, buf, None);
                    ops::finish(isa, buf, r.sign_bits(), norm, out);
                }
                None => ops::decode(isa, codes, &self.decode_table, bits, norm, out),
            };
        }
        self.codebook.decode_into_isa(Isa::Scalar, codes, buf);
        match &self.rotation {
            Some(r) => r.inverse_row_isa(Isa::Scalar, buf, out),
            None => out.copy_from_slice(buf),
        }
        out.iter_mut().for_each(|v| *v *= norm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{gaussians, STREAM_QJL_MATRIX};

    #[test]
    fn zero_row_decodes_to_zeros() {
        let q = MseQuantizer::new(40, 3, Some(1)).unwrap();
        let c = q.encode(&[0.0; 40]).unwrap();
        assert_eq!(q.decode(&c).unwrap(), vec![0.0; 40]);
    }

    /// Squared reconstruction error of each row.
    fn row_errors(x: &[f32], xh: &[f32], d: usize) -> Vec<f64> {
        x.chunks(d)
            .zip(xh.chunks(d))
            .map(|(a, b)| a.iter().zip(b).map(|(u, v)| f64::from(u - v).powi(2)).sum())
            .collect()
    }

    #[test]
    fn least_squares_scale_keeps_codes_and_never_raises_the_error() {
        let ls = RowScale::LeastSquares;
        for (d, seed) in [(128, Some(7)), (96, Some(2)), (40, None)] {
            let mut x = gaussians(11, STREAM_QJL_MATRIX, 300 * d);
            x[..d].fill(0.0); // a zero row stores 0, never NaN
            for bits in 1..=8 {
                let q = MseQuantizer::new(d, bits, seed).unwrap();
                let (cn, cl) = (
                    q.encode(&x).unwrap(),
                    q.clone().with_scale(ls).encode(&x).unwrap(),
                );
                assert_eq!(cl.codes, cn.codes, "d={d} bits={bits}");
                assert_eq!(cl.norms.get(0).to_bits(), 0);
                let (en, el) = (
                    row_errors(&x, &q.decode(&cn).unwrap(), d),
                    row_errors(&x, &q.decode(&cl).unwrap(), d),
                );
                let mut n2 = x.chunks(d).map(|r| norm_f64(r).powi(2));
                for (row, (a, b)) in el.iter().zip(&en).enumerate() {
                    // The float16 storage of either scale may cost up to ~2^-22 ||x||^2.
                    let slack = 1e-6 * n2.next().unwrap();
                    assert!(a <= &(b + slack), "d={d} bits={bits} row={row}: {a} > {b}");
                }
            }
        }
    }

    #[test]
    fn preserve_norm_scale_keeps_codes_and_the_row_norm() {
        let pn = RowScale::PreserveNorm;
        for (d, seed) in [(128, Some(7)), (96, Some(2)), (40, None)] {
            let mut x = gaussians(13, STREAM_QJL_MATRIX, 200 * d);
            x[..d].fill(0.0); // a zero row stores 0, never NaN
            for bits in 1..=8 {
                let q = MseQuantizer::new(d, bits, seed).unwrap();
                let (cn, cp) = (
                    q.encode(&x).unwrap(),
                    q.clone().with_scale(pn).encode(&x).unwrap(),
                );
                assert_eq!(cp.codes, cn.codes, "d={d} bits={bits}");
                assert_eq!(cp.norms.get(0).to_bits(), 0);
                let (dn, dp) = (q.decode(&cn).unwrap(), q.decode(&cp).unwrap());
                let (mut plain, mut kept) = (0.0, 0.0);
                for (row, ((a, b), c)) in x
                    .chunks(d)
                    .zip(dp.chunks(d))
                    .zip(dn.chunks(d))
                    .enumerate()
                    .skip(1)
                {
                    let (n, np) = (norm_f64(a), norm_f64(b));
                    // float16 storage of the scale: a relative error below 2^-11.
                    assert!(
                        (np / n - 1.0).abs() < 1e-3,
                        "d={d} bits={bits} row={row}: {np} vs {n}"
                    );
                    (plain, kept) = (plain + norm_f64(c) / n, kept + np / n);
                }
                // On average the plain norm's decode is shorter (the centroids are conditional
                // means); a single row's decoded direction may be longer than 1. Past 4 bits
                // the shrinkage is below float16's rounding of the stored scale.
                assert!(
                    bits > 4 || plain < kept,
                    "d={d} bits={bits}: {plain} >= {kept}"
                );
            }
        }
    }

    #[test]
    fn mse_matches_theory_and_reencoding_is_stable() {
        let d = 128;
        let x = gaussians(5, STREAM_QJL_MATRIX, 2000 * d);
        for bits in 1..=4 {
            let q = MseQuantizer::new(d, bits, Some(7)).unwrap();
            let c = q.encode(&x).unwrap();
            let xh = q.decode(&c).unwrap();
            let mut rel = 0.0f64;
            for (a, b) in x.chunks(d).zip(xh.chunks(d)) {
                let n2: f64 = a.iter().map(|v| f64::from(*v).powi(2)).sum();
                let e2: f64 = a.iter().zip(b).map(|(u, v)| f64::from(u - v).powi(2)).sum();
                rel += e2 / n2;
            }
            rel /= 2000.0;
            let theory = q.codebook().distortion * d as f64;
            assert!(
                (rel / theory - 1.0).abs() < 0.05,
                "bits={bits}: {rel} vs {theory}"
            );
            assert_eq!(q.encode(&xh).unwrap().codes, c.codes);
        }
    }
}
