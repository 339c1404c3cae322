//! Per-token symmetric codes in runs of basis columns with one scale per token (the
//! fixed-size `matched` keys): a key layout.
//!
//! A key is stored as its coordinates `z` in a basis `B` (d x d, not necessarily orthonormal:
//! `U diag(sigma)`), each run of columns `start .. stop` coded at `bits` bits per token,
//! `z_hat_i = level(bits, code_i) * s_t` with `level(b, c) = (2c - L) / L`, `L = 2^b - 1`;
//! columns in no run decode to 0 and `x_hat = z_hat B^T`.
//!
//! Keys: `q . x_hat = (q B) . z_hat`. The query rows are projected once per head (`q' = q B`,
//! [`Basis::queries`], as the per-channel runs do), then per token
//! `s_t * sum_runs q'_run . level(code_run)`: each run is read through a [`RowReader`] whose
//! table is the run's levels (as MSE rows read their centroids), so the packed decode and the
//! in-register dots of the SIMD paths serve it; the runs are summed in column order, then
//! multiplied by the token's scale.

use std::ops::Range;

use super::super::{check_bits, check_len};
use super::reader::{mul, per_token_scalars, symmetric_levels, RowReader, BLOCK};
use super::runs::{run_columns, Basis};
use super::{AttentionShape, KeyRows, Names, TokenRunView};
use crate::error::Result;
use crate::scalars::ScalarView;
use crate::simd::Isa;

/// One validated run: its reader (the run's levels as the table), codes and columns.
struct Run<'a> {
    reader: RowReader,
    codes: &'a [u8],
    cols: Range<usize>,
}

/// Validated token runs in a basis with their per-token scales.
pub(super) struct TokenRunsPlan<'a> {
    runs: Vec<Run<'a>>,
    scales: ScalarView<'a>,
    basis: Basis<'a>,
    /// Token room per head (rows of head `h` start at token `h * stride`).
    stride: usize,
}

impl<'a> TokenRunsPlan<'a> {
    /// Checks each run's columns, bits and codes (heads x stride rows of
    /// `packed_len(stop - start, bits)` bytes), the scales (heads x stride, the first `tokens`
    /// of each head finite and not negative) and the bases.
    pub(super) fn new(
        runs: &[TokenRunView<'a>],
        (scales, basis, basis_heads): (ScalarView<'a>, &'a [f32], usize),
        (names, run_names): (&Names, &Names),
        lay: &AttentionShape,
    ) -> Result<Self> {
        let d = lay.head_dim;
        let basis = Basis::new(names.basis, basis, basis_heads, lay)?;
        let vectors = mul(run_names.codes, lay.heads, lay.stride)?;
        let mut plans = Vec::with_capacity(runs.len());
        let mut next = 0;
        for run in runs {
            let cols = run_columns(run_names.codes, (run.start, run.stop), next, d)?;
            next = run.stop;
            check_bits(run_names.bits, run.bits)?;
            let reader = RowReader::new(cols.len(), run.bits, &symmetric_levels(run.bits));
            check_len(
                run_names.codes,
                run.codes.len(),
                mul(run_names.codes, vectors, reader.row_bytes)?,
                "heads x stride x packed codes of the run",
            )?;
            plans.push(Run {
                reader,
                codes: run.codes,
                cols,
            });
        }
        let scales = per_token_scalars(scales, (names.scales, names.scales), lay)?;
        Ok(Self {
            runs: plans,
            scales,
            basis,
            stride: lay.stride,
        })
    }
}

impl TokenRunsPlan<'_> {
    /// Head `h`'s keys `span` decoded to the head domain (span.len() x d into `out`):
    /// `z_hat B^T`, the runs' levels times each token's scale.
    pub(super) fn decode(&self, isa: Isa, h: usize, span: Range<usize>, out: &mut [f32]) {
        let (t, c0, n) = (self.stride, span.start, span.len());
        let d = out.len() / n;
        let mut sc = vec![0.0f32; n];
        self.scales.read(isa, h * t + c0, &mut sc);
        let mut z = vec![0.0f32; n * d];
        for run in &self.runs {
            let w = run.cols.len();
            run.reader
                .each_block(isa, run.codes, (h, t), span.clone(), |j0, block| {
                    for (r, levels) in block.chunks_exact(w).enumerate() {
                        let j = j0 - c0 + r;
                        let dst = &mut z[j * d + run.cols.start..j * d + run.cols.end];
                        dst.iter_mut()
                            .zip(levels)
                            .for_each(|(o, &l)| *o = l * sc[j]);
                    }
                });
        }
        out.fill(0.0);
        self.basis.map_rows(isa, h, &z, out);
    }
}

