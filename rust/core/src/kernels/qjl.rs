//! QJL: a 1-bit Johnson-Lindenstrauss sign sketch of a residual, with its unbiased inner-product
//! and vector estimators (docs/kernels.md section 6). The reference sketch is the
//! dense Gaussian matrix S (m x d') of the seeded generator.

use std::f64::consts::PI;
use std::sync::Arc;

use super::pack::packed_len;
use super::{check_finite, rows_of};
use crate::alloc::output_vec;
use crate::error::{KvqError, Result};
use crate::memo::Memo;
use crate::par;
use crate::rng::qjl_matrix;
use crate::scalars::{ScalarPlane, ScalarView};
use crate::simd::{ops, Isa, IsaChoice};

/// A sketch operator for residuals of dimension `dim` with `m` sign bits.
#[derive(Debug, Clone)]
pub struct QjlSketcher {
    dim: usize,
    m: usize,
    s: Vec<f32>,
    isa: IsaChoice,
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
            isa: IsaChoice::default(),
        })
    }

    /// A shared sketcher for (dim, m, seed), built once: the Gaussian matrix costs m x dim
    /// Box-Muller draws. The cache holds at most 64 operators.
    pub fn cached(dim: usize, m: usize, seed: u64) -> Result<Arc<Self>> {
        static CACHE: Memo<(usize, usize, u64), QjlSketcher> = Memo::new(64);
        CACHE.get_or_try((dim, m, seed), || Self::new(dim, m, seed))
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

    /// Pins the instruction set (tests, benches); errors if this CPU lacks it.
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        self.isa = IsaChoice::pinned(isa)?;
        Ok(self)
    }

    /// The instruction set calls use now.
    pub fn isa(&self) -> Isa {
        self.isa.get()
    }

    /// `out = S y` for one row.
    pub fn project_row(&self, y: &[f32], out: &mut [f32]) {
        ops::dots(self.isa(), &self.s, y, out);
    }

    /// Sketches rows of `dim` values. Errors on ragged or non-finite input.
    pub fn sketch(&self, r: &[f32]) -> Result<QjlSketch> {
        let isa = self.isa();
        let (d, m) = (self.dim, self.m);
        let rows = rows_of("r", r.len(), d)?;
        let rb = packed_len(m, 1);
        let mut signs = vec![0u8; rows * rb];
        let mut norms = vec![0.0f32; rows];
        // A finite norm implies a finite row, so the full input scan only names an error.
        let done = par::rows2(
            rows,
            m * d,
            (r, d),
            (&mut signs, rb),
            (&mut norms, 1),
            || vec![0.0f32; m],
            |proj, first, rs, ss, ns| {
                for (k, ((row, dst), n)) in rs
                    .chunks_exact(d)
                    .zip(ss.chunks_exact_mut(rb))
                    .zip(ns.iter_mut())
                    .enumerate()
                {
                    *n = ops::norm_f64(isa, row) as f32;
                    if !n.is_finite() {
                        return Err(first + k);
                    }
                    ops::dots(isa, &self.s, row, proj);
                    ops::sign_bits(isa, proj, dst);
                }
                Ok(())
            },
        );
        if let Err(row) = done {
            check_finite("r", r, d)?;
            return Err(KvqError::NormOverflow { arg: "r", row });
        }
        Ok(QjlSketch {
            signs,
            norms: ScalarPlane::store(&norms),
        })
    }

    /// Validates packed signs and norms; returns the row count.
    fn check_sketch(&self, signs: &[u8], norms: ScalarView<'_>) -> Result<usize> {
        let rows = rows_of("signs", signs.len(), packed_len(self.m, 1))?;
        norms.validate("norms", rows)?;
        Ok(rows)
    }

    fn k(&self) -> f32 {
        ((PI / 2.0).sqrt() / self.m as f64) as f32
    }

    /// Estimates `<y_i, r_j>` for every query row i and sketched row j: an (ny x nr) matrix,
    /// `sqrt(pi/2) / m * ||r_j|| * <S y_i, sign_j>`.
    pub fn inner_product(&self, y: &[f32], sk: &QjlSketch) -> Result<Vec<f32>> {
        self.inner_product_parts(y, &sk.signs, sk.norms.view())
    }

    /// [`QjlSketcher::inner_product`] from borrowed sign bits and norms.
    pub fn inner_product_parts(
        &self,
        y: &[f32],
        signs: &[u8],
        norms: ScalarView<'_>,
    ) -> Result<Vec<f32>> {
        let isa = self.isa();
        let (d, m) = (self.dim, self.m);
        let ny = rows_of("y", y.len(), d)?;
        check_finite("y", y, d)?;
        let nr = self.check_sketch(signs, norms)?;
        let rb = packed_len(m, 1);
        let k = self.k();
        let mut out = vec![0.0f32; ny * nr];
        if nr == 0 {
            return Ok(out);
        }
        let _ = par::rows1(
            ny,
            m * (d + nr),
            (y, d),
            (&mut out, nr),
            || vec![0.0f32; m],
            |sy, _, ys, os| {
                for (yrow, orow) in ys.chunks_exact(d).zip(os.chunks_exact_mut(nr)) {
                    ops::dots(isa, &self.s, yrow, sy);
                    for (j, o) in orow.iter_mut().enumerate() {
                        *o = k
                            * norms.get(j)
                            * ops::dot_signs(isa, sy, &signs[j * rb..(j + 1) * rb]);
                    }
                }
                Ok(())
            },
        );
        Ok(out)
    }

    /// Vector estimate `sqrt(pi/2) / m * ||r|| * S^T sign` of each sketched row (rows x dim).
    pub fn vector_estimate(&self, sk: &QjlSketch) -> Result<Vec<f32>> {
        self.vector_estimate_parts(&sk.signs, sk.norms.view())
    }

    /// [`QjlSketcher::vector_estimate`] from borrowed sign bits and norms.
    pub fn vector_estimate_parts(&self, signs: &[u8], norms: ScalarView<'_>) -> Result<Vec<f32>> {
        let isa = self.isa();
        let (d, m) = (self.dim, self.m);
        let rows = self.check_sketch(signs, norms)?;
        let rb = packed_len(m, 1);
        let k = self.k();
        let mut out = output_vec(rows * d);
        let _ = par::rows1(
            rows,
            m * d,
            (signs, rb),
            (&mut out, d),
            || (),
            |_, first, ss, os| {
                for (i, (sg, orow)) in ss.chunks_exact(rb).zip(os.chunks_exact_mut(d)).enumerate() {
                    // S^T sign as a signed sum of the rows of S, in increasing row order: contiguous
                    // reads of S instead of a strided column gather per output coordinate.
                    for (t, srow) in self.s.chunks_exact(d).enumerate() {
                        let negative = (sg[t / 8] >> (t % 8)) & 1 == 1;
                        ops::add_signed(isa, orow, srow, negative);
                    }
                    ops::scale(isa, orow, k * norms.get(first + i));
                }
                Ok(())
            },
        );
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
