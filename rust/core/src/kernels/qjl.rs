//! QJL: a 1-bit Johnson-Lindenstrauss sign sketch of a residual, with its unbiased inner-product
//! and vector estimators (SPEC 2.5; docs/kernels.md section 6). The reference sketch is the
//! dense Gaussian matrix S (m x d') of the seeded generator.

use std::collections::HashMap;
use std::f64::consts::PI;
use std::sync::{Arc, Mutex, OnceLock};

use super::pack::{pack, packed_len, unpack};
use super::{check_finite, rows_of};
use crate::error::{KvqError, Result};
use crate::reduce::{dot, norm_f64};
use crate::rng::qjl_matrix;
use crate::scalars::ScalarPlane;

type SketcherCache = Mutex<HashMap<(usize, usize, u64), Arc<QjlSketcher>>>;

/// A sketch operator for residuals of dimension `dim` with `m` sign bits.
#[derive(Debug, Clone)]
pub struct QjlSketcher {
    dim: usize,
    m: usize,
    s: Vec<f32>,
}

/// Packed sign bits (1 = negative) and stored residual norms of a batch of rows.
#[derive(Debug, Clone, PartialEq)]
pub struct QjlSketch {
    /// rows x ceil(m / 8) bytes.
    pub signs: Vec<u8>,
    /// One stored `||r||` per row.
    pub norms: ScalarPlane,
}

impl QjlSketcher {
    /// Builds the sketch operator; errors if `dim` or `m` is zero.
    pub fn new(dim: usize, m: usize, seed: u64) -> Result<Self> {
        super::check_row_len("dim", dim)?;
        super::check_row_len("m", m)?;
        super::check_matrix("m * dim", m, dim)?;
        Ok(Self {
            dim,
            m,
            s: qjl_matrix(seed, m, dim),
        })
    }

