//! Asymmetric uniform groups (docs/kernels.md section 9).
//!
//! Along each token's coordinates (KIVI values; `block` keys and values, rotated): a key scores
//! `sum_g z_g sum_(i in g) w_i + s_g (w_g . code_g)` against the code-domain query `w`; values
//! are summed as `s_g * code_g` per group with the zero points' share `sum_j p_j z_(j,g)` added
//! once per group. Along tokens per channel (KIVI keys): `sum_c q_c z_(c,g) + sum_c (q_c
//! s_(c,g)) code_(c,j)`, SIMD over the tokens of a group.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

use super::super::hadamard::Rotation;
use super::super::{check_bits, check_len, check_row_len};
use super::reader::{code_domain, code_queries, levels, mul, unrotate, RowReader};
use super::{AttentionShape, KeyRows, Names, ValueRows};
use crate::error::Result;
use crate::scalars::ScalarView;
use crate::simd::{ops, Isa};

/// The stored arrays of a uniform side: packed codes, scales, zero points.
pub(super) type Groups<'a> = (&'a [u8], ScalarView<'a>, ScalarView<'a>);

/// Validated groups along each token's (rotated) coordinates.
pub(super) struct TokensPlan<'a> {
    codes: &'a [u8],
    scales: ScalarView<'a>,
    zeros: ScalarView<'a>,
    rot: Option<Arc<Rotation>>,
    reader: RowReader,
    group: usize,
    groups: usize,
    /// Token room per head.
    stride: usize,
}

impl<'a> TokensPlan<'a> {
    pub(super) fn new(
        (codes, scales, zeros): Groups<'a>,
        (bits, group, seed): (u32, usize, Option<u64>),
        names: &Names,
        lay: &AttentionShape,
    ) -> Result<Self> {
        let d = lay.head_dim;
        let vectors = mul(names.codes, lay.heads, lay.stride)?;
        check_bits(names.bits, bits)?;
        check_row_len(names.group, group)?;
        let (rot, cd) = code_domain(seed, d)?;
        let reader = RowReader::new(cd, bits, &levels(bits));
        let groups = cd.div_ceil(group);
        check_len(
            names.codes,
            codes.len(),
            mul(names.codes, vectors, reader.row_bytes)?,
            "heads x stride x packed codes",
        )?;
        let per_head = mul(names.scales, lay.stride, groups)?;
        let held = (lay.heads, per_head, lay.tokens * groups);
        scales.validate_rows(names.scales, held, false)?;
        zeros.validate_rows(names.zeros, held, true)?;
        Ok(Self {
            codes,
            scales,
            zeros,
            rot,
            reader,
            group,
            groups,
            stride: lay.stride,
        })
    }

    /// The scales and zero points of tokens `span` of head `h` (span x groups each).
    fn planes(&self, isa: Isa, h: usize, span: Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let start = (h * self.stride + span.start) * self.groups;
        let mut sc = vec![0.0f32; span.len() * self.groups];
        let mut ze = vec![0.0f32; sc.len()];
        self.scales.read(isa, start, &mut sc);
        self.zeros.read(isa, start, &mut ze);
        (sc, ze)
    }
}

impl KeyRows for TokensPlan<'_> {
    /// `w = R q` (rows x d'), then `sum_(i in g) w_i` (rows x groups): the zero point's share.
    fn queries(&self, isa: Isa, q: &[f32], _h: usize, lay: &AttentionShape) -> Vec<f32> {
        let cd = self.reader.n;
        let mut qr = code_queries(isa, &self.rot, q, lay.head_dim, cd);
        let sums: Vec<f32> = qr
            .chunks_exact(cd)
            .flat_map(|row| row.chunks(self.group).map(|c| c.iter().sum::<f32>()))
            .collect();
        qr.extend_from_slice(&sums);
        qr
    }

    fn add_scores(&self, isa: Isa, qp: &[f32], h: usize, span: Range<usize>, s: &mut [f32]) {
        let (cd, groups, group) = (self.reader.n, self.groups, self.group);
        let (c0, n) = (span.start, span.len());
        let rows = s.len() / n;
        let (qr, sums) = qp.split_at(rows * cd);
        let (sc, ze) = self.planes(isa, h, span.clone());
        self.reader
            .each_row(isa, self.codes, (h, self.stride), span, |j, k| {
                let base = (j - c0) * groups;
                for (r, row) in qr.chunks_exact(cd).enumerate() {
                    let mut acc = 0.0f32;
                    for (g, (qg, kg)) in row.chunks(group).zip(k.chunks(group)).enumerate() {
                        acc += ze[base + g] * sums[r * groups + g]
                            + sc[base + g] * ops::dot(isa, qg, kg);
                    }
                    s[r * n + j - c0] += acc;
                }
            });
    }
}

