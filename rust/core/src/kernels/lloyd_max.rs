//! Lloyd-Max scalar codebooks for one coordinate of a uniformly random unit vector in R^D,
//! whose density is `(1 - x^2)^((D-3)/2) / B(1/2, (D-1)/2)` on [-1, 1] (docs/kernels.md section 4). Computed once per (D, bits) and cached.

use std::sync::Arc;

use statrs::function::beta::{checked_beta_reg, ln_beta};

use super::{check_bits, check_head_dim};
use crate::error::{KvqError, Result};
use crate::memo::Memo;
use crate::simd::{self, ops, Isa};

/// Largest dimension whose codebook is computed (the incomplete beta stays accurate to it).
pub const MAX_CODEBOOK_DIM: usize = 16384;
/// Stop when the largest centroid update is below this fraction of the coordinate scale
/// `1/sqrt(D)` (the incomplete beta is accurate to about 1e-14, so tighter is not reachable).
const RELATIVE_TOLERANCE: f64 = 1e-11;
const MAX_ITERATIONS: usize = 20_000;
/// Stop after this many iterations without a new best residual (round-off floor reached).
const STALL_ITERATIONS: usize = 25;

/// An MSE-optimal scalar quantizer for the sphere marginal.
#[derive(Debug, Clone)]
pub struct Codebook {
    /// Dimension D of the unit vectors this codebook is for.
    pub dim: usize,
    /// Bits per coordinate.
    pub bits: u32,
    /// 2^bits centroids, ascending, in unit-vector coordinates (float64).
    pub centroids: Vec<f64>,
    /// 2^bits - 1 decision boundaries (midpoints), ascending (float64).
    pub boundaries: Vec<f64>,
    /// Per-coordinate mean squared error of this quantizer under the sphere marginal.
    pub distortion: f64,
    /// Centroids rounded to float32 (what decoding uses).
    pub centroids_f32: Vec<f32>,
    /// Boundaries rounded to float32 (what encoding compares against).
    pub boundaries_f32: Vec<f32>,
    /// `boundaries_f32` padded with `+inf` to `max(2^bits, 16)` entries: the table of the
    /// SIMD binary searches (a padded entry never counts, so codes stay below 2^bits).
    search: Vec<f32>,
    /// `centroids_f32` padded with zeros to 256 entries, so any byte indexes it.
    lookup: Vec<f32>,
}

impl Codebook {
    /// Code of one float32 coordinate: the number of boundaries <= x.
    #[inline]
    pub fn encode_value(&self, x: f32) -> u8 {
        self.boundaries_f32.partition_point(|&b| b <= x) as u8
    }

    /// Encodes every value of `x` into `codes` (same length).
    pub fn encode_into(&self, x: &[f32], codes: &mut [u8]) {
        self.encode_into_isa(simd::active(), x, codes);
    }

    /// [`Codebook::encode_into`] on a given instruction set (errors if this CPU lacks it).
    pub fn encode_into_with(&self, isa: Isa, x: &[f32], codes: &mut [u8]) -> Result<()> {
        self.encode_into_isa(isa.checked()?, x, codes);
        Ok(())
    }

    pub(crate) fn encode_into_isa(&self, isa: Isa, x: &[f32], codes: &mut [u8]) {
        if isa == Isa::Scalar {
            codes
                .iter_mut()
                .zip(x)
                .for_each(|(c, &v)| *c = self.encode_value(v));
        } else {
            ops::encode(isa, x, None, &self.search, self.bits, codes);
        }
    }

    /// Decodes every code into `out`; codes must be < 2^bits (checked by callers).
    pub fn decode_into(&self, codes: &[u8], out: &mut [f32]) {
        self.decode_into_isa(simd::active(), codes, out);
    }

    /// [`Codebook::decode_into`] on a given instruction set (errors if this CPU lacks it).
    pub fn decode_into_with(&self, isa: Isa, codes: &[u8], out: &mut [f32]) -> Result<()> {
        self.decode_into_isa(isa.checked()?, codes, out);
        Ok(())
    }