    /// A shared sketcher for (dim, m, seed), built once: the Gaussian matrix costs m x dim
    /// Box-Muller draws. The cache holds at most 64 operators.
    pub fn cached(dim: usize, m: usize, seed: u64) -> Result<Arc<Self>> {
        static CACHE: OnceLock<SketcherCache> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        if let Some(s) = cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(dim, m, seed))
        {
            return Ok(s.clone());
        }
        let built = Arc::new(Self::new(dim, m, seed)?);
        let mut guard = cache.lock().unwrap_or_else(|e| e.into_inner());
        if guard.len() >= 64 {
            guard.clear();
        }
        guard.insert((dim, m, seed), built.clone());
        Ok(built)
    }

    /// Sketch size m (bits per row).
    pub fn m(&self) -> usize {
        self.m
    }

    /// Residual dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The matrix S, row-major m x dim.
    pub fn matrix(&self) -> &[f32] {
        &self.s
    }

    /// `out = S y` for one row.
    pub fn project_row(&self, y: &[f32], out: &mut [f32]) {
        for (o, srow) in out.iter_mut().zip(self.s.chunks_exact(self.dim)) {
            *o = dot(srow, y);
        }
    }

    /// Sketches rows of `dim` values. Errors on ragged or non-finite input.
    pub fn sketch(&self, r: &[f32]) -> Result<QjlSketch> {
        let rows = rows_of("r", r.len(), self.dim)?;
        check_finite("r", r, self.dim)?;
        let mut bits = vec![0u8; rows * self.m];
        let mut norms = vec![0.0f32; rows];
        let mut proj = vec![0.0f32; self.m];
        for (i, (row, dst)) in r
            .chunks_exact(self.dim)
            .zip(bits.chunks_exact_mut(self.m))
            .enumerate()
        {
            norms[i] = norm_f64(row) as f32;
            if !norms[i].is_finite() {
                return Err(KvqError::NormOverflow { arg: "r", row: i });
            }
            self.project_row(row, &mut proj);
            dst.iter_mut()
                .zip(&proj)
                .for_each(|(b, &t)| *b = u8::from(t < 0.0));
        }
        Ok(QjlSketch {
            signs: pack(&bits, self.m, 1)?,
            norms: ScalarPlane::store(&norms),
        })
    }

    /// `+-1` signs of each sketched row (rows x m, float32) after validating the sketch.
    fn sign_rows(&self, sk: &QjlSketch) -> Result<(usize, Vec<f32>)> {
        let rows = rows_of("signs", sk.signs.len(), packed_len(self.m, 1))?;
        sk.norms.validate("norms", rows)?;
        let bits = unpack(&sk.signs, self.m, 1)?;
        Ok((
            rows,
            bits.iter().map(|&b| 1.0 - 2.0 * f32::from(b)).collect(),
        ))
    }

    /// Estimates `<y_i, r_j>` for every query row i and sketched row j: an (ny x nr) matrix,
    /// `sqrt(pi/2) / m * ||r_j|| * <S y_i, sign_j>`.
    pub fn inner_product(&self, y: &[f32], sk: &QjlSketch) -> Result<Vec<f32>> {
        let ny = rows_of("y", y.len(), self.dim)?;
        check_finite("y", y, self.dim)?;
        let (nr, signs) = self.sign_rows(sk)?;
        let k = ((PI / 2.0).sqrt() / self.m as f64) as f32;
        let mut out = vec![0.0f32; ny * nr];
        let mut sy = vec![0.0f32; self.m];
        for (yrow, orow) in y
            .chunks_exact(self.dim)
            .zip(out.chunks_exact_mut(nr.max(1)))
        {
            self.project_row(yrow, &mut sy);
            for (j, o) in orow.iter_mut().enumerate().take(nr) {
                *o = k * sk.norms.get(j) * dot(&sy, &signs[j * self.m..(j + 1) * self.m]);
            }
        }
        Ok(out)
    }

    /// Vector estimate `sqrt(pi/2) / m * ||r|| * S^T sign` of each sketched row (rows x dim).
    pub fn vector_estimate(&self, sk: &QjlSketch) -> Result<Vec<f32>> {
        let (rows, signs) = self.sign_rows(sk)?;
        let k = ((PI / 2.0).sqrt() / self.m as f64) as f32;
        let mut out = vec![0.0f32; rows * self.dim];
        for (i, orow) in out.chunks_exact_mut(self.dim).enumerate() {
            // S^T sign as a signed sum of the rows of S, in increasing row order: contiguous
            // reads of S instead of a strided column gather per output coordinate.
            let sg = &signs[i * self.m..(i + 1) * self.m];
            for (srow, &sigma) in self.s.chunks_exact(self.dim).zip(sg) {
                if sigma > 0.0 {
                    orow.iter_mut().zip(srow).for_each(|(o, v)| *o += v);
                } else {
                    orow.iter_mut().zip(srow).for_each(|(o, v)| *o -= v);
                }
            }
            let scale = k * sk.norms.get(i);
            orow.iter_mut().for_each(|o| *o *= scale);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::gaussians;

    #[test]
    fn sign_of_zero_is_positive_and_norm_zero() {
        let q = QjlSketcher::new(16, 16, 1).unwrap();
        let sk = q.sketch(&[0.0; 16]).unwrap();
        assert_eq!(sk.signs, vec![0, 0]);
        assert_eq!(q.vector_estimate(&sk).unwrap(), vec![0.0; 16]);
    }

    #[test]
    fn inner_product_estimate_is_unbiased_over_seeds() {
        let d = 64;
        let r = gaussians(100, 9, d);
        let y = gaussians(101, 9, d);
        let truth: f64 = r.iter().zip(&y).map(|(a, b)| f64::from(a * b)).sum();
        let mut mean = 0.0f64;
        let n = 400;
        for seed in 0..n {
            let q = QjlSketcher::new(d, d, seed).unwrap();
            mean += f64::from(q.inner_product(&y, &q.sketch(&r).unwrap()).unwrap()[0]);
        }
        mean /= n as f64;
        // Standard error: sqrt(pi/2 * |r|^2 |y|^2 / m / n) ~ 0.5 here.
        assert!((mean - truth).abs() < 2.5, "{mean} vs {truth}");
    }
}