impl ValueRows for TokensPlan<'_> {
    /// The code-domain sums of `s_g * code_g`, then the zero points' sums per group.
    fn acc_dim(&self) -> usize {
        self.reader.n + self.groups
    }

    fn accumulate(&self, isa: Isa, p: &[f32], h: usize, span: Range<usize>, acc: &mut [f64]) {
        let (cd, groups, group) = (self.reader.n, self.groups, self.group);
        let (c0, n, stride) = (span.start, span.len(), self.acc_dim());
        let rows = p.len() / n;
        let (sc, ze) = self.planes(isa, h, span.clone());
        let mut lanes = super::reader::Lanes::new(rows, cd);
        let packed = self.reader.fuses(isa) && (groups == 1 || group.is_multiple_of(16));
        let ht = (h, self.stride);
        self.reader
            .each_block_in(isa, self.codes, ht, span, packed, |j0, count, block| {
                let at = (j0 - c0) * groups..(j0 - c0 + count) * groups;
                let (scb, zeb) = (&sc[at.clone()], &ze[at]);
                // Weights p_j s_(j,g), one per query row, token and group.
                let w = &mut lanes.w;
                w.resize(rows * count * groups, 0.0);
                for (r, wr) in w.chunks_exact_mut(count * groups).enumerate() {
                    let pr = &p[r * n + j0 - c0..r * n + j0 - c0 + count];
                    if groups == 1 {
                        wr.iter_mut()
                            .zip(pr.iter().zip(scb))
                            .for_each(|(o, (&pj, &s))| *o = pj * s);
                    } else {
                        for ((wk, sk), &pj) in wr
                            .chunks_exact_mut(groups)
                            .zip(scb.chunks_exact(groups))
                            .zip(pr)
                        {
                            wk.iter_mut().zip(sk).for_each(|(o, &s)| *o = pj * s);
                        }
                    }
                }
                let pb = (p, n, j0 - c0);
                ops::zero_point_sums(isa, pb, (zeb, groups), count, (acc, stride, cd));
                let part = (&mut lanes.part[..], rows);
                self.reader
                    .axpy_rows(isa, part, &lanes.w, (groups, group), &block);
                lanes.carry(isa, acc, (stride, 0));
            });
    }

    /// Adds each group's zero-point sum to its coordinates, then un-rotates.
    fn finish(&self, isa: Isa, _h: usize, acc: &mut [f64], sums: &[f64], out: &mut [f32]) {
        let (cd, stride) = (self.reader.n, self.acc_dim());
        for row in acc.chunks_exact_mut(stride) {
            let (ar, zr) = row.split_at_mut(cd);
            for (i, a) in ar.iter_mut().enumerate() {
                *a += zr[i / self.group];
            }
        }
        unrotate(isa, &self.rot, (acc, stride, cd), sums, out);
    }
}

/// Validated KIVI keys: per-channel groups of tokens; row `c` of head `h` holds channel `c` of
/// every token.
pub(super) struct ChannelsPlan<'a> {
    codes: &'a [u8],
    scales: ScalarView<'a>,
    zeros: ScalarView<'a>,
    /// Rows of `stride` codes (the first `tokens` held).
    reader: RowReader,
    group: usize,
    /// Scale groups of a row's room (`ceil(stride / group)`).
    groups: usize,
    head_dim: usize,
}

