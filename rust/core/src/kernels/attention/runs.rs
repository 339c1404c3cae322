//! Per-channel uniform runs in a calibrated orthonormal basis (the `matched` scheme), and a
//! per-head mean around any row layout.
//!
//! A vector is stored as its coordinates `y = (x - mu) U` (`U` d x d), each column coded along
//! tokens with KIVI's per-channel groups (docs/kernels.md section 9), columns of equal width
//! packed together as one run; columns in no run store nothing and decode to 0.
//!
//! Keys: `q . k_hat = (q U) . y_hat + q . mu`. The query rows are projected once per head
//! (`q' = q U`, one section 8 dot per column), then every run scores its columns exactly as
//! KIVI keys do ([`ChannelsPlan`]), the runs added in column order. `q . mu` is the same for
//! every token of a query row, so it is left out of the scores (the softmax does not see it);
//! it is added to the log-sum-exp only ([`KeyRows::lse_shift`]), which a caller merges with
//! another softmax part (the full-precision window of a cache).
//!
//! Values: `acc = sum_j p_j y_hat_j` in the coded basis (each run's columns, per group
//! `s * dot(p, code) + z * sum p`), then once per query row `out = (acc / sum p) U^T + mu`:
//! one d x d product after the weighted sum instead of one per token.

use std::ops::Range;

use super::super::{check_finite, check_len, check_row_len};
use super::reader::mul;
use super::uniform::ChannelsPlan;
use super::{AttentionShape, ChannelRun, KeyRows, Names, Plan, ValueRows};
use crate::error::{KvqError, Result};
use crate::simd::{ops, Isa};

/// Checks a per-head table (`count` tables of `per` values, `count` a divisor of the heads).
fn check_heads(
    arg: &'static str,
    data: &[f32],
    count: usize,
    per: usize,
    lay: &AttentionShape,
) -> Result<()> {
    if count == 0 || !lay.heads.is_multiple_of(count) {
        return Err(KvqError::InvalidDimension {
            arg,
            expected: format!(
                "1 table or one per KV head, a divisor of the {} flattened heads",
                lay.heads
            ),
            actual: count as i64,
        });
    }
    check_len(arg, data.len(), mul(arg, count, per)?, "heads x table")?;
    check_finite(arg, data, lay.head_dim)
}

/// A per-head basis (`heads` of d x d, row-major `U[i][c]`) and its transpose: the query map
/// `q -> q U` of the layouts coded in a basis ([`RunsPlan`], the token runs).
pub(super) struct Basis<'a> {
    /// The bases: the value map `y -> y U^T`, row i of `U` dotted with `y`.
    basis: &'a [f32],
    /// The transposed bases (`U^T`, row c = column c of `U`): the query map `q -> q U`.
    basis_t: Vec<f32>,
    heads: usize,
    head_dim: usize,
}

impl<'a> Basis<'a> {
    /// Checks `heads` bases of d x d (`arg` names them in errors: a count that does not divide
    /// the heads, a size, a non-finite entry).
    pub(super) fn new(
        arg: &'static str,
        basis: &'a [f32],
        heads: usize,
        lay: &AttentionShape,
    ) -> Result<Self> {
        let d = lay.head_dim;
        check_heads(arg, basis, heads, mul(arg, d, d)?, lay)?;
        let mut basis_t = vec![0.0f32; basis.len()];
        for (t, u) in basis_t
            .chunks_exact_mut(d * d)
            .zip(basis.chunks_exact(d * d))
        {
            for (i, row) in u.chunks_exact(d).enumerate() {
                for (c, &v) in row.iter().enumerate() {
                    t[c * d + i] = v;
                }
            }
        }
        Ok(Self {
            basis,
            basis_t,
            heads,
            head_dim: d,
        })
    }

