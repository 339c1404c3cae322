//! Norm-and-direction rows (docs/kernels.md section 5), optionally with the QJL sketch of the
//! rotated residual: `kv`, the MSE stage of `kqv` / `qkqv`, and their QJL residual.
//!
//! Keys: `||k|| * (R q) . c` from the centroids `c` of the packed codes; the residual adds
//! `sqrt(pi/2)/m * ||r|| * (S R q) . sigma` straight from the packed sign bits (the estimator
//! of Zandieh et al. 2024). Values: `sum_j p_j ||v_j|| c_j` in the code domain; the residual is
//! summed in sketch space, `u = sum_j p_j ||r_j|| sigma_j`, and mapped back once with `S^T`.

use std::f64::consts::PI;
use std::ops::Range;
use std::sync::Arc;

use super::super::hadamard::Rotation;
use super::super::lloyd_max::codebook;
use super::super::qjl::QjlSketcher;
use super::super::{check_bits, check_len};
use super::reader::{
    code_domain, code_queries, mul, per_token_scalars, unrotate, Lanes, RowReader, BLOCK,
};
use super::{AttentionShape, KeyRows, Names, QjlRows, ValueRows};
use crate::error::{KvqError, Result};
use crate::scalars::ScalarView;
use crate::simd::{ops, Isa};

/// The QJL residual of an MSE plan.
struct Qjl<'a> {
    signs: &'a [u8],
    norms: ScalarView<'a>,
    sketcher: Arc<QjlSketcher>,
    reader: RowReader,
    k: f32,
}

/// Validated MSE rows with their codebook, rotation and sketch.
pub(super) struct MsePlan<'a> {
    codes: &'a [u8],
    norms: ScalarView<'a>,
    rot: Option<Arc<Rotation>>,
    reader: RowReader,
    qjl: Option<Qjl<'a>>,
    /// Token room per head (rows of head `h` start at token `h * stride`).
    stride: usize,
}

impl<'a> MsePlan<'a> {
    /// Checks the buffers of `codes` (heads x stride rows, the first `tokens` of each held)
    /// against the layout.
    pub(super) fn new(
        (codes, norms, bits, seed): (&'a [u8], ScalarView<'a>, u32, Option<u64>),
        qjl: Option<QjlRows<'a>>,
        names: &Names,
        lay: &AttentionShape,
    ) -> Result<Self> {
        let d = lay.head_dim;
        let vectors = mul(names.codes, lay.heads, lay.stride)?;
        let held = (lay.heads, lay.stride, lay.tokens);
        check_bits(names.bits, bits)?;
        let (rot, cd) = code_domain(seed, d)?;
        let reader = RowReader::new(cd, bits, &codebook(cd, bits)?.centroids_f32);
        check_len(
            names.codes,
            codes.len(),
            mul(names.codes, vectors, reader.row_bytes)?,
            "heads x stride x packed codes",
        )?;
        let norms = per_token_scalars(norms, (names.norms, names.norm_exps), lay)?;
        let qjl = match qjl {
            None => None,
            Some(q) => {
                if rot.is_none() {
                    return Err(KvqError::InvalidDimension {
                        arg: names.qjl_signs,
                        expected: "a QJL residual only after a rotated MSE stage (a seed)".into(),
                        actual: 0,
                    });
                }
                let qreader = RowReader::new(cd, 1, &[1.0, -1.0]);
                check_len(
                    names.qjl_signs,
                    q.signs.len(),
                    mul(names.qjl_signs, vectors, qreader.row_bytes)?,
                    "heads x stride x ceil(d'/8) sign bytes",
                )?;
                q.norms.validate_rows(names.qjl_norms, held, false)?;
                Some(Qjl {
                    signs: q.signs,
                    norms: q.norms,
                    sketcher: QjlSketcher::cached(cd, cd, q.seed)?,
                    reader: qreader,
                    k: ((PI / 2.0).sqrt() / cd as f64) as f32,
                })
            }
        };
        Ok(Self {
            codes,
            norms,
            rot,
            reader,
            qjl,
            stride: lay.stride,
        })
    }

    fn cd(&self) -> usize {
        self.reader.n
    }

    /// Head `h`'s rows `span` decoded to the head domain (span.len() x d into `out`):
    /// `R^T (||x|| c + sqrt(pi/2)/m ||r|| S^T sigma)`, the rows the scores and value sums read.
    pub(super) fn decode(&self, isa: Isa, h: usize, span: Range<usize>, out: &mut [f32]) {
        let (cd, t, c0, n) = (self.cd(), self.stride, span.start, span.len());
        let d = out.len() / n;
        let mut z = vec![0.0f32; n * cd];
        let mut nb = vec![0.0f32; n];
        self.norms.read(isa, h * t + c0, &mut nb);
        let ht = (h, t);
        self.reader
            .each_block(isa, self.codes, ht, span.clone(), |j0, block| {
                for (r, row) in block.chunks_exact(cd).enumerate() {
                    let (j, dst) = (
                        j0 - c0 + r,
                        &mut z[(j0 - c0 + r) * cd..(j0 - c0 + r + 1) * cd],
                    );
                    dst.iter_mut().zip(row).for_each(|(o, &c)| *o = nb[j] * c);
                }
            });
        if let Some(q) = &self.qjl {
            q.norms.read(isa, h * t + c0, &mut nb);
            let s = q.sketcher.matrix();
            let mut w = Vec::new();
            q.reader.each_block(isa, q.signs, ht, span, |j0, block| {
                // z_j += (k ||r_j|| sigma_j) S: the block's rows at once, S read once.
                let (a, rows) = (j0 - c0, block.len() / cd);
                w.clear();
                for (r, signs) in block.chunks_exact(cd).enumerate() {
                    w.extend(signs.iter().map(|&sign| q.k * nb[a + r] * sign));
                }
                let dst = &mut z[a * cd..(a + rows) * cd];
                ops::axpy_rows(isa, (dst, rows), &w, (1, cd), s, cd);
            });
        }
        for (zr, o) in z.chunks_exact_mut(cd).zip(out.chunks_exact_mut(d)) {
            match &self.rot {
                Some(r) => r.inverse_row_isa(isa, zr, o),
                None => o.copy_from_slice(&zr[..d]),
            }
        }
    }
}