    pub(crate) fn decode_into_isa(&self, isa: Isa, codes: &[u8], out: &mut [f32]) {
        if isa == Isa::Scalar {
            out.iter_mut()
                .zip(codes)
                .for_each(|(o, &c)| *o = self.centroids_f32[c as usize]);
        } else {
            // `c * 1.0` is exactly `c`.
            ops::decode(isa, codes, &self.lookup, self.bits, 1.0, out);
        }
    }

    /// The padded boundary table of the SIMD encoders.
    pub(crate) fn search_table(&self) -> &[f32] {
        &self.search
    }

    /// The 256-entry centroid table of the SIMD decoders.
    pub(crate) fn lookup_table(&self) -> &[f32] {
        &self.lookup
    }
}

/// The cached codebook for unit vectors in R^dim at `bits` bits.
///
/// Errors: `InvalidBits` outside 1..=8; `InvalidDimension` for dim < 2 or dim > 16384.
pub fn codebook(dim: usize, bits: u32) -> Result<Arc<Codebook>> {
    check_bits("bits", bits)?;
    check_head_dim("head_dim", dim)?;
    if dim > MAX_CODEBOOK_DIM {
        return Err(KvqError::InvalidDimension {
            arg: "head_dim",
            expected: format!("a codebook dimension <= {MAX_CODEBOOK_DIM}"),
            actual: dim as i64,
        });
    }
    static CACHE: Memo<(usize, u32), Codebook> = Memo::new(usize::MAX);
    CACHE.get_or_try((dim, bits), || Ok(compute(dim, bits)))
}

/// The marginal of one coordinate of a uniform unit vector in R^dim.
struct SphereMarginal {
    a: f64,
    ln_norm: f64,
}

impl SphereMarginal {
    fn new(dim: usize) -> Self {
        let a = (dim as f64 - 1.0) / 2.0;
        Self {
            a,
            ln_norm: (2.0 * a).ln() + ln_beta(0.5, a),
        }
    }

    /// P(X > x) for x in [0, 1], via the regularized incomplete beta (tail-accurate).
    fn survival(&self, x: f64) -> f64 {
        if x >= 1.0 {
            return 0.0;
        }
        checked_beta_reg(self.a, self.a, (1.0 - x) / 2.0).unwrap_or(0.0)
    }

    /// `(1 - x^2)^a / (2 a B(1/2, a))`: the antiderivative of `-x f(x)`.
    fn moment_term(&self, x: f64) -> f64 {
        if x >= 1.0 {
            return 0.0;
        }
        (self.a * (1.0 - x * x).ln() - self.ln_norm).exp()
    }

    /// The density `f(x) = (1 - x^2)^(a - 1) / B(1/2, a)`.
    fn density(&self, x: f64) -> f64 {
        if x >= 1.0 {
            return 0.0;
        }
        ((self.a - 1.0) * (1.0 - x * x).ln() - ln_beta(0.5, self.a)).exp()
    }

    /// (probability, first moment) of the interval [l, u], 0 <= l < u <= 1.
    fn cell(&self, l: f64, u: f64) -> (f64, f64) {
        (
            self.survival(l) - self.survival(u),
            self.moment_term(l) - self.moment_term(u),
        )
    }