    /// Basis `b` of head `h` (d x d), from `bases` (`basis` or `basis_t`).
    fn of<'s>(&self, bases: &'s [f32], h: usize) -> &'s [f32] {
        let dd = self.head_dim * self.head_dim;
        let b = h % self.heads;
        &bases[b * dd..(b + 1) * dd]
    }

    /// `out += z U^T` for the rows `z` (rows x d) of head `h`: coordinates in the basis mapped
    /// to the head domain, each row of `U^T` read once for the rows together.
    pub(super) fn map_rows(&self, isa: Isa, h: usize, z: &[f32], out: &mut [f32]) {
        let d = self.head_dim;
        let rows = z.len() / d;
        ops::axpy_rows(isa, (out, rows), z, (1, d), self.of(&self.basis_t, h), d);
    }

    /// `q' = q U` per query row of head `h` (one section 8 dot per column), then the columns
    /// `cols` of every row, run after run (rows x width each): what each run's scores read.
    pub(super) fn queries<'r>(
        &self,
        isa: Isa,
        q: &[f32],
        h: usize,
        cols: impl Iterator<Item = &'r Range<usize>>,
    ) -> Vec<f32> {
        let d = self.head_dim;
        let ut = self.of(&self.basis_t, h);
        let mut qu = vec![0.0f32; q.len()];
        for (o, row) in qu.chunks_exact_mut(d).zip(q.chunks_exact(d)) {
            ops::dots(isa, ut, row, o);
        }
        let mut out = Vec::with_capacity(q.len());
        for c in cols {
            for row in qu.chunks_exact(d) {
                out.extend_from_slice(&row[c.clone()]);
            }
        }
        out
    }
}

/// The columns `start .. stop` of a run after columns up to `next`: an error naming `arg`
/// unless they are in order, disjoint from the previous run's and within head_dim `d`.
pub(super) fn run_columns(
    arg: &'static str,
    (start, stop): (usize, usize),
    next: usize,
    d: usize,
) -> Result<Range<usize>> {
    if start < next || stop <= start || stop > d {
        return Err(KvqError::InvalidDimension {
            arg,
            expected: format!(
                "runs of columns start < stop <= {d} in increasing order, disjoint (the next from {next})"
            ),
            actual: start as i64,
        });
    }
    Ok(start..stop)
}

/// Validated runs of per-channel groups in a basis.
pub(super) struct RunsPlan<'a> {
    /// Each run's per-channel plan with its columns.
    runs: Vec<(ChannelsPlan<'a>, Range<usize>)>,
    basis: Basis<'a>,
    group: usize,
}

impl<'a> RunsPlan<'a> {
    pub(super) fn new(
        runs: &[ChannelRun<'a>],
        (group, basis, basis_heads): (usize, &'a [f32], usize),
        (names, run_names): (&Names, &Names),
        lay: &AttentionShape,
    ) -> Result<Self> {
        let d = lay.head_dim;
        check_row_len(names.group, group)?;
        let basis = Basis::new(names.basis, basis, basis_heads, lay)?;
        let mut plans = Vec::with_capacity(runs.len());
        let mut next = 0;
        for run in runs {
            let cols = run_columns(run_names.codes, (run.start, run.stop), next, d)?;
            next = run.stop;
            let width = AttentionShape {
                head_dim: cols.len(),
                ..*lay
            };
            let plan = ChannelsPlan::new(
                (run.codes, run.scales, run.zeros),
                (run.bits, group),
                run_names,
                &width,
            )?;
            plans.push((plan, cols));
        }
        Ok(Self {
            runs: plans,
            basis,
            group,
        })
    }
}

impl KeyRows for RunsPlan<'_> {
    /// `q' = q U` per row, then each run's columns of every row (run after run: rows x width
    /// each), the layout [`ChannelsPlan`] reads.
    fn queries(&self, isa: Isa, q: &[f32], h: usize, _lay: &AttentionShape) -> Vec<f32> {
        self.basis
            .queries(isa, q, h, self.runs.iter().map(|(_, c)| c))
    }

    /// The runs' scores added in column order.
    fn add_scores(&self, isa: Isa, qp: &[f32], h: usize, span: Range<usize>, s: &mut [f32]) {
        let rows = s.len() / span.len();
        let mut at = 0;
        for (plan, cols) in &self.runs {
            let len = rows * cols.len();
            plan.add_scores(isa, &qp[at..at + len], h, span.clone(), s);
            at += len;
        }
    }

    fn token_step(&self) -> usize {
        self.group
    }
}

impl ValueRows for RunsPlan<'_> {
    /// The coded coordinates (d; 0 in columns of no run).
    fn acc_dim(&self) -> usize {
        self.basis.head_dim
    }