impl KeyRows for TokenRunsPlan<'_> {
    /// `q' = q B` per row, then each run's columns of every row (run after run: rows x width
    /// each).
    fn queries(&self, isa: Isa, q: &[f32], h: usize, _lay: &AttentionShape) -> Vec<f32> {
        self.basis
            .queries(isa, q, h, self.runs.iter().map(|r| &r.cols))
    }

    /// Per (row, token): the runs' dots `q'_run . level(code_run)` summed in column order in
    /// float32, times the token's scale.
    fn add_scores(&self, isa: Isa, qp: &[f32], h: usize, span: Range<usize>, s: &mut [f32]) {
        let (t, c0, n) = (self.stride, span.start, span.len());
        let rows = s.len() / n;
        let mut sum = vec![0.0f32; rows * n];
        let mut dots = vec![0.0f32; rows * BLOCK];
        let mut at = 0;
        for run in &self.runs {
            let (reader, w) = (&run.reader, run.cols.len());
            let q = &qp[at..at + rows * w];
            at += rows * w;
            let packed = reader.fuses(isa) && w.is_multiple_of(8);
            let ht = (h, t);
            reader.each_block_in(
                isa,
                run.codes,
                ht,
                span.clone(),
                packed,
                |j0, count, block| {
                    reader.dots_tokens(isa, q, (count, &block), &mut dots, BLOCK);
                    for (r, dr) in dots.chunks_exact(BLOCK).enumerate() {
                        let o = &mut sum[r * n + j0 - c0..r * n + j0 - c0 + count];
                        o.iter_mut().zip(&dr[..count]).for_each(|(a, &v)| *a += v);
                    }
                },
            );
        }
        let mut sc = vec![0.0f32; n];
        self.scales.read(isa, h * t + c0, &mut sc);
        for (sr, tr) in s.chunks_exact_mut(n).zip(sum.chunks_exact(n)) {
            for ((o, &v), &st) in sr.iter_mut().zip(tr).zip(&sc) {
                *o += st * v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{decode_attention, AttentionShape, CodedRows, TokenRunView, CHUNK};
    use crate::kernels::pack::pack;
    use crate::rng::gaussians;
    use crate::scalars::{FloatView, ScalarView};

    const RUNS: [(u32, usize, usize); 3] = [(3, 0, 5), (1, 5, 16), (8, 18, 21)];

    /// Pseudo-random codes of `bits` bits.
    fn codes(seed: u64, n: usize, bits: u32) -> Vec<u8> {
        (gaussians(seed, 1, n).iter())
            .map(|v| (v.to_bits() >> 7) as u8 & ((1u16 << bits) - 1) as u8)
            .collect()
    }

    /// Token runs of `heads x t` tokens of head_dim 24 and their float64 decode
    /// `z_hat B^T` (heads x t x d).
    struct Coded {
        packed: Vec<Vec<u8>>,
        scales: Vec<f32>,
        basis: Vec<f32>,
        decoded: Vec<f64>,
    }

    fn code(heads: usize, t: usize, d: usize) -> Coded {
        let scales: Vec<f32> = gaussians(1, 2, heads * t).iter().map(|v| v.abs()).collect();
        let basis = gaussians(2, 2, heads * d * d);
        let mut z = vec![0.0f64; heads * t * d];
        let mut packed = Vec::new();
        for (i, &(bits, lo, hi)) in RUNS.iter().enumerate() {
            let w = hi - lo;
            let c = codes(3 + i as u64, heads * t * w, bits);
            let top = (1i32 << bits) - 1;
            for (k, &code) in c.iter().enumerate() {
                let level = (2 * i32::from(code) - top) as f32 / top as f32;
                let j = k / w;
                z[j * d + lo + k % w] = f64::from(level) * f64::from(scales[j]);
            }
            packed.push(pack(&c, w, bits).unwrap());
        }
        let mut decoded = vec![0.0f64; heads * t * d];
        for (j, row) in decoded.chunks_exact_mut(d).enumerate() {
            let b = &basis[(j / t) * d * d..(j / t + 1) * d * d];
            for (i, x) in row.iter_mut().enumerate() {
                *x = (0..d).map(|c| f64::from(b[i * d + c]) * z[j * d + c]).sum();
            }
        }
        Coded {
            packed,
            scales,
            basis,
            decoded,
        }
    }

    impl Coded {
        fn rows<'a>(&'a self, heads: usize) -> CodedRows<'a> {
            CodedRows::TokenRuns {
                runs: (RUNS.iter().zip(&self.packed))
                    .map(|(&(bits, start, stop), codes)| TokenRunView {
                        codes,
                        bits,
                        start,
                        stop,
                    })
                    .collect(),
                scales: ScalarView::Float(FloatView::F32(&self.scales)),
                basis: &self.basis,
                basis_heads: heads,
            }
        }
    }

    #[test]
    fn token_run_keys_match_the_decoded_reference() {
        let (heads, rows, d) = (2, 3, 24);
        for t in [1, 45, CHUNK + 7] {
            let kc = code(heads, t, d);
            let keys = kc.rows(heads);
            let v = gaussians(5, 2, heads * t * d);
            let q = gaussians(6, 2, heads * rows * d);
            let lay = AttentionShape::new(heads, rows, t, d, 0.2);
            let got = decode_attention(&q, &lay, &keys, None, &CodedRows::Dense(&v), true).unwrap();
            for h in 0..heads {
                for r in 0..rows {
                    let qr = &q[(h * rows + r) * d..(h * rows + r + 1) * d];
                    let s: Vec<f64> = (0..t)
                        .map(|j| {
                            let k = &kc.decoded[(h * t + j) * d..(h * t + j + 1) * d];
                            0.2 * qr
                                .iter()
                                .zip(k)
                                .map(|(&a, &b)| f64::from(a) * b)
                                .sum::<f64>()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    let lse = m + z.ln();
                    let i = h * rows + r;
                    assert!((f64::from(got.lse[i]) - lse).abs() < 1e-4 * (1.0 + lse.abs()));
                    for (&sj, &g) in s.iter().zip(&got.probs[i * t..(i + 1) * t]) {
                        let p = (sj - lse).exp();
                        assert!((f64::from(g) - p).abs() < 1e-5);
                    }
                }
            }
        }
    }

    #[test]
    fn bad_token_runs_name_the_argument_and_are_refused_as_values() {
        let (heads, t, d) = (2, 9, 24);
        let kc = code(heads, t, d);
        let q = vec![0.5f32; heads * d];
        let v = vec![0.0f32; heads * t * d];
        let values = CodedRows::Dense(&v);
        let lay = AttentionShape::new(heads, 1, t, d, 0.5);
        let err = |k: &CodedRows| {
            decode_attention(&q, &lay, k, None, &values, false)
                .unwrap_err()
                .to_string()
        };
        let good = kc.rows(heads);
        let with = |f: &dyn Fn(&mut Vec<TokenRunView>)| {
            let CodedRows::TokenRuns { mut runs, .. } = good.clone() else {
                unreachable!()
            };
            f(&mut runs);
            CodedRows::TokenRuns {
                runs,
                scales: ScalarView::Float(FloatView::F32(&kc.scales)),
                basis: &kc.basis,
                basis_heads: heads,
            }
        };
        assert!(err(&with(&|r| r.swap(0, 1))).starts_with("keys.runs.codes"));
        assert!(err(&with(&|r| r[2].stop = d + 1)).starts_with("keys.runs.codes"));
        assert!(err(&with(&|r| r[1].codes = &r[1].codes[1..])).starts_with("keys.runs.codes"));
        assert!(err(&with(&|r| r[0].bits = 9)).starts_with("keys.runs.bits"));
        let bad_basis = CodedRows::TokenRuns {
            runs: vec![],
            scales: ScalarView::Float(FloatView::F32(&kc.scales)),
            basis: &kc.basis[1..],
            basis_heads: heads,
        };
        assert!(err(&bad_basis).starts_with("keys.basis"));
        let mut neg = kc.scales.clone();
        neg[3] = -1.0;
        let bad_scales = CodedRows::TokenRuns {
            runs: vec![],
            scales: ScalarView::Float(FloatView::F32(&neg)),
            basis: &kc.basis,
            basis_heads: heads,
        };
        assert!(err(&bad_scales).starts_with("keys.scales"));
        let short = CodedRows::TokenRuns {
            runs: vec![],
            scales: ScalarView::Float(FloatView::F32(&kc.scales[1..])),
            basis: &kc.basis,
            basis_heads: heads,
        };
        assert!(err(&short).starts_with("keys.scales"));
        // As values, alone or around a mean: refused before planning.
        for v in [
            good.clone(),
            CodedRows::Centred {
                rows: Box::new(good.clone()),
                mean: &q[..d],
                mean_heads: 1,
            },
        ] {
            let e = decode_attention(&q, &lay, &values, None, &v, false)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("values") && e.contains("TokenRunRows"), "{e}");
        }
    }
}