    /// The x >= 0 with P(X > x) = q, by bisection.
    fn inverse_survival(&self, q: f64) -> f64 {
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        for _ in 0..100 {
            let mid = 0.5 * (lo + hi);
            if self.survival(mid) > q {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    }
}

fn compute(dim: usize, bits: u32) -> Codebook {
    let marginal = SphereMarginal::new(dim);
    let half = 1usize << (bits - 1);
    let mut pos = companding_start(dim, half);
    let mut bounds = vec![0.0f64; half + 1];
    let tolerance = RELATIVE_TOLERANCE / (dim as f64).sqrt();
    let (mut best, mut stalled) = (f64::INFINITY, 0usize);
    for _ in 0..MAX_ITERATIONS {
        let (lloyd, residual) = lloyd_step(&marginal, &pos, &mut bounds);
        if residual < best {
            (best, stalled) = (residual, 0);
        } else {
            stalled += 1;
        }
        if residual < tolerance || stalled >= STALL_ITERATIONS {
            pos = lloyd;
            break;
        }
        // Newton on c = G(c) converges in a handful of steps where plain Lloyd needs ~10^5 at
        // 8 bits; keep it only when it lowers the fixed-point residual, else take the Lloyd step.
        pos = match newton_step(&marginal, &pos, &lloyd, &bounds) {
            Some(n) if lloyd_step(&marginal, &n, &mut bounds.clone()).1 < residual => n,
            _ => lloyd,
        };
    }
    set_boundaries(&pos, &mut bounds);
    let captured: f64 = (0..half)
        .map(|k| {
            let (p, m1) = marginal.cell(bounds[k], bounds[k + 1]);
            if p > 0.0 {
                m1 * m1 / p
            } else {
                0.0
            }
        })
        .sum();
    let distortion = (1.0 / dim as f64 - 2.0 * captured).max(0.0);
    mirror(dim, bits, &pos, distortion)
}

/// One Lloyd update `G(c)` (conditional means of the cells) and the residual `max |G(c) - c|`.
/// Leaves the boundaries of `pos` in `bounds`.
fn lloyd_step(marginal: &SphereMarginal, pos: &[f64], bounds: &mut [f64]) -> (Vec<f64>, f64) {
    set_boundaries(pos, bounds);
    let mut residual = 0.0f64;
    let next: Vec<f64> = (0..pos.len())
        .map(|k| {
            let (p, m1) = marginal.cell(bounds[k], bounds[k + 1]);
            let c = if p > 0.0 {
                m1 / p
            } else {
                0.5 * (bounds[k] + bounds[k + 1])
            };
            residual = residual.max((c - pos[k]).abs());
            c
        })
        .collect();
    (next, residual)
}

/// Newton step for `c - G(c) = 0`: the Jacobian of G is tridiagonal because centroid k only
/// sees boundaries k and k+1, each the midpoint of two neighbouring centroids.
fn newton_step(
    marginal: &SphereMarginal,
    pos: &[f64],
    g: &[f64],
    bounds: &[f64],
) -> Option<Vec<f64>> {
    let n = pos.len();
    let (mut lower, mut diag, mut upper, mut rhs) =
        (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    for k in 0..n {
        let (p, _) = marginal.cell(bounds[k], bounds[k + 1]);
        if p <= 0.0 {
            return None;
        }
        // dG_k/dt_k and dG_k/dt_{k+1}; t_0 = 0 and t_n = 1 are fixed.
        let a = if k > 0 {
            marginal.density(bounds[k]) * (g[k] - bounds[k]) / p
        } else {
            0.0
        };
        let b = if k + 1 < n {
            marginal.density(bounds[k + 1]) * (bounds[k + 1] - g[k]) / p
        } else {
            0.0
        };
        lower[k] = -a / 2.0;
        diag[k] = 1.0 - (a + b) / 2.0;
        upper[k] = -b / 2.0;
        rhs[k] = g[k] - pos[k];
    }
    let delta = solve_tridiagonal(&lower, &diag, &upper, &rhs)?;
    let next: Vec<f64> = pos.iter().zip(&delta).map(|(c, d)| c + d).collect();
    let ordered = next.windows(2).all(|w| w[0] < w[1]);
    (ordered && next[0] > 0.0 && next[n - 1] < 1.0).then_some(next)
}

/// Thomas algorithm; None if a pivot vanishes.
fn solve_tridiagonal(lower: &[f64], diag: &[f64], upper: &[f64], rhs: &[f64]) -> Option<Vec<f64>> {
    let n = diag.len();
    let (mut c, mut d) = (vec![0.0; n], vec![0.0; n]);
    for i in 0..n {
        let denom = diag[i] - if i > 0 { lower[i] * c[i - 1] } else { 0.0 };
        if denom.abs() < 1e-300 {
            return None;
        }
        c[i] = upper[i] / denom;
        d[i] = (rhs[i] - if i > 0 { lower[i] * d[i - 1] } else { 0.0 }) / denom;
    }
    for i in (0..n.saturating_sub(1)).rev() {
        d[i] -= c[i] * d[i + 1];
    }
    Some(d)
}

/// Positive-half boundaries: 0, midpoints of adjacent centroids, 1.
fn set_boundaries(pos: &[f64], bounds: &mut [f64]) {
    let half = pos.len();
    bounds[0] = 0.0;
    for k in 1..half {
        bounds[k] = 0.5 * (pos[k - 1] + pos[k]);
    }
    bounds[half] = 1.0;
}

/// Start from the quantiles of f^(1/3) (the high-resolution optimum), which is the same family
/// with `(D3 - 3) / 2 = (D - 3) / 6`, so convergence takes few iterations.
fn companding_start(dim: usize, half: usize) -> Vec<f64> {
    let a3 = (dim as f64 + 3.0) / 6.0;
    let compander = SphereMarginal {
        a: a3,
        ln_norm: 0.0,
    };
    let levels = 2 * half;
    (0..half)
        .map(|k| {
            // Positive centroid k sits at overall level half + k, CDF (half + k + 0.5) / levels.
            let q = 1.0 - (half + k) as f64 / levels as f64 - 0.5 / levels as f64;
            compander.inverse_survival(q)
        })
        .collect()
}

fn mirror(dim: usize, bits: u32, pos: &[f64], distortion: f64) -> Codebook {
    let mut centroids: Vec<f64> = pos.iter().rev().map(|c| -c).collect();
    centroids.extend_from_slice(pos);
    let boundaries: Vec<f64> = centroids.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
    let centroids_f32: Vec<f32> = centroids.iter().map(|&c| c as f32).collect();
    let boundaries_f32: Vec<f32> = boundaries.iter().map(|&b| b as f32).collect();
    let mut search = boundaries_f32.clone();
    search.resize(centroids.len().max(16), f32::INFINITY);
    let mut lookup = centroids_f32.clone();
    lookup.resize(256, 0.0);
    Codebook {
        dim,
        bits,
        centroids_f32,
        boundaries_f32,
        search,
        lookup,
        centroids,
        boundaries,
        distortion,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_gaussian_lloyd_max_sanity_values() {
        // docs/kernels.md section 4: D * MSE about 0.36, 0.117, 0.034, 0.0093 for b = 1..4 (large D).
        let want = [0.3634, 0.1175, 0.03454, 0.009497];
        for (b, w) in (1..=4).zip(want) {
            let cb = codebook(1024, b).unwrap();
            let got = cb.distortion * 1024.0;
            assert!((got / w - 1.0).abs() < 0.01, "b={b}: {got} vs {w}");
        }
    }

    #[test]
    fn one_bit_is_the_conditional_mean() {
        let cb = codebook(128, 1).unwrap();
        let m = SphereMarginal::new(128);
        let (p, m1) = m.cell(0.0, 1.0);
        assert!((cb.centroids[1] - m1 / p).abs() < 1e-15);
        assert_eq!(cb.boundaries, vec![0.0]);
    }

    #[test]
    fn distortion_falls_with_bits_and_codes_are_symmetric() {
        let mut last = f64::INFINITY;
        for b in 1..=8 {
            let cb = codebook(64, b).unwrap();
            assert!(cb.distortion < last);
            last = cb.distortion;
            let n = cb.centroids.len();
            for i in 0..n {
                assert!((cb.centroids[i] + cb.centroids[n - 1 - i]).abs() < 1e-15);
            }
            assert!(cb.centroids.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn rejects_bad_arguments() {
        assert!(codebook(1, 2).is_err());
        assert!(codebook(64, 0).is_err());
        assert!(codebook(64, 9).is_err());
        assert!(codebook(MAX_CODEBOOK_DIM + 1, 2).is_err());
    }
}