    fn accumulate(&self, isa: Isa, p: &[f32], h: usize, span: Range<usize>, acc: &mut [f64]) {
        let d = self.basis.head_dim;
        for (plan, cols) in &self.runs {
            plan.add_values(isa, p, h, span.clone(), acc, (d, cols.start));
        }
    }

    /// `out = (acc / sum) U^T` per query row: rounded to float32, then one section 8 dot per
    /// output coordinate.
    fn finish(&self, isa: Isa, h: usize, acc: &mut [f64], sums: &[f64], out: &mut [f32]) {
        let d = self.basis.head_dim;
        let u = self.basis.of(self.basis.basis, h);
        let mut y = vec![0.0f32; d];
        for ((ar, &sum), o) in acc.chunks_exact(d).zip(sums).zip(out.chunks_exact_mut(d)) {
            for (yi, &a) in y.iter_mut().zip(ar) {
                *yi = (a / sum) as f32;
            }
            ops::dots(isa, u, &y, o);
        }
    }
}

/// Validated rows around a per-head mean.
pub(super) struct CentredPlan<'a> {
    inner: Box<Plan<'a>>,
    mean: &'a [f32],
    mean_heads: usize,
    head_dim: usize,
}

impl<'a> CentredPlan<'a> {
    pub(super) fn new(
        inner: Box<Plan<'a>>,
        (mean, mean_heads): (&'a [f32], usize),
        names: &Names,
        lay: &AttentionShape,
    ) -> Result<Self> {
        check_heads(names.mean, mean, mean_heads, lay.head_dim, lay)?;
        Ok(Self {
            inner,
            mean,
            mean_heads,
            head_dim: lay.head_dim,
        })
    }

    /// The rows around the mean.
    pub(super) fn inner(&self) -> &Plan<'a> {
        &self.inner
    }

    /// Head `h`'s mean (d values).
    fn mean_of(&self, h: usize) -> &[f32] {
        let (d, b) = (self.head_dim, h % self.mean_heads);
        &self.mean[b * d..(b + 1) * d]
    }

    /// The inner rows' decode plus the mean; false when the inner layout has no decoder.
    pub(super) fn decode(&self, isa: Isa, h: usize, span: Range<usize>, out: &mut [f32]) -> bool {
        if !self.inner.decode(isa, h, span, out) {
            return false;
        }
        let mu = self.mean_of(h);
        for o in out.chunks_exact_mut(self.head_dim) {
            o.iter_mut().zip(mu).for_each(|(a, &m)| *a += m);
        }
        true
    }
}

impl KeyRows for CentredPlan<'_> {
    fn queries(&self, isa: Isa, q: &[f32], h: usize, lay: &AttentionShape) -> Vec<f32> {
        self.inner.keys().queries(isa, q, h, lay)
    }

    fn add_scores(&self, isa: Isa, qp: &[f32], h: usize, span: Range<usize>, s: &mut [f32]) {
        self.inner.keys().add_scores(isa, qp, h, span, s);
    }

    fn token_step(&self) -> usize {
        self.inner.keys().token_step()
    }

    /// `q . mu` per row (section 8 dot), plus the inner layout's own term.
    fn lse_shift(&self, isa: Isa, q: &[f32], h: usize, lay: &AttentionShape) -> Option<Vec<f32>> {
        let mu = self.mean_of(h);
        let mut c: Vec<f32> = q
            .chunks_exact(lay.head_dim)
            .map(|r| ops::dot(isa, r, mu))
            .collect();
        if let Some(inner) = self.inner.keys().lse_shift(isa, q, h, lay) {
            c.iter_mut().zip(&inner).for_each(|(a, &b)| *a += b);
        }
        Some(c)
    }
}