impl<'a> ChannelsPlan<'a> {
    pub(super) fn new(
        (codes, scales, zeros): Groups<'a>,
        (bits, group): (u32, usize),
        names: &Names,
        lay: &AttentionShape,
    ) -> Result<Self> {
        let (h, d) = (lay.heads, lay.head_dim);
        check_bits(names.bits, bits)?;
        check_row_len(names.group, group)?;
        let reader = RowReader::new(lay.stride, bits, &levels(bits));
        let groups = lay.stride.div_ceil(group);
        let channels = mul(names.codes, h, d)?;
        check_len(
            names.codes,
            codes.len(),
            mul(names.codes, channels, reader.row_bytes)?,
            "heads x head_dim x packed stride tokens",
        )?;
        let held = (channels, groups, lay.tokens.div_ceil(group));
        scales.validate_rows(names.scales, held, false)?;
        zeros.validate_rows(names.zeros, held, true)?;
        Ok(Self {
            codes,
            scales,
            zeros,
            reader,
            group,
            groups,
            head_dim: d,
        })
    }
}

impl ChannelsPlan<'_> {
    /// The scales and zero points of the groups `g0..g1` of every channel of head `h`
    /// (channels x (g1 - g0) each, channel-major), read in one pass per channel.
    fn planes(&self, isa: Isa, h: usize, groups: (usize, usize)) -> (Vec<f32>, Vec<f32>) {
        let (mut sc, mut ze) = (Vec::new(), Vec::new());
        self.planes_into(isa, h, groups, (&mut sc, &mut ze));
        (sc, ze)
    }

    /// [`Self::planes`] into `sc` and `ze` (resized).
    fn planes_into(
        &self,
        isa: Isa,
        h: usize,
        (g0, g1): (usize, usize),
        (sc, ze): (&mut Vec<f32>, &mut Vec<f32>),
    ) {
        let (d, w) = (self.head_dim, g1 - g0);
        for v in [&mut *sc, &mut *ze] {
            v.clear();
            v.resize(d * w, 0.0);
        }
        for (c, (s, z)) in sc
            .chunks_exact_mut(w)
            .zip(ze.chunks_exact_mut(w))
            .enumerate()
        {
            let at = (h * d + c) * self.groups + g0;
            self.scales.read(isa, at, s);
            self.zeros.read(isa, at, z);
        }
    }

    /// Adds `sum_j p[r, j] y_hat_(c, j)` for the tokens `span` of head `h` to
    /// `acc[r * stride + offset + c]` for every channel `c`, `p` rows x span.len(): per group
    /// of tokens (cut by the span), `s_(c,g) * dot(p_g, code_(c,g)) + z_(c,g) * sum_g p` with
    /// the dot in the order of section 8 over the group's tokens and the rest in float64.
    pub(super) fn add_values(
        &self,
        isa: Isa,
        p: &[f32],
        h: usize,
        span: Range<usize>,
        acc: &mut [f64],
        (stride, offset): (usize, usize),
    ) {
        let (d, group, rb) = (self.head_dim, self.group, self.reader.row_bytes);
        let (c0, n) = (span.start, span.len());
        let rows = p.len() / n;
        let mut scratch = vec![0u8; group];
        let mut lev = vec![0.0f32; group];
        let mut psum = vec![0.0f64; rows];
        let (g0, g1) = (c0 / group, span.end.div_ceil(group));
        let (scs, zes) = self.planes(isa, h, (g0, g1));
        for g in g0..g1 {
            let (t0, t1) = ((g * group).max(c0), ((g + 1) * group).min(span.end));
            let len = t1 - t0;
            for (r, ps) in psum.iter_mut().enumerate() {
                let pr = &p[r * n + t0 - c0..r * n + t1 - c0];
                *ps = pr.iter().map(|&v| f64::from(v)).sum();
            }
            for c in 0..d {
                let ch = h * d + c;
                let row = &self.codes[ch * rb..(ch + 1) * rb];
                self.reader
                    .decode(isa, row, t0, &mut scratch, &mut lev[..len]);
                let at = c * (g1 - g0) + g - g0;
                let (sc, ze) = (f64::from(scs[at]), f64::from(zes[at]));
                for (r, &ps) in psum.iter().enumerate() {
                    let pr = &p[r * n + t0 - c0..r * n + t1 - c0];
                    let dot = f64::from(ops::dot(isa, pr, &lev[..len]));
                    acc[r * stride + offset + c] += sc * dot + ze * ps;
                }
            }
        }
    }
}

