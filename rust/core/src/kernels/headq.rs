//! HeadQ side code: a low-rank code of the key residual in a query basis U (d x r), added back
//! as a score-space correction with the live query (docs/kernels.md section 7).

use super::{check_bits, check_finite, rows_of};
use crate::alloc::output_vec;
use crate::error::{KvqError, Result};
use crate::par;
use crate::scalars::{ScalarPlane, ScalarView};
use crate::simd::{ops, Isa, IsaChoice};

/// The side coder for one basis and bit width.
#[derive(Debug, Clone)]
pub struct HeadqCoder {
    head_dim: usize,
    rank: usize,
    bits: u32,
    /// U^T, row-major rank x head_dim: each basis column contiguous for the dot products.
    basis_t: Vec<f32>,
    isa: IsaChoice,
}

/// Side codes (rows x rank, unpacked) and one stored scale per row.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadqCodes {
    /// rows x rank codes.
    pub codes: Vec<u8>,
    /// Per-row scale of the uniform side quantizer.
    pub scales: ScalarPlane,
}

impl HeadqCoder {
    /// Builds the coder from a row-major basis (head_dim x rank). Errors on a bad shape,
    /// non-finite entries or bits outside 1..=8.
    pub fn new(basis: &[f32], head_dim: usize, rank: usize, bits: u32) -> Result<Self> {
        check_bits("bits", bits)?;
        if rank == 0
            || head_dim == 0
            || head_dim.checked_mul(rank) != Some(basis.len())
            || rank > head_dim
        {
            return Err(KvqError::InvalidBasis {
                arg: "basis",
                reason: format!(
                    "expected a (head_dim, rank) basis with 1 <= rank <= head_dim, got {} values for head_dim {head_dim}, rank {rank}",
                    basis.len()
                ),
            });
        }
        if basis.iter().any(|v| !v.is_finite()) {
            return Err(KvqError::InvalidBasis {
                arg: "basis",
                reason: "expected finite entries".into(),
            });
        }
        let mut basis_t = vec![0.0f32; rank * head_dim];
        for i in 0..head_dim {
            for j in 0..rank {
                basis_t[j * head_dim + i] = basis[i * rank + j];
            }
        }
        Ok(Self {
            head_dim,
            rank,
            bits,
            basis_t,
            isa: IsaChoice::default(),
        })
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

    /// Rank r of the basis (codes per row).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// `h = (2^q - 1) / 2`: side values are `s * (code - h)`.
    pub fn half(&self) -> f32 {
        ((1u32 << self.bits) - 1) as f32 / 2.0
    }

    /// `out = U^T x` for one row.
    pub fn project_row(&self, x: &[f32], out: &mut [f32]) {
        ops::dots(self.isa(), &self.basis_t, x, out);
    }

    /// Encodes residual rows `e` (head_dim each) into side codes.
    pub fn encode(&self, e: &[f32]) -> Result<HeadqCodes> {
        let isa = self.isa();
        let (d, r) = (self.head_dim, self.rank);
        let rows = rows_of("residual", e.len(), d)?;
        if !ops::all_finite(isa, e) {
            check_finite("residual", e, d)?;
        }
        let h = self.half();
        let mut proj = vec![0.0f32; rows * r];
        let mut raw_scales = vec![0.0f32; rows];
        let done = par::rows2(
            rows,
            r * d,
            (e, d),
            (&mut proj, r),
            (&mut raw_scales, 1),
            || (),
            |_, first, es, ps, ss| {
                for (k, ((row, p), sc)) in es
                    .chunks_exact(d)
                    .zip(ps.chunks_exact_mut(r))
                    .zip(ss.iter_mut())
                    .enumerate()
                {
                    ops::dots(isa, &self.basis_t, row, p);
                    *sc = p.iter().fold(0.0f32, |m, v| m.max(v.abs())) / h;
                    if !sc.is_finite() {
                        return Err(first + k);
                    }
                }
                Ok(())
            },
        );
        if let Err(row) = done {
            return Err(KvqError::NormOverflow {
                arg: "residual",
                row,
            });
        }
        let scales = ScalarPlane::store(&raw_scales);
        let top = ((1u32 << self.bits) - 1) as f32;
        let mut codes = vec![0u8; rows * r];
        for (i, (p, c)) in proj
            .chunks_exact(r)
            .zip(codes.chunks_exact_mut(r))
            .enumerate()
        {
            let s = scales.get(i);
            for (ci, &pi) in c.iter_mut().zip(p) {
                let t = if s > 0.0 { pi / s } else { 0.0 };
                *ci = (t + h + 0.5).floor().clamp(0.0, top) as u8;
            }
        }
        Ok(HeadqCodes { codes, scales })
    }

    /// Validates codes and scales; returns the row count.
    fn check(&self, codes: &[u8], scales: ScalarView<'_>) -> Result<usize> {
        let rows = rows_of("codes", codes.len(), self.rank)?;
        scales.validate("scales", rows)?;
        super::check_codes("codes", codes, self.rank, self.bits)?;
        Ok(rows)
    }

    /// Side values `z = s * (code - h)` of one row.
    fn side_values(&self, codes: &[u8], s: f32, out: &mut [f32]) {
        let h = self.half();
        out.iter_mut()
            .zip(codes)
            .for_each(|(z, &c)| *z = s * (f32::from(c) - h));
    }

    /// Reconstructs `U z` (rows x head_dim); used by tests and by decode-based evaluation.
    pub fn decode(&self, c: &HeadqCodes) -> Result<Vec<f32>> {
        self.decode_parts(&c.codes, c.scales.view())
    }

    /// [`HeadqCoder::decode`] from borrowed codes and scales.
    pub fn decode_parts(&self, codes: &[u8], scales: ScalarView<'_>) -> Result<Vec<f32>> {
        let rows = self.check(codes, scales)?;
        let mut out = output_vec(rows * self.head_dim);
        let mut z = vec![0.0f32; self.rank];
        for (i, orow) in out.chunks_exact_mut(self.head_dim).enumerate() {
            self.side_values(
                &codes[i * self.rank..(i + 1) * self.rank],
                scales.get(i),
                &mut z,
            );
            for (j, &zj) in z.iter().enumerate() {
                let col = &self.basis_t[j * self.head_dim..(j + 1) * self.head_dim];
                orow.iter_mut().zip(col).for_each(|(o, u)| *o += u * zj);
            }
        }
        Ok(out)
    }

    /// Score corrections `(U^T q_i) . z_j` for every query row i and coded row j (nq x nk).
    /// The caller adds them to the base scores before dividing by sqrt(d).
    pub fn score_correction(&self, q: &[f32], c: &HeadqCodes) -> Result<Vec<f32>> {
        self.score_correction_parts(q, &c.codes, c.scales.view())
    }

    /// [`HeadqCoder::score_correction`] from borrowed codes and scales.
    pub fn score_correction_parts(
        &self,
        q: &[f32],
        codes: &[u8],
        scales: ScalarView<'_>,
    ) -> Result<Vec<f32>> {
        let isa = self.isa();
        let (d, r) = (self.head_dim, self.rank);
        let nq = rows_of("q", q.len(), d)?;
        check_finite("q", q, d)?;
        let nk = self.check(codes, scales)?;
        let h = self.half();
        let mut out = vec![0.0f32; nq * nk];
        if nk == 0 {
            return Ok(out);
        }
        let _ = par::rows1(
            nq,
            r * (d + nk),
            (q, d),
            (&mut out, nk),
            || vec![0.0f32; r],
            |qu, _, qs, os| {
                for (qrow, orow) in qs.chunks_exact(d).zip(os.chunks_exact_mut(nk)) {
                    ops::dots(isa, &self.basis_t, qrow, qu);
                    // z_j = s_j * (code - h) is formed per key inside the dot product.
                    for (j, o) in orow.iter_mut().enumerate() {
                        *o = ops::dot_side(isa, qu, &codes[j * r..(j + 1) * r], scales.get(j), h);
                    }
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
    use crate::rng::random_orthonormal_basis;

    #[test]
    fn correction_recovers_the_projected_residual_at_high_bits() {
        let (d, r) = (64, 4);
        let u = random_orthonormal_basis(1, d, r).unwrap();
        let coder = HeadqCoder::new(&u, d, r, 8).unwrap();
        let e: Vec<f32> = (0..d).map(|i| ((i * 7 % 13) as f32 - 6.0) / 10.0).collect();
        let q: Vec<f32> = (0..d).map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0).collect();
        let c = coder.encode(&e).unwrap();
        let got = coder.score_correction(&q, &c).unwrap()[0];
        let mut qu = vec![0.0; r];
        let mut eu = vec![0.0; r];
        coder.project_row(&q, &mut qu);
        coder.project_row(&e, &mut eu);
        let want: f32 = qu.iter().zip(&eu).map(|(a, b)| a * b).sum();
        assert!(
            (got - want).abs() < 0.01 * (1.0 + want.abs()),
            "{got} vs {want}"
        );
    }

    #[test]
    fn zero_residual_gives_zero_correction() {
        let u = random_orthonormal_basis(2, 16, 2).unwrap();
        let coder = HeadqCoder::new(&u, 16, 2, 2).unwrap();
        let c = coder.encode(&[0.0; 16]).unwrap();
        assert_eq!(c.codes, vec![2, 2]);
        assert_eq!(coder.score_correction(&[1.0; 16], &c).unwrap(), vec![0.0]);
    }
}
