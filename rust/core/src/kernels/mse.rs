//! Norm-and-direction quantization, the MSE stage (SPEC 2.4; docs/kernels.md section 5):
//! store `||x||`, quantize the rotated unit vector coordinate-wise with the Lloyd-Max codebook.
//! Composes the hadamard and lloyd_max kernels.

use std::sync::Arc;

use super::hadamard::Rotation;
use super::lloyd_max::{codebook, Codebook};
use super::{check_bits, check_finite, check_head_dim, rows_of};
use crate::error::{KvqError, Result};
use crate::reduce::norm_f64;
use crate::scalars::ScalarPlane;

/// The MSE quantizer for one (head_dim, bits, rotation seed).
#[derive(Debug, Clone)]
pub struct MseQuantizer {
    head_dim: usize,
    /// `None` for schemes without rotation (`kv`): codes then live in R^head_dim.
    rotation: Option<Rotation>,
    codebook: Arc<Codebook>,
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
        Ok(Self {
            head_dim,
            rotation,
            codebook: codebook(code_dim, bits)?,
        })
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
            Some(r) => r.forward_row(x, unit),
            None => unit.copy_from_slice(x),
        }
        if norm > 0.0 {
            unit.iter_mut().for_each(|v| *v /= norm);
        } else {
            unit.fill(0.0);
        }
        Ok(norm)
    }

    /// Encodes rows of head_dim values. Errors on ragged or non-finite input.
    pub fn encode(&self, x: &[f32]) -> Result<MseCodes> {
        let rows = rows_of("x", x.len(), self.head_dim)?;
        check_finite("x", x, self.head_dim)?;
        let cd = self.code_dim();
        let mut codes = vec![0u8; rows * cd];
        let mut norms = vec![0.0f32; rows];
        let mut unit = vec![0.0f32; cd];
        for (i, (src, dst)) in x
            .chunks_exact(self.head_dim)
            .zip(codes.chunks_exact_mut(cd))
            .enumerate()
        {
            norms[i] = self.direction_row(src, i, &mut unit)?;
            self.codebook.encode_into(&unit, dst);
        }
        Ok(MseCodes {
            codes,
            norms: ScalarPlane::store(&norms),
        })
    }

    /// Decodes `norm * R^T centroids[codes]` into rows of head_dim values.
    pub fn decode(&self, codes: &MseCodes) -> Result<Vec<f32>> {
        let cd = self.code_dim();
        let rows = rows_of("codes", codes.codes.len(), cd)?;
        codes.norms.validate("norms", rows)?;
        check_codes("codes", &codes.codes, cd, self.codebook.bits)?;
        let mut out = vec![0.0f32; rows * self.head_dim];
        let mut buf = vec![0.0f32; cd];
        for (i, (src, dst)) in codes
            .codes
            .chunks_exact(cd)
            .zip(out.chunks_exact_mut(self.head_dim))
            .enumerate()
        {
            self.decode_row(src, codes.norms.get(i), &mut buf, dst);
        }
        Ok(out)
    }

    /// Decodes one row; `buf` has code_dim values of scratch.
    pub fn decode_row(&self, codes: &[u8], norm: f32, buf: &mut [f32], out: &mut [f32]) {
        self.codebook.decode_into(codes, buf);
        match &self.rotation {
            Some(r) => r.inverse_row(buf, out),
            None => out.copy_from_slice(buf),
        }
        out.iter_mut().for_each(|v| *v *= norm);
    }
}

/// Rejects codes >= 2^bits, naming the first position.
pub fn check_codes(arg: &'static str, codes: &[u8], width: usize, bits: u32) -> Result<()> {
    let limit = 1u32 << bits;
    match codes.iter().position(|&c| u32::from(c) >= limit) {
        None => Ok(()),
        Some(i) => Err(KvqError::CodeOutOfRange {
            arg,
            row: i / width,
            col: i % width,
            value: u32::from(codes[i]),
            bits,
            limit,
        }),
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