/// The buffers of [`ChannelsPlan`]'s scores (decoded codes and their bytes, channel weights,
/// a group's sums, scales, zero points and zero-point sums), reused between calls.
#[derive(Default)]
struct ScoreScratch {
    block: Vec<f32>,
    bytes: Vec<u8>,
    w: Vec<f32>,
    part: Vec<f32>,
    sc: Vec<f32>,
    ze: Vec<f32>,
    zs_all: Vec<f32>,
}

thread_local! {
    static SCORE_SCRATCH: RefCell<ScoreScratch> = RefCell::new(ScoreScratch::default());
}

impl ChannelsPlan<'_> {
    /// [`KeyRows::add_scores`] with the buffers of `scratch`.
    fn add_scores_in(
        &self,
        isa: Isa,
        q: &[f32],
        h: usize,
        span: Range<usize>,
        s: &mut [f32],
        scratch: &mut ScoreScratch,
    ) {
        let ScoreScratch {
            block,
            bytes,
            w,
            part,
            sc,
            ze,
            zs_all,
        } = scratch;
        let (d, group) = (self.head_dim, self.group);
        let (c0, n) = (span.start, span.len());
        // Per query row the channel weights q_c s_(c,g) of one group of tokens, and the
        // zero-point sum sum_c q_c z_(c,g); the group's codes are read packed in place where
        // the SIMD path decodes them in registers, else decoded into `block` (d x len).
        let rows = s.len() / n;
        w.clear(); // exactly rows x d: its length gives the call below the rows' tokens
        w.resize(rows * d, 0.0);
        part.resize(part.len().max(rows * group), 0.0);
        let (g0, g1) = (c0 / group, span.end.div_ceil(group));
        let gw = g1 - g0;
        self.planes_into(isa, h, (g0, g1), (&mut *sc, &mut *ze));
        // The zero points' share of every group at once, channels summed in order (a
        // contiguous row of groups per channel: the loop vectorises over groups).
        zs_all.clear();
        zs_all.resize(rows * gw, 0.0);
        for (z, qr) in zs_all.chunks_exact_mut(gw).zip(q.chunks_exact(d)) {
            for (&qc, zc) in qr.iter().zip(ze.chunks_exact(gw)) {
                z.iter_mut().zip(zc).for_each(|(a, &b)| *a += qc * b);
            }
        }
        for g in g0..g1 {
            let (t0, t1) = (g * group, ((g + 1) * group).min(span.end));
            let len = t1 - t0;
            for (wr, qr) in w.chunks_exact_mut(d).zip(q.chunks_exact(d)) {
                for (c, (wc, &qc)) in wr.iter_mut().zip(qr).enumerate() {
                    *wc = qc * sc[c * gw + g - g0];
                }
            }
            let o = &mut part[..rows * len];
            o.fill(0.0);
            // SIMD over the tokens of the group, every query row at once; channels summed
            // in order.
            let at = (self.codes, h * d, t0, len);
            self.reader
                .axpy_rows_from(isa, (&mut *o, rows), w, at, (&mut *block, &mut *bytes));
            for (r, or) in o.chunks_exact(len).enumerate() {
                let zs = zs_all[r * gw + g - g0];
                let dst = &mut s[r * n + t0 - c0..r * n + t1 - c0];
                dst.iter_mut().zip(or).for_each(|(s, &v)| *s += v + zs);
            }
        }
    }
}

impl KeyRows for ChannelsPlan<'_> {
    fn queries(&self, _isa: Isa, q: &[f32], _h: usize, _lay: &AttentionShape) -> Vec<f32> {
        q.to_vec()
    }

    fn add_scores(&self, isa: Isa, q: &[f32], h: usize, span: Range<usize>, s: &mut [f32]) {
        // A step calls this per run, head and chunk: its buffers are the thread's, kept.
        SCORE_SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => self.add_scores_in(isa, q, h, span, s, &mut scratch),
            Err(_) => self.add_scores_in(isa, q, h, span, s, &mut ScoreScratch::default()),
        });
    }

    /// A chunk of tokens holds whole groups.
    /// A chunk of tokens holds whole groups.
    fn token_step(&self) -> usize {
        self.group
    }
}