impl ValueRows for CentredPlan<'_> {
    fn acc_dim(&self) -> usize {
        self.inner.values().map_or(0, |v| v.acc_dim())
    }

    fn accumulate(&self, isa: Isa, p: &[f32], h: usize, span: Range<usize>, acc: &mut [f64]) {
        if let Some(v) = self.inner.values() {
            v.accumulate(isa, p, h, span, acc);
        }
    }

    /// The inner rows' output plus the mean (the probabilities sum to one).
    fn finish(&self, isa: Isa, h: usize, acc: &mut [f64], sums: &[f64], out: &mut [f32]) {
        if let Some(v) = self.inner.values() {
            v.finish(isa, h, acc, sums, out);
        }
        let mu = self.mean_of(h);
        for o in out.chunks_exact_mut(self.head_dim) {
            o.iter_mut().zip(mu).for_each(|(a, &m)| *a += m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{decode_attention, decode_attention_with, AttentionShape, CodedRows, CHUNK};
    use super::*;
    use crate::kernels::mse::MseQuantizer;
    use crate::kernels::pack::pack;
    use crate::kernels::uniform::{UniformCodes, UniformQuantizer};
    use crate::rng::{gaussians, random_orthonormal_basis};

    /// One side coded as the `matched` scheme does: per head `y = (x - mu) U`, each run of
    /// columns coded per channel along tokens. Returns the packed runs' parts and the decoded
    /// `x_hat = y_hat U^T + mu` (heads x t x d, float64).
    struct Coded {
        parts: Vec<(Vec<u8>, UniformCodes, u32, usize, usize)>,
        basis: Vec<f32>,
        mean: Vec<f32>,
        decoded: Vec<f64>,
    }

    fn code(
        seed: u64,
        (heads, t, d): (usize, usize, usize),
        runs: &[(u32, usize, usize)],
        group: usize,
    ) -> Coded {
        let x = gaussians(seed, 9, heads * t * d);
        let mean: Vec<f32> = gaussians(seed + 1, 9, heads * d)
            .iter()
            .map(|v| 2.0 * v)
            .collect();
        let basis: Vec<f32> = (0..heads)
            .flat_map(|h| random_orthonormal_basis(seed + 2 + h as u64, d, d).unwrap())
            .collect();
        // y[h][c][j] (channels along tokens)
        let mut y = vec![0.0f32; heads * d * t];
        for h in 0..heads {
            for j in 0..t {
                for c in 0..d {
                    let mut acc = 0.0f32;
                    for i in 0..d {
                        acc +=
                            (x[(h * t + j) * d + i] - mean[h * d + i]) * basis[(h * d + i) * d + c];
                    }
                    y[(h * d + c) * t + j] = acc;
                }
            }
        }
        let mut y_hat = vec![0.0f64; heads * d * t];
        let mut parts = Vec::new();
        for &(bits, lo, hi) in runs {
            let w = hi - lo;
            let rows: Vec<f32> = (0..heads)
                .flat_map(|h| y[(h * d + lo) * t..(h * d + hi) * t].to_vec())
                .collect();
            let q = UniformQuantizer::new(t, group, bits).unwrap();
            let c = q.encode(&rows).unwrap();
            let dec = q.decode(&c).unwrap();
            for h in 0..heads {
                for k in 0..w * t {
                    y_hat[(h * d + lo) * t + k] = f64::from(dec[h * w * t + k]);
                }
            }
            parts.push((pack(&c.codes, t, bits).unwrap(), c, bits, lo, hi));
        }
        let mut decoded = vec![0.0f64; heads * t * d];
        for h in 0..heads {
            for j in 0..t {
                for i in 0..d {
                    let mut acc = f64::from(mean[h * d + i]);
                    for c in 0..d {
                        acc += f64::from(basis[(h * d + i) * d + c]) * y_hat[(h * d + c) * t + j];
                    }
                    decoded[(h * t + j) * d + i] = acc;
                }
            }
        }
        Coded {
            parts,
            basis,
            mean,
            decoded,
        }
    }

    impl Coded {
        /// The runs in this side's bases (one per head).
        fn rows<'a>(&'a self, runs: &'a [ChannelRun<'a>], group: usize) -> CodedRows<'a> {
            CodedRows::ChannelRuns {
                runs: runs.to_vec(),
                group,
                basis: &self.basis,
                basis_heads: self.mean.len() / (self.basis.len() / self.mean.len()),
            }
        }

        /// `inner` around this side's means (one per head).
        fn centred<'a>(&'a self, inner: &'a CodedRows<'a>) -> CodedRows<'a> {
            let d = self.basis.len() / self.mean.len();
            CodedRows::Centred {
                rows: Box::new(inner.clone()),
                mean: &self.mean,
                mean_heads: self.mean.len() / d,
            }
        }

        fn runs(&self) -> Vec<ChannelRun<'_>> {
            self.parts
                .iter()
                .map(|(packed, c, bits, lo, hi)| ChannelRun {
                    codes: packed,
                    scales: c.scales.view(),
                    zeros: c.zeros.view(),
                    bits: *bits,
                    start: *lo,
                    stop: *hi,
                })
                .collect()
        }
    }

    /// (out, lse, probs) of softmax attention over decoded rows in float64.
    fn reference(
        q: &[f32],
        k: &[f64],
        v: &[f64],
        lay: &AttentionShape,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (heads, rows, t, d) = (lay.heads, lay.rows, lay.tokens, lay.head_dim);
        let (mut out, mut lse, mut probs) = (vec![0.0; heads * rows * d], vec![], vec![]);
        for h in 0..heads {
            for r in 0..rows {
                let qr = &q[(h * rows + r) * d..(h * rows + r + 1) * d];
                let s: Vec<f64> = (0..t)
                    .map(|j| {
                        let kj = &k[(h * t + j) * d..(h * t + j + 1) * d];
                        f64::from(lay.scale)
                            * qr.iter()
                                .zip(kj)
                                .map(|(&a, &b)| f64::from(a) * b)
                                .sum::<f64>()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                lse.push(m + z.ln());
                for j in 0..t {
                    let p = (s[j] - m).exp() / z;
                    probs.push(p);
                    for c in 0..d {
                        out[(h * rows + r) * d + c] += p * v[(h * t + j) * d + c];
                    }
                }
            }
        }
        (out, lse, probs)
    }

    fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        let top = want.iter().fold(1.0f64, |a, &b| a.max(b.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (f64::from(*g) - w).abs() <= tol * top,
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    const RUNS: [(u32, usize, usize); 3] = [(5, 0, 3), (4, 3, 7), (2, 8, 11)];

    #[test]
    fn matched_keys_and_both_value_codings_match_the_decoded_reference() {
        // Two KV heads with their own bases and means, 3 query rows each (a GQA group), a
        // column of width 0 between runs and at the end, tokens not a multiple of the group
        // over several chunks.
        let (heads, rows, d, group) = (2, 3, 12, 7);
        for t in [1, 6, 37, CHUNK + 45] {
            let kc = code(10, (heads, t, d), &RUNS, group);
            let vc = code(20, (heads, t, d), &RUNS, group);
            let q = gaussians(30, 9, heads * rows * d);
            let lay = AttentionShape::new(heads, rows, t, d, 1.0 / (d as f32).sqrt());
            let (kruns, vruns) = (kc.runs(), vc.runs());
            let (kin, vin) = (kc.rows(&kruns, group), vc.rows(&vruns, group));
            let (keys, values) = (kc.centred(&kin), vc.centred(&vin));
            let got = decode_attention(&q, &lay, &keys, None, &values, true).unwrap();
            let (out, lse, probs) = reference(&q, &kc.decoded, &vc.decoded, &lay);
            close(&got.out, &out, 2e-5, "out");
            close(&got.lse, &lse, 2e-5, "lse");
            close(&got.probs, &probs, 2e-5, "probs");

            // The keys without their mean: the same probabilities, the log-sum-exp shifted by
            // scale * q . mu (what a merge with another softmax part would get wrong).
            let bare = decode_attention(&q, &lay, &kin, None, &values, true).unwrap();
            assert_eq!(bare.probs, got.probs);
            for (i, (&a, &b)) in bare.lse.iter().zip(&got.lse).enumerate() {
                let (h, qr) = (i / rows, &q[i * d..(i + 1) * d]);
                let qmu: f64 = qr
                    .iter()
                    .zip(&kc.mean[h * d..(h + 1) * d])
                    .map(|(&x, &m)| f64::from(x) * f64::from(m))
                    .sum();
                assert!(
                    (f64::from(b) - f64::from(a) - f64::from(lay.scale) * qmu).abs() < 1e-4,
                    "{a} {b} {qmu}"
                );
            }

            // MSE values around a mean (the matched value coder's default coding).
            let quant = MseQuantizer::new(d, 4, Some(3)).unwrap();
            let x = gaussians(40, 9, heads * t * d);
            let mc = quant.encode(&x).unwrap();
            let mp = pack(&mc.codes, quant.code_dim(), 4).unwrap();
            let mse = CodedRows::Mse {
                codes: &mp,
                norms: mc.norms.view(),
                bits: 4,
                seed: Some(3),
                qjl: None,
            };
            let mv = CodedRows::Centred {
                rows: Box::new(mse.clone()),
                mean: &vc.mean,
                mean_heads: heads,
            };
            let got = decode_attention(&q, &lay, &keys, None, &mv, false).unwrap();
            let dec = quant.decode(&mc).unwrap();
            let v: Vec<f64> = (0..heads * t * d)
                .map(|i| f64::from(dec[i]) + f64::from(vc.mean[(i / (t * d)) * d + i % d]))
                .collect();
            let (out, _, _) = reference(&q, &kc.decoded, &v, &lay);
            close(&got.out, &out, 2e-5, "mse out");
        }
    }

    #[test]
    fn one_shared_basis_and_mean_serve_every_head() {
        let (heads, rows, t, d, group) = (3, 2, 29, 12, 8);
        // Head 0's basis and mean given once (basis_heads = mean_heads = 1), or repeated for
        // every head: the same bits.
        let mut kc = code(51, (heads, t, d), &RUNS, group);
        let one_basis = kc.basis[..d * d].to_vec();
        let one_mean = kc.mean[..d].to_vec();
        let full: Vec<f32> = (0..heads).flat_map(|_| one_basis.clone()).collect();
        let means: Vec<f32> = (0..heads).flat_map(|_| one_mean.clone()).collect();
        kc.basis = full;
        kc.mean = means;
        let runs = kc.runs();
        let q = gaussians(52, 9, heads * rows * d);
        let v = gaussians(53, 9, heads * t * d);
        let lay = AttentionShape::new(heads, rows, t, d, 0.3);
        let per_head = CodedRows::ChannelRuns {
            runs: runs.clone(),
            group,
            basis: &kc.basis,
            basis_heads: heads,
        };
        let shared = CodedRows::ChannelRuns {
            runs: runs.clone(),
            group,
            basis: &one_basis,
            basis_heads: 1,
        };
        let (a, b) = (
            CodedRows::Centred {
                rows: Box::new(per_head.clone()),
                mean: &kc.mean,
                mean_heads: heads,
            },
            CodedRows::Centred {
                rows: Box::new(shared.clone()),
                mean: &one_mean,
                mean_heads: 1,
            },
        );
        let values = CodedRows::Dense(&v);
        let ra = decode_attention(&q, &lay, &a, None, &values, true).unwrap();
        let rb = decode_attention(&q, &lay, &b, None, &values, true).unwrap();
        assert_eq!(ra, rb);
    }

    #[test]
    fn bad_runs_bases_and_means_name_the_argument() {
        let (heads, t, d, group) = (2, 10, 12, 4);
        let kc = code(60, (heads, t, d), &RUNS, group);
        let runs = kc.runs();
        let q = vec![0.5f32; heads * d];
        let v = vec![0.0f32; heads * t * d];
        let lay = AttentionShape::new(heads, 1, t, d, 0.5);
        let values = CodedRows::Dense(&v);
        let err = |k: CodedRows| {
            decode_attention(&q, &lay, &k, None, &values, false)
                .unwrap_err()
                .to_string()
        };
        let rows = |runs, basis, basis_heads| CodedRows::ChannelRuns {
            runs,
            group,
            basis,
            basis_heads,
        };
        assert!(err(rows(runs.to_vec(), &kc.basis[1..], heads)).starts_with("keys.basis"));
        assert!(err(rows(runs.to_vec(), &kc.basis, 3)).starts_with("keys.basis"));
        let mut nan = kc.basis.clone();
        nan[5] = f32::NAN;
        assert!(err(rows(runs.to_vec(), &nan, heads)).starts_with("keys.basis"));
        let swapped = [runs[1], runs[0]];
        assert!(err(rows(swapped.to_vec(), &kc.basis, heads)).starts_with("keys.runs.codes"));
        let wide = [ChannelRun {
            stop: d + 1,
            ..runs[2]
        }];
        assert!(err(rows(wide.to_vec(), &kc.basis, heads)).starts_with("keys.runs.codes"));
        let short = [ChannelRun {
            codes: &runs[0].codes[1..],
            ..runs[0]
        }];
        assert!(err(rows(short.to_vec(), &kc.basis, heads)).starts_with("keys.runs.codes"));
        let zero = [ChannelRun { bits: 0, ..runs[0] }];
        assert!(err(rows(zero.to_vec(), &kc.basis, heads)).starts_with("keys.runs.bits"));
        let inner = rows(runs.to_vec(), &kc.basis, heads);
        let centred = CodedRows::Centred {
            rows: Box::new(inner.clone()),
            mean: &kc.mean[1..],
            mean_heads: heads,
        };
        assert!(err(centred).starts_with("keys.mean"));
        // As values: the same names on the value side.
        let vals = CodedRows::ChannelRuns {
            runs: swapped.to_vec(),
            group,
            basis: &kc.basis,
            basis_heads: heads,
        };
        let e = decode_attention(&q, &lay, &values, None, &vals, false)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("values.runs.codes"), "{e}");
        // A mean that overflows the log-sum-exp is an error, not an infinite lse.
        let huge = vec![3e38f32; heads * d];
        let big_q = vec![1e3f32; heads * d];
        let centred = CodedRows::Centred {
            rows: Box::new(inner.clone()),
            mean: &huge,
            mean_heads: heads,
        };
        let e = decode_attention(&big_q, &lay, &centred, None, &values, false)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("logits"), "{e}");
    }

    #[test]
    fn every_path_and_thread_count_gives_the_same_bits() {
        let (heads, rows, d, group, t) = (2, 3, 12, 7, 2 * CHUNK + 13);
        let kc = code(70, (heads, t, d), &RUNS, group);
        let vc = code(71, (heads, t, d), &RUNS, group);
        let q = gaussians(72, 9, heads * rows * d);
        let (kruns, vruns) = (kc.runs(), vc.runs());
        let (kin, vin) = (kc.rows(&kruns, group), vc.rows(&vruns, group));
        let (keys, values) = (kc.centred(&kin), vc.centred(&vin));
        let lay = AttentionShape::new(heads, rows, t, d, 0.25);
        let want =
            decode_attention_with(Isa::Scalar, &q, &lay, &keys, None, &values, true).unwrap();
        for isa in Isa::available() {
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let got = pool
                    .install(|| decode_attention_with(isa, &q, &lay, &keys, None, &values, true))
                    .unwrap();
                assert_eq!(got, want, "{isa:?} on {threads} threads");
            }
        }
    }
}
