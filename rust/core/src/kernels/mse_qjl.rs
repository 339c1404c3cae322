//! The MSE stage followed by a 1-bit QJL sketch of its rotated residual, in one call: the
//! `kqv` / `qkqv` value encoder (and `qkqv` key encoder) of docs/schemes.md. A composition of
//! the mse, pack, lloyd_max, hadamard and qjl kernels, no kernel of its own: the bytes equal the
//! Python composition (`MSEQJLCoder.encode`), which pays five native calls where a decode step
//! appending one token pays one here.

use std::sync::Arc;

use super::hadamard::Rotation;
use super::mse::MseQuantizer;
use super::pack::pack;
use super::qjl::{QjlSketch, QjlSketcher};
use super::rows_of;
use crate::error::{KvqError, Result};
use crate::scalars::ScalarPlane;
use crate::simd::{self, ops};

/// Encoder of `(bits - 1)`-bit rotated MSE codes plus the QJL sketch of `R x - ||x|| c`.
#[derive(Debug, Clone)]
pub struct MseQjlEncoder {
    mse: MseQuantizer,
    rotation: Rotation,
    sketcher: Arc<QjlSketcher>,
}

/// What [`MseQjlEncoder::encode`] stores per row.
#[derive(Debug, Clone, PartialEq)]
pub struct MseQjlCodes {
    /// rows x `packed_len(code_dim, bits - 1)` bytes of packed MSE codes.
    pub packed: Vec<u8>,
    /// One stored `||x||` per row.
    pub norms: ScalarPlane,
    /// Sign bits and stored `||r||` of the residual sketch (`m = code_dim`).
    pub sketch: QjlSketch,
}

impl MseQjlEncoder {
    /// `bits` is the whole budget n in 2..=8: n - 1 MSE bits and one sketch bit per coordinate;
    /// `seed` the rotation's, `qjl_seed` the sketch's. Errors on a bad head_dim or bits.
    pub fn new(head_dim: usize, bits: u32, seed: u64, qjl_seed: u64) -> Result<Self> {
        if !(2..=8).contains(&bits) {
            return Err(KvqError::InvalidBits {
                arg: "bits",
                min: 2,
                max: 8,
                actual: i64::from(bits),
            });
        }
        let mse = MseQuantizer::new(head_dim, bits - 1, Some(seed))?;
        let cd = mse.code_dim();
        Ok(Self {
            rotation: Rotation::new(head_dim, Some(seed))?,
            sketcher: QjlSketcher::cached(cd, cd, qjl_seed)?,
            mse,
        })
    }

    /// Code-domain dimension d' (the sketch size too).
    pub fn code_dim(&self) -> usize {
        self.mse.code_dim()
    }

    /// Encodes rows of head_dim values. Errors as the kernels it sequences: ragged or
    /// non-finite input (`x`), a norm or residual norm beyond float32 (`x`, `r`).
    pub fn encode(&self, x: &[f32]) -> Result<MseQjlCodes> {
        let isa = simd::active();
        let (cd, bits) = (self.code_dim(), self.mse.codebook().bits);
        let rows = rows_of("x", x.len(), self.rotation.head_dim())?;
        let base = self.mse.encode(x)?;
        let packed = if rows == 0 {
            Vec::new()
        } else {
            pack(&base.codes, cd, bits)?
        };
        // The residual is formed from the stored (rounded) norm, as a decoder sees it.
        let mut residual = self.rotation.forward(x)?;
        let mut recon = vec![0.0f32; rows * cd];
        self.mse.codebook().decode_into(&base.codes, &mut recon);
        for (row, (r, c)) in residual
            .chunks_exact_mut(cd)
            .zip(recon.chunks_exact_mut(cd))
            .enumerate()
        {
            ops::scale(isa, c, base.norms.get(row));
            r.iter_mut().zip(c.iter()).for_each(|(r, c)| *r -= c);
        }
        let sketch = self.sketcher.sketch(&residual)?;
        Ok(MseQjlCodes {
            packed,
            norms: base.norms,
            sketch,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::pack::unpack;

    fn rows(n: usize, d: usize, seed: u32) -> Vec<f32> {
        (0..n * d)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    /// The composition step by step with the public kernel calls, as the Python coder runs it.
    fn composed(d: usize, bits: u32, seed: u64, qjl: u64, x: &[f32]) -> MseQjlCodes {
        let mse = MseQuantizer::new(d, bits - 1, Some(seed)).unwrap();
        let cd = mse.code_dim();
        let (packed, norms) = mse.encode_packed(x).unwrap();
        let codes = unpack(&packed, cd, bits - 1).unwrap();
        let mut c = vec![0.0f32; codes.len()];
        mse.codebook().decode_into(&codes, &mut c);
        let h = Rotation::new(d, Some(seed)).unwrap().forward(x).unwrap();
        let r: Vec<f32> = h
            .iter()
            .zip(&c)
            .enumerate()
            .map(|(i, (h, c))| h - c * norms.get(i / cd))
            .collect();
        let sketch = QjlSketcher::new(cd, cd, qjl).unwrap().sketch(&r).unwrap();
        MseQjlCodes {
            packed,
            norms,
            sketch,
        }
    }

    #[test]
    fn equals_the_kernels_in_sequence() {
        for (d, bits, n) in [(64, 4, 3), (40, 2, 5), (128, 8, 1), (7, 3, 0)] {
            let x = rows(n, d, d as u32 * 31 + bits);
            let enc = MseQjlEncoder::new(d, bits, 11, 12).unwrap();
            assert_eq!(enc.encode(&x).unwrap(), composed(d, bits, 11, 12, &x));
        }
    }

    #[test]
    fn refuses_bad_bits_and_non_finite_rows() {
        assert!(MseQjlEncoder::new(64, 1, 1, 2).is_err());
        let enc = MseQjlEncoder::new(8, 4, 1, 2).unwrap();
        let mut x = rows(2, 8, 1);
        x[9] = f32::NAN;
        assert!(enc.encode(&x).is_err());
        assert!(enc.encode(&x[..7]).is_err());
    }
}