impl KeyRows for MsePlan<'_> {
    /// `R q` (rows x d'), then `S R q` (rows x d') with a QJL residual.
    fn queries(&self, isa: Isa, q: &[f32], _h: usize, lay: &AttentionShape) -> Vec<f32> {
        let cd = self.cd();
        let mut qr = code_queries(isa, &self.rot, q, lay.head_dim, cd);
        if let Some(p) = &self.qjl {
            let rows = qr.len() / cd;
            let mut sq = vec![0.0f32; rows * cd];
            for (o, row) in sq.chunks_exact_mut(cd).zip(qr.chunks_exact(cd)) {
                ops::dots(isa, p.sketcher.matrix(), row, o);
            }
            qr.extend_from_slice(&sq);
        }
        qr
    }

    fn add_scores(&self, isa: Isa, qp: &[f32], h: usize, span: Range<usize>, s: &mut [f32]) {
        let (cd, t, c0, n) = (self.cd(), self.stride, span.start, span.len());
        let rows = s.len() / n;
        let (qr, sq) = qp.split_at(rows * cd);
        let mut dots = vec![0.0f32; rows * BLOCK];
        let mut nb = vec![0.0f32; n];
        // Per block of decoded rows: the dots of every (query row, token), then `||k_j|| * dot`.
        let mut add = |reader: &RowReader, codes: &[u8], nb: &[f32], k: f32, sq: &[f32]| {
            let packed = reader.fuses(isa) && cd.is_multiple_of(8);
            let ht = (h, t);
            reader.each_block_in(isa, codes, ht, span.clone(), packed, |j0, count, block| {
                reader.dots_tokens(isa, sq, (count, &block), &mut dots, BLOCK);
                for (r, dr) in dots.chunks_exact(BLOCK).enumerate() {
                    let sr = &mut s[r * n + j0 - c0..r * n + j0 - c0 + count];
                    let nr = &nb[j0 - c0..j0 - c0 + count];
                    for ((o, &v), &nj) in sr.iter_mut().zip(&dr[..count]).zip(nr) {
                        *o += k * nj * v;
                    }
                }
            });
        };
        self.norms.read(isa, h * t + c0, &mut nb);
        add(&self.reader, self.codes, &nb, 1.0, qr);
        if let Some(p) = &self.qjl {
            // sigma_j decoded to +-1 (products with +-1 are exact sign flips).
            p.norms.read(isa, h * t + c0, &mut nb);
            add(&p.reader, p.signs, &nb, p.k, sq);
        }
    }
}

impl ValueRows for MsePlan<'_> {
    /// The code-domain sums, then (with a QJL residual) the sketch-space sums.
    fn acc_dim(&self) -> usize {
        self.cd() * if self.qjl.is_some() { 2 } else { 1 }
    }

    fn accumulate(&self, isa: Isa, p: &[f32], h: usize, span: Range<usize>, acc: &mut [f64]) {
        let (cd, t, c0, n) = (self.cd(), self.stride, span.start, span.len());
        let (rows, stride) = (p.len() / n, self.acc_dim());
        let mut lanes = Lanes::new(rows, cd);
        let mut nb = [0.0f32; BLOCK];
        let mut add = |reader: &RowReader, codes: &[u8], norms: &ScalarView, offset: usize| {
            let packed = reader.fuses(isa);
            let ht = (h, t);
            reader.each_block_in(isa, codes, ht, span.clone(), packed, |j0, count, block| {
                norms.read(isa, h * t + j0, &mut nb[..count]);
                let rows = (reader, count, &block);
                lanes.add_rows(isa, rows, (p, n, j0 - c0, &nb), acc, (stride, offset));
            });
        };
        add(&self.reader, self.codes, &self.norms, 0);
        if let Some(q) = &self.qjl {
            add(&q.reader, q.signs, &q.norms, cd);
        }
    }

    /// `acc += sqrt(pi/2)/m * S^T u` (rows of S in increasing order), then un-rotated.
    fn finish(&self, isa: Isa, _h: usize, acc: &mut [f64], sums: &[f64], out: &mut [f32]) {
        let (cd, stride) = (self.cd(), self.acc_dim());
        if let Some(q) = &self.qjl {
            let k = f64::from(q.k);
            let mut w = vec![0.0f64; cd];
            for row in acc.chunks_exact_mut(stride) {
                let (ar, ur) = row.split_at_mut(cd);
                w.iter_mut().zip(ur.iter()).for_each(|(w, &u)| *w = k * u);
                ops::axpy_many_f64(isa, ar, &w, q.sketcher.matrix());
            }
        }
        unrotate(isa, &self.rot, (acc, stride, cd), sums, out);
    }
}
