//! Fused decode attention straight from a compressed KV cache, for one or a few query rows per
//! KV head (docs/kernels.md section 11). No key or value is reconstructed in the head
//! domain: each stored row is decoded, in registers of the active SIMD path, to its values in
//! the code domain (the rotated domain for rotation schemes) and used there at once:
//!
//! - the query rows of a GQA group are rotated once; a key row is unpacked (SIMD unpack), mapped
//!   through its 256-entry value table (a register permute for <= 4 bits: centroids for MSE,
//!   integer levels for uniform groups) and dotted with every query row in one pass
//!   (`ops::dots`, the fixed 8-lane order of `reduce.rs`); MSE keys: `||k|| * (R q) . c`;
//!   QJL residual (qkqv): `sqrt(pi/2)/m * ||r|| * (S R q) . sigma` straight from the packed
//!   sign bits (the estimator of Zandieh et al. 2024); uniform groups along a token (block):
//!   `sum_g z_g sum_(i in g) w_i + s_g (w_g . code_g)`; KIVI per-channel keys:
//!   `sum_c q_c z_(c,g) + sum_c (q_c s_(c,g)) code_(c,j)`, SIMD over the tokens of a group;
//!   HeadQ: `+ sign * s_j * sum_i (U^T q)_i (code_i - h)` (docs/kernels.md section 7);
//! - a numerically stable softmax (max subtracted, float64 normaliser, log-sum-exp returned so
//!   that callers can merge another softmax part exactly);
//! - the weighted sum of values: the value rows are decoded the same way, a block of 32 tokens
//!   at a time (shared by every query row of the group), and added with weights `p_j ||v_j||`
//!   to float32 SIMD lanes held in registers across the block, whose sums are then carried into
//!   float64 per query row; the QJL value residual is accumulated in sketch space and mapped
//!   back once with `S^T`, uniform values with their zero points summed per group; the result
//!   is un-rotated once.
//!
//! Every floating-point step is either elementwise or a fixed-order reduction, so the scalar
//! reference and every SIMD path give the same bits. Heads run in parallel (rayon); each head's
//! arithmetic is sequential in a fixed order, so results do not depend on the thread count.

use std::f64::consts::PI;
use std::sync::Arc;

use rayon::prelude::*;

use super::hadamard::Rotation;
use super::headq::HeadqCoder;
use super::lloyd_max::codebook;
use super::pack::{packed_len, unpack_range};
use super::qjl::QjlSketcher;
use super::{check_bits, check_finite, check_head_dim, check_len, check_row_len};
use crate::error::{KvqError, Result};
use crate::scalars::ScalarView;
use crate::simd::{self, ops, Isa};

/// The QJL sketch of the rotated residual that follows an MSE stage (`kqv` values, `qkqv`).
#[derive(Debug, Clone, Copy)]
pub struct QjlRows<'a> {
    /// heads x tokens x ceil(d'/8) packed sign bits (m = d').
    pub signs: &'a [u8],
    /// heads x tokens stored `||r||`.
    pub norms: ScalarView<'a>,
    /// Seed of the sketch matrix S.
    pub seed: u64,
}

/// Stored rows of one side of the cache (keys or values), `heads x tokens` vectors of head_dim.
#[derive(Debug, Clone, Copy)]
pub enum CodedRows<'a> {
    /// Norm-and-direction codes (docs/kernels.md section 5): `kv` (no rotation) and the MSE
    /// stage of `kqv` / `qkqv`, optionally followed by a QJL sketch of the rotated residual.
    Mse {
        /// heads x tokens x packed_len(code_dim, bits) bytes.
        codes: &'a [u8],
        /// heads x tokens stored norms.
        norms: ScalarView<'a>,
        /// Bits of the MSE stage.
        bits: u32,
        /// Rotation seed; None for no rotation (code_dim = head_dim).
        seed: Option<u64>,
        /// QJL residual sketch.
        qjl: Option<QjlRows<'a>>,
    },
    /// Asymmetric uniform groups along each token's coordinates (docs/kernels.md section 9):
    /// KIVI values (no rotation) and `block` (rotation, groups of rotated coordinates).
    UniformTokens {
        /// heads x tokens x packed_len(n, bits) bytes, n = code_dim.
        codes: &'a [u8],
        /// heads x tokens x ceil(n / group) scales.
        scales: ScalarView<'a>,
        /// heads x tokens x ceil(n / group) zero points.
        zeros: ScalarView<'a>,
        /// Bits per code.
        bits: u32,
        /// Coordinates per group.
        group: usize,
        /// Rotation seed, or None.
        seed: Option<u64>,
    },
    /// KIVI keys: per-channel groups of tokens; row `c` of head `h` holds channel `c` of every
    /// token.
    UniformChannels {
        /// heads x head_dim x packed_len(tokens, bits) bytes.
        codes: &'a [u8],
        /// heads x head_dim x ceil(tokens / group) scales.
        scales: ScalarView<'a>,
        /// heads x head_dim x ceil(tokens / group) zero points.
        zeros: ScalarView<'a>,
        /// Bits per code.
        bits: u32,
        /// Tokens per group.
        group: usize,
    },
    /// Full-precision rows, heads x tokens x head_dim.
    Dense(&'a [f32]),
}

/// HeadQ side code of the keys (docs/kernels.md section 7), added in score space.
#[derive(Debug, Clone, Copy)]
pub struct SideRows<'a> {
    /// heads x tokens x packed_len(rank, bits) bytes.
    pub codes: &'a [u8],
    /// heads x tokens stored scales.
    pub scales: ScalarView<'a>,
    /// basis_heads x head_dim x rank, row-major; head h uses basis `h % basis_heads`.
    pub basis: &'a [f32],
    /// Number of bases (1, or the KV heads of the leading shape's last axis).
    pub basis_heads: usize,
    /// Rank r.
    pub rank: usize,
    /// Side bits q.
    pub bits: u32,
    /// +1, or -1 for the wrong-sign control.
    pub sign: f32,
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// KV heads (every leading index flattened).
    pub heads: usize,
    /// Query rows per KV head (GQA group size x query tokens).
    pub rows: usize,
    /// Cached tokens per head.
    pub tokens: usize,
    /// head_dim d.
    pub head_dim: usize,
    /// Logit scale (1/sqrt(d) for plain attention).
    pub scale: f32,
}

/// Output of [`decode_attention`].
#[derive(Debug, Clone, PartialEq)]
pub struct Attention {
    /// heads x rows x head_dim outputs `sum_j p_j v_hat_j`.
    pub out: Vec<f32>,
    /// heads x rows `log sum_j exp(scale * s_j)` (for merging with another softmax part).
    pub lse: Vec<f32>,
    /// heads x rows x tokens probabilities when asked for, else empty.
    pub probs: Vec<f32>,
}

/// Reads packed rows of `bits`-bit codes as float32 values through a 256-entry table
/// (centroids, integer levels or `+-1` signs): the SIMD unpack, then the table decode of the
/// path (a register permute up to 4 bits).
#[derive(Debug, Clone)]
struct RowReader {
    n: usize,
    bits: u32,
    row_bytes: usize,
    table: Vec<f32>,
}

impl RowReader {
    /// Rows of `n` codes whose code `c` stands for `values[c]`.
    fn new(n: usize, bits: u32, values: &[f32]) -> Self {
        let mut table = values.to_vec();
        table.resize(256, 0.0);
        Self {
            n,
            bits,
            row_bytes: packed_len(n, bits),
            table,
        }
    }

    /// `out[i] = values[code(start + i)]` for the codes of a packed row from code `start`
    /// (`scratch` holds at least `out.len()` bytes).
    #[inline]
    fn decode(&self, isa: Isa, row: &[u8], start: usize, scratch: &mut [u8], out: &mut [f32]) {
        let bit = start * self.bits as usize;
        if bit.is_multiple_of(8) {
            ops::decode_packed(isa, &row[bit / 8..], self.bits, &self.table, out);
        } else {
            let codes = &mut scratch[..out.len()];
            unpack_range(row, self.bits, start, codes);
            ops::decode(isa, codes, &self.table, self.bits, 1.0, out);
        }
    }

    /// Calls `f(j0, values of rows j0 .. j0 + count)` (count x n) for the `t` rows of head `h`
    /// in `codes`, in blocks of [`BLOCK`] tokens from token 0. When rows hold no padding bits
    /// (`n * bits % 8 == 0`) a block is one bit stream, decoded in one call.
    fn each_block(
        &self,
        isa: Isa,
        codes: &[u8],
        h: usize,
        t: usize,
        mut f: impl FnMut(usize, &[f32]),
    ) {
        let (rb, n) = (self.row_bytes, self.n);
        let stream = (n * self.bits as usize).is_multiple_of(8);
        let mut scratch = vec![0u8; n];
        let mut dec = vec![0.0f32; BLOCK * n];
        for (b, rows) in codes[h * t * rb..(h + 1) * t * rb]
            .chunks(BLOCK * rb)
            .enumerate()
        {
            let out = &mut dec[..rows.len() / rb * n];
            if stream {
                ops::decode_packed(isa, rows, self.bits, &self.table, out);
            } else {
                for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(n)) {
                    self.decode(isa, row, 0, &mut scratch, o);
                }
            }
            f(b * BLOCK, out);
        }
    }

    /// Calls `f(j, values of row j)` for the `t` rows of head `h` in `codes`, in token order.
    fn each_row(
        &self,
        isa: Isa,
        codes: &[u8],
        h: usize,
        t: usize,
        mut f: impl FnMut(usize, &[f32]),
    ) {
        let n = self.n;
        self.each_block(isa, codes, h, t, |j0, block| {
            for (k, row) in block.chunks_exact(n).enumerate() {
                f(j0 + k, row);
            }
        });
    }
}

/// Tokens summed in float32 lanes before their sum is carried into float64. A float32 sum of
/// `BLOCK` terms `w_j x_j` errs by at most about `BLOCK * 2^-24` of `sum_j |w_j x_j|`, and the
/// weights of a softmax sum to one, so the value error stays below `2e-6 max |v_hat|`.
const BLOCK: usize = 32;

/// Per-query-row sums `sum_j w_(r,j) x_j` of rows `x_j` in the code domain: each block of
/// [`BLOCK`] tokens summed in SIMD float32 lanes held in registers (`ops::axpy_rows_f32`, tokens
/// in increasing order), then carried into float64. Every step is elementwise and the blocks
/// are fixed by the token index, so every path and thread count agrees.
struct Accumulator {
    part: Vec<f32>,
    total: Vec<f64>,
    w: Vec<f32>,
    n: usize,
}

impl Accumulator {
    /// Sums for `rows` query rows of `n` values each.
    fn new(rows: usize, n: usize) -> Self {
        Self {
            part: vec![0.0; rows * n],
            total: vec![0.0; rows * n],
            w: Vec::with_capacity(BLOCK),
            n,
        }
    }

    /// Adds one block of rows (count x n, tokens `j0 ..`) with weight `weight(r, k)` for query
    /// row `r` and the block's row `k`.
    fn add_block(&mut self, isa: Isa, block: &[f32], weight: impl Fn(usize, usize) -> f32) {
        let count = block.len() / self.n;
        for (r, pr) in self.part.chunks_exact_mut(self.n).enumerate() {
            self.w.clear();
            self.w.extend((0..count).map(|k| weight(r, k)));
            ops::axpy_rows_f32(isa, pr, &self.w, block, self.n);
        }
        self.carry();
    }

    fn carry(&mut self) {
        for (t, p) in self.total.iter_mut().zip(self.part.iter_mut()) {
            *t += f64::from(*p);
            *p = 0.0;
        }
    }

    /// The float64 sums, rows x n.
    fn finish(self) -> Vec<f64> {
        self.total
    }
}

/// The QJL part of a plan.
struct QjlPlan<'a> {
    signs: &'a [u8],
    norms: ScalarView<'a>,
    sketcher: Arc<QjlSketcher>,
    reader: RowReader,
    k: f32,
}

/// A validated side of the cache with its codebook, rotation and sketch built once per call.
enum Plan<'a> {
    Mse {
        codes: &'a [u8],
        norms: ScalarView<'a>,
        rot: Option<Rotation>,
        reader: RowReader,
        qjl: Option<QjlPlan<'a>>,
    },
    Tokens {
        codes: &'a [u8],
        scales: ScalarView<'a>,
        zeros: ScalarView<'a>,
        rot: Option<Rotation>,
        reader: RowReader,
        group: usize,
        groups: usize,
    },
    Channels {
        codes: &'a [u8],
        scales: ScalarView<'a>,
        zeros: ScalarView<'a>,
        reader: RowReader,
        group: usize,
        groups: usize,
    },
    Dense(&'a [f32]),
}
/// Argument names per side, so that errors name `keys.codes` or `values.codes`.
struct Names {
    codes: &'static str,
    norms: &'static str,
    scales: &'static str,
    zeros: &'static str,
    bits: &'static str,
    group: &'static str,
    qjl_signs: &'static str,
    qjl_norms: &'static str,
    dense: &'static str,
}

const KEY_NAMES: Names = Names {
    codes: "keys.codes",
    norms: "keys.norms",
    scales: "keys.scales",
    zeros: "keys.zeros",
    bits: "keys.bits",
    group: "keys.group",
    qjl_signs: "keys.qjl_signs",
    qjl_norms: "keys.qjl_norms",
    dense: "keys.values",
};

const VALUE_NAMES: Names = Names {
    codes: "values.codes",
    norms: "values.norms",
    scales: "values.scales",
    zeros: "values.zeros",
    bits: "values.bits",
    group: "values.group",
    qjl_signs: "values.qjl_signs",
    qjl_norms: "values.qjl_norms",
    dense: "values.values",
};

/// `[0, 1, ..., 2^bits - 1]`: the integer levels of a uniform code.
fn levels(bits: u32) -> Vec<f32> {
    (0..1u32 << bits).map(|v| v as f32).collect()
}

fn mul(arg: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or(KvqError::InvalidDimension {
        arg,
        expected: "sizes whose product fits in memory".into(),
        actual: i64::MAX,
    })
}

impl<'a> Plan<'a> {
    fn new(rows: &CodedRows<'a>, names: &Names, layout: &Layout) -> Result<Self> {
        let (h, t, d) = (layout.heads, layout.tokens, layout.head_dim);
        let vectors = mul(names.codes, h, t)?;
        match *rows {
            CodedRows::Mse {
                codes,
                norms,
                bits,
                seed,
                qjl,
            } => {
                check_bits(names.bits, bits)?;
                let rot = seed.map(|s| Rotation::new(d, Some(s))).transpose()?;
                let cd = rot.as_ref().map_or(d, Rotation::padded_dim);
                let reader = RowReader::new(cd, bits, &codebook(cd, bits)?.centroids_f32);
                check_len(
                    names.codes,
                    codes.len(),
                    mul(names.codes, vectors, reader.row_bytes)?,
                    "heads x tokens x packed codes",
                )?;
                norms.validate(names.norms, vectors)?;
                let qjl = match qjl {
                    None => None,
                    Some(q) => {
                        if rot.is_none() {
                            return Err(KvqError::InvalidDimension {
                                arg: names.qjl_signs,
                                expected: "a QJL residual only after a rotated MSE stage (a seed)"
                                    .into(),
                                actual: 0,
                            });
                        }
                        let qreader = RowReader::new(cd, 1, &[1.0, -1.0]);
                        check_len(
                            names.qjl_signs,
                            q.signs.len(),
                            mul(names.qjl_signs, vectors, qreader.row_bytes)?,
                            "heads x tokens x ceil(d'/8) sign bytes",
                        )?;
                        q.norms.validate(names.qjl_norms, vectors)?;
                        Some(QjlPlan {
                            signs: q.signs,
                            norms: q.norms,
                            sketcher: QjlSketcher::cached(cd, cd, q.seed)?,
                            reader: qreader,
                            k: ((PI / 2.0).sqrt() / cd as f64) as f32,
                        })
                    }
                };
                Ok(Plan::Mse {
                    codes,
                    norms,
                    rot,
                    reader,
                    qjl,
                })
            }
            CodedRows::UniformTokens {
                codes,
                scales,
                zeros,
                bits,
                group,
                seed,
            } => {
                check_bits(names.bits, bits)?;
                check_row_len(names.group, group)?;
                let rot = seed.map(|s| Rotation::new(d, Some(s))).transpose()?;
                let cd = rot.as_ref().map_or(d, Rotation::padded_dim);
                let reader = RowReader::new(cd, bits, &levels(bits));
                let groups = cd.div_ceil(group);
                check_len(
                    names.codes,
                    codes.len(),
                    mul(names.codes, vectors, reader.row_bytes)?,
                    "heads x tokens x packed codes",
                )?;
                scales.validate(names.scales, mul(names.scales, vectors, groups)?)?;
                zeros.validate_signed(names.zeros, vectors * groups)?;
                Ok(Plan::Tokens {
                    codes,
                    scales,
                    zeros,
                    rot,
                    reader,
                    group,
                    groups,
                })
            }
            CodedRows::UniformChannels {
                codes,
                scales,
                zeros,
                bits,
                group,
            } => {
                check_bits(names.bits, bits)?;
                check_row_len(names.group, group)?;
                let reader = RowReader::new(t, bits, &levels(bits));
                let groups = t.div_ceil(group);
                let channels = mul(names.codes, h, d)?;
                check_len(
                    names.codes,
                    codes.len(),
                    mul(names.codes, channels, reader.row_bytes)?,
                    "heads x head_dim x packed tokens",
                )?;
                scales.validate(names.scales, mul(names.scales, channels, groups)?)?;
                zeros.validate_signed(names.zeros, channels * groups)?;
                Ok(Plan::Channels {
                    codes,
                    scales,
                    zeros,
                    reader,
                    group,
                    groups,
                })
            }
            CodedRows::Dense(x) => {
                check_len(
                    names.dense,
                    x.len(),
                    mul(names.dense, vectors, d)?,
                    "heads x tokens x head_dim values",
                )?;
                check_finite(names.dense, x, d)?;
                Ok(Plan::Dense(x))
            }
        }
    }
}

/// The validated HeadQ side code.
struct SidePlan<'a> {
    codes: &'a [u8],
    scales: ScalarView<'a>,
    coders: Vec<HeadqCoder>,
    reader: RowReader,
    sign: f32,
}

impl<'a> SidePlan<'a> {
    fn new(s: &SideRows<'a>, layout: &Layout, isa: Isa) -> Result<Self> {
        check_bits("side.bits", s.bits)?;
        check_row_len("side.rank", s.rank)?;
        if s.sign != 1.0 && s.sign != -1.0 {
            return Err(KvqError::InvalidDimension {
                arg: "side.sign",
                expected: "+1 or -1".into(),
                actual: s.sign as i64,
            });
        }
        if s.basis_heads == 0 || !layout.heads.is_multiple_of(s.basis_heads) {
            return Err(KvqError::InvalidDimension {
                arg: "side.basis",
                expected: format!(
                    "1 basis or one per KV head, a divisor of the {} flattened heads",
                    layout.heads
                ),
                actual: s.basis_heads as i64,
            });
        }
        let per = mul("side.basis", layout.head_dim, s.rank)?;
        check_len(
            "side.basis",
            s.basis.len(),
            mul("side.basis", s.basis_heads, per)?,
            "basis_heads x head_dim x rank",
        )?;
        let coders = s
            .basis
            .chunks_exact(per.max(1))
            .map(|u| HeadqCoder::new(u, layout.head_dim, s.rank, s.bits)?.with_isa(isa))
            .collect::<Result<Vec<_>>>()?;
        // Side code c stands for c - h (docs/kernels.md section 7).
        let half = coders[0].half();
        let levels: Vec<f32> = (0..1u32 << s.bits).map(|v| v as f32 - half).collect();
        let reader = RowReader::new(s.rank, s.bits, &levels);
        let vectors = layout.heads * layout.tokens;
        check_len(
            "side.codes",
            s.codes.len(),
            mul("side.codes", vectors, reader.row_bytes)?,
            "heads x tokens x packed side codes",
        )?;
        s.scales.validate("side.scales", vectors)?;
        Ok(Self {
            codes: s.codes,
            scales: s.scales,
            coders,
            reader,
            sign: s.sign,
        })
    }
}

/// Rotates one query row into `out` (d' values), or copies it when there is no rotation.
fn rotate(isa: Isa, rot: &Option<Rotation>, q: &[f32], out: &mut [f32]) {
    match rot {
        Some(r) => r.forward_row_isa(isa, q, out),
        None => out.copy_from_slice(q),
    }
}

/// The query rows of one head in the code domain (rotated, or copied): rows x `cd`.
fn code_queries(isa: Isa, rot: &Option<Rotation>, q: &[f32], d: usize, cd: usize) -> Vec<f32> {
    let mut qr = vec![0.0f32; q.len() / d * cd];
    for (o, row) in qr.chunks_exact_mut(cd).zip(q.chunks_exact(d)) {
        rotate(isa, rot, row, o);
    }
    qr
}

/// Adds the QJL residual estimate `k ||r_j|| (S R q) . sigma_j` to the scores of head `h`.
fn qjl_scores(isa: Isa, p: &QjlPlan, qr: &[f32], h: usize, t: usize, s: &mut [f32]) {
    let cd = p.reader.n;
    let mut sq = vec![0.0f32; qr.len()];
    for (o, row) in sq.chunks_exact_mut(cd).zip(qr.chunks_exact(cd)) {
        ops::dots(isa, p.sketcher.matrix(), row, o);
    }
    // sigma_j decoded to +-1 (products with +-1 are exact sign flips).
    let mut dots = vec![0.0f32; qr.len() / cd];
    p.reader.each_row(isa, p.signs, h, t, |j, sigma| {
        ops::dots(isa, &sq, sigma, &mut dots);
        let kr = p.k * p.norms.get(h * t + j);
        for (r, &v) in dots.iter().enumerate() {
            s[r * t + j] += kr * v;
        }
    });
}

/// Adds the HeadQ side correction `sign * s_j * (U^T q) . (code_j - h)` to the scores.
fn side_scores(isa: Isa, sp: &SidePlan, q: &[f32], h: usize, lay: &Layout, s: &mut [f32]) {
    let (t, d) = (lay.tokens, lay.head_dim);
    let coder = &sp.coders[h % sp.coders.len()];
    let mut qu = vec![0.0f32; lay.rows * sp.reader.n];
    for (o, row) in qu.chunks_exact_mut(sp.reader.n).zip(q.chunks_exact(d)) {
        coder.project_row(row, o);
    }
    let mut dots = vec![0.0f32; lay.rows];
    sp.reader.each_row(isa, sp.codes, h, t, |j, c| {
        ops::dots(isa, &qu, c, &mut dots);
        let sc = sp.sign * sp.scales.get(h * t + j);
        for (r, &v) in dots.iter().enumerate() {
            s[r * t + j] += sc * v;
        }
    });
}

/// Raw scores `q . k_hat` (plus the side correction), rows x tokens, for head `h`.
fn head_scores(
    isa: Isa,
    plan: &Plan,
    side: Option<&SidePlan>,
    q: &[f32],
    h: usize,
    lay: &Layout,
    s: &mut [f32],
) {
    let (t, d, rows) = (lay.tokens, lay.head_dim, lay.rows);
    let mut dots = vec![0.0f32; rows];
    match plan {
        Plan::Mse {
            codes,
            norms,
            rot,
            reader,
            qjl,
        } => {
            let qr = code_queries(isa, rot, q, d, reader.n);
            reader.each_row(isa, codes, h, t, |j, k| {
                ops::dots(isa, &qr, k, &mut dots);
                let nj = norms.get(h * t + j);
                for (r, &v) in dots.iter().enumerate() {
                    s[r * t + j] = nj * v;
                }
            });
            if let Some(p) = qjl {
                qjl_scores(isa, p, &qr, h, t, s);
            }
        }
        Plan::Tokens {
            codes,
            scales,
            zeros,
            rot,
            reader,
            group,
            groups,
        } => {
            let cd = reader.n;
            let qr = code_queries(isa, rot, q, d, cd);
            // sum_(i in g) w_i per row and group: the zero point's share of each group.
            let sums: Vec<f32> = qr
                .chunks_exact(cd)
                .flat_map(|row| row.chunks(*group).map(|c| c.iter().sum::<f32>()))
                .collect();
            reader.each_row(isa, codes, h, t, |j, k| {
                let base = (h * t + j) * groups;
                for (r, row) in qr.chunks_exact(cd).enumerate() {
                    let mut acc = 0.0f32;
                    for (g, (qg, kg)) in row.chunks(*group).zip(k.chunks(*group)).enumerate() {
                        acc += zeros.get(base + g) * sums[r * groups + g]
                            + scales.get(base + g) * ops::dot(isa, qg, kg);
                    }
                    s[r * t + j] = acc;
                }
            });
        }
        Plan::Channels {
            codes,
            scales,
            zeros,
            reader,
            group,
            groups,
        } => {
            let rb = reader.row_bytes;
            let mut scratch = vec![0u8; *group];
            // One group of tokens: the codes of every channel as levels (d x n), and per query
            // row the channel weights q_c s_(c,g) and the zero-point sum sum_c q_c z_(c,g).
            let mut block = vec![0.0f32; d * group];
            let mut w = vec![0.0f32; d];
            for g in 0..*groups {
                let (t0, t1) = (g * group, ((g + 1) * group).min(t));
                let n = t1 - t0;
                for (c, lev) in block.chunks_exact_mut(n).take(d).enumerate() {
                    let ch = h * d + c;
                    reader.decode(isa, &codes[ch * rb..(ch + 1) * rb], t0, &mut scratch, lev);
                }
                for (r, qr) in q.chunks_exact(d).enumerate() {
                    let mut zs = 0.0f32;
                    for (c, (wc, &qc)) in w.iter_mut().zip(qr).enumerate() {
                        let ch = h * d + c;
                        zs += qc * zeros.get(ch * groups + g);
                        *wc = qc * scales.get(ch * groups + g);
                    }
                    let out = &mut s[r * t + t0..r * t + t1];
                    out.fill(0.0);
                    // SIMD over the tokens of the group; channels summed in order.
                    ops::axpy_rows_f32(isa, out, &w, &block[..d * n], n);
                    out.iter_mut().for_each(|o| *o += zs);
                }
            }
        }
        Plan::Dense(x) => {
            for (j, k) in x[h * t * d..(h + 1) * t * d].chunks_exact(d).enumerate() {
                ops::dots(isa, q, k, &mut dots);
                for (r, &v) in dots.iter().enumerate() {
                    s[r * t + j] = v;
                }
            }
        }
    }
    if let Some(sp) = side {
        side_scores(isa, sp, q, h, lay, s);
    }
}

/// Un-rotates (or copies) each row of a float64 code-domain accumulator (rows x d') divided
/// by its softmax normaliser into `out` (rows x d).
fn finish(isa: Isa, rot: &Option<Rotation>, acc: &[f64], sums: &[f64], out: &mut [f32]) {
    let cd = acc.len() / sums.len();
    let d = out.len() / sums.len();
    let mut buf = vec![0.0f32; cd];
    for ((ar, &sum), o) in acc.chunks_exact(cd).zip(sums).zip(out.chunks_exact_mut(d)) {
        for (b, &a) in buf.iter_mut().zip(ar) {
            *b = (a / sum) as f32;
        }
        match rot {
            Some(r) => r.inverse_row_isa(isa, &mut buf, o),
            None => o.copy_from_slice(&buf[..d]),
        }
    }
}

/// `sum_j p_j v_hat_j / sums` for head `h` from the unnormalised weights `p` (rows x tokens).
fn head_values(
    isa: Isa,
    plan: &Plan,
    p: &[f32],
    sums: &[f64],
    h: usize,
    lay: &Layout,
    out: &mut [f32],
) {
    let (t, d, rows) = (lay.tokens, lay.head_dim, lay.rows);
    match plan {
        Plan::Mse {
            codes,
            norms,
            rot,
            reader,
            qjl,
        } => {
            let cd = reader.n;
            let mut sum = Accumulator::new(rows, cd);
            let mut nb = [0.0f32; BLOCK];
            reader.each_block(isa, codes, h, t, |j0, block| {
                for (k, v) in nb.iter_mut().take(block.len() / cd).enumerate() {
                    *v = norms.get(h * t + j0 + k);
                }
                sum.add_block(isa, block, |r, k| p[r * t + j0 + k] * nb[k]);
            });
            let mut acc = sum.finish();
            if let Some(q) = qjl {
                // The residual accumulated in sketch space, u = sum_j p_j ||r_j|| sigma_j, then
                // mapped back once: acc += sqrt(pi/2)/m * S^T u (rows of S in increasing order).
                let mut u = Accumulator::new(rows, cd);
                q.reader.each_block(isa, q.signs, h, t, |j0, block| {
                    for (k, v) in nb.iter_mut().take(block.len() / cd).enumerate() {
                        *v = q.norms.get(h * t + j0 + k);
                    }
                    u.add_block(isa, block, |r, k| p[r * t + j0 + k] * nb[k]);
                });
                let u = u.finish();
                let k = f64::from(q.k);
                for (ar, ur) in acc.chunks_exact_mut(cd).zip(u.chunks_exact(cd)) {
                    for (srow, &ui) in q.sketcher.matrix().chunks_exact(cd).zip(ur) {
                        ops::axpy_f64(isa, ar, k * ui, srow);
                    }
                }
            }
            finish(isa, rot, &acc, sums, out);
        }
        Plan::Tokens {
            codes,
            scales,
            zeros,
            rot,
            reader,
            group,
            groups,
        } => {
            let cd = reader.n;
            let mut sum = Accumulator::new(rows, cd);
            let mut zacc = vec![0.0f64; rows * groups];
            reader.each_block(isa, codes, h, t, |j0, block| {
                let count = block.len() / cd;
                for (r, ar) in sum.part.chunks_exact_mut(cd).enumerate() {
                    for (g, ag) in ar.chunks_mut(*group).enumerate() {
                        let w = &mut sum.w;
                        w.clear();
                        w.extend((0..count).map(|k| {
                            let (pj, at) = (p[r * t + j0 + k], (h * t + j0 + k) * groups + g);
                            zacc[r * groups + g] += f64::from(pj) * f64::from(zeros.get(at));
                            pj * scales.get(at)
                        }));
                        ops::axpy_rows_f32(isa, ag, w, &block[g * group..], cd);
                    }
                }
                sum.carry();
            });
            let mut acc = sum.finish();
            for (ar, zr) in acc.chunks_exact_mut(cd).zip(zacc.chunks_exact(*groups)) {
                for (i, a) in ar.iter_mut().enumerate() {
                    *a += zr[i / group];
                }
            }
            finish(isa, rot, &acc, sums, out);
        }
        // Rejected before any head runs (per-channel groups are a key layout).
        Plan::Channels { .. } => {}
        Plan::Dense(x) => {
            let mut sum = Accumulator::new(rows, d);
            for (b, block) in x[h * t * d..(h + 1) * t * d].chunks(BLOCK * d).enumerate() {
                sum.add_block(isa, block, |r, k| p[r * t + b * BLOCK + k]);
            }
            finish(isa, &None, &sum.finish(), sums, out);
        }
    }
}

/// One head's (out, lse, probs).
type HeadResult = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The validated keys (with their side code) and values of one call.
struct Plans<'a> {
    keys: Plan<'a>,
    side: Option<SidePlan<'a>>,
    values: Plan<'a>,
}

/// One head: scores, softmax, values. Errors only on a non-finite logit.
fn head(
    isa: Isa,
    plans: &Plans,
    q: &[f32],
    h: usize,
    lay: &Layout,
    want_probs: bool,
) -> Result<HeadResult> {
    let (t, rows) = (lay.tokens, lay.rows);
    let mut s = vec![0.0f32; rows * t];
    head_scores(isa, &plans.keys, plans.side.as_ref(), q, h, lay, &mut s);
    let mut sums = vec![0.0f64; rows];
    let mut lse = vec![0.0f32; rows];
    for (r, sr) in s.chunks_exact_mut(t).enumerate() {
        let mut m = f32::NEG_INFINITY;
        for v in sr.iter_mut() {
            *v *= lay.scale;
            m = m.max(*v);
        }
        if let Some(j) = sr.iter().position(|v| !v.is_finite()) {
            return Err(KvqError::NonFinite {
                arg: "logits",
                row: h * rows + r,
                col: j,
                value: sr[j],
            });
        }
        let mut sum = 0.0f64;
        for v in sr.iter_mut() {
            *v = (*v - m).exp();
            sum += f64::from(*v);
        }
        sums[r] = sum;
        lse[r] = (f64::from(m) + sum.ln()) as f32;
    }
    let mut out = vec![0.0f32; rows * lay.head_dim];
    head_values(isa, &plans.values, &s, &sums, h, lay, &mut out);
    let probs = if want_probs {
        s.chunks_exact(t)
            .zip(&sums)
            .flat_map(|(sr, &sum)| sr.iter().map(move |&v| (f64::from(v) / sum) as f32))
            .collect()
    } else {
        Vec::new()
    };
    Ok((out, lse, probs))
}

/// Decode attention for `layout.rows` query rows per KV head over `layout.tokens` coded keys and
/// values: `out = softmax(scale * (q . k_hat_j + side_j)) @ v_hat`, computed from the codes.
///
/// `q` is heads x rows x head_dim float32 (the query rows of a GQA group of one KV head stacked:
/// no key is copied per query head). Keys may be any [`CodedRows`] (with an optional HeadQ
/// side code); values any but [`CodedRows::UniformChannels`].
///
/// Errors: head_dim < 2, no tokens, rows == 0, a non-finite or non-positive scale, a buffer
/// whose length does not match the layout (naming it, e.g. `keys.codes`), invalid stored
/// scalars, bad bits or group, a bad HeadQ basis, non-finite queries or logits.
///
/// Runs on the active instruction-set path ([`simd::active`]); every path returns the same
/// bits.
pub fn decode_attention(
    q: &[f32],
    layout: &Layout,
    keys: &CodedRows,
    side: Option<&SideRows>,
    values: &CodedRows,
    want_probs: bool,
) -> Result<Attention> {
    decode_attention_with(simd::active(), q, layout, keys, side, values, want_probs)
}

/// [`decode_attention`] on the path `isa` (tests, benches). Errors as [`decode_attention`],
/// and if this CPU lacks `isa`.
pub fn decode_attention_with(
    isa: Isa,
    q: &[f32],
    layout: &Layout,
    keys: &CodedRows,
    side: Option<&SideRows>,
    values: &CodedRows,
    want_probs: bool,
) -> Result<Attention> {
    let isa = isa.checked()?;
    let lay = *layout;
    check_head_dim("head_dim", lay.head_dim)?;
    check_row_len("tokens", lay.tokens)?;
    check_row_len("rows", lay.rows)?;
    if !(lay.scale.is_finite() && lay.scale > 0.0) {
        return Err(KvqError::InvalidValue {
            arg: "scale",
            expected: "a finite positive logit scale",
            value: f64::from(lay.scale),
        });
    }
    let qlen = mul("q", mul("q", lay.heads, lay.rows)?, lay.head_dim)?;
    check_len("q", q.len(), qlen, "heads x rows x head_dim")?;
    check_finite("q", q, lay.head_dim)?;
    if matches!(values, CodedRows::UniformChannels { .. }) {
        return Err(KvqError::InvalidDimension {
            arg: "values",
            expected: "per-token values (per-channel uniform groups are a key layout)".into(),
            actual: 0,
        });
    }
    let plans = Plans {
        keys: Plan::new(keys, &KEY_NAMES, &lay)?,
        values: Plan::new(values, &VALUE_NAMES, &lay)?,
        side: side.map(|s| SidePlan::new(s, &lay, isa)).transpose()?,
    };
    let per_head: Vec<Result<HeadResult>> = (0..lay.heads)
        .into_par_iter()
        .map(|h| {
            let qh = &q[h * lay.rows * lay.head_dim..(h + 1) * lay.rows * lay.head_dim];
            head(isa, &plans, qh, h, &lay, want_probs)
        })
        .collect();
    let mut res = Attention {
        out: Vec::with_capacity(qlen),
        lse: Vec::with_capacity(lay.heads * lay.rows),
        probs: Vec::new(),
    };
    for r in per_head {
        let (o, l, p) = r?;
        res.out.extend_from_slice(&o);
        res.lse.extend_from_slice(&l);
        res.probs.extend_from_slice(&p);
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::mse::MseQuantizer;
    use crate::kernels::pack::pack;
    use crate::kernels::uniform::UniformQuantizer;
    use crate::rng::gaussians;

    fn softmax_ref(s: &[f64]) -> Vec<f64> {
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|v| v / z).collect()
    }

    /// Decode-based reference for one head from decoded keys and values.
    fn reference(q: &[f32], k: &[f32], v: &[f32], rows: usize, t: usize, d: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; rows * d];
        for r in 0..rows {
            let s: Vec<f64> = (0..t)
                .map(|j| {
                    (0..d)
                        .map(|c| f64::from(q[r * d + c]) * f64::from(k[j * d + c]))
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let p = softmax_ref(&s);
            for j in 0..t {
                for c in 0..d {
                    out[r * d + c] += p[j] * f64::from(v[j * d + c]);
                }
            }
        }
        out
    }

    fn close(got: &[f32], want: &[f64], tol: f64) {
        for (g, w) in got.iter().zip(want) {
            assert!(
                (f64::from(*g) - w).abs() <= tol * (1.0 + w.abs()),
                "{g} vs {w}"
            );
        }
    }

    #[test]
    fn mse_keys_and_values_match_the_decoded_reference_at_every_width() {
        let (d, t, rows) = (40, 37, 3);
        let x = gaussians(3, 9, 2 * t * d);
        let q = gaussians(4, 9, rows * d);
        for bits in 1..=8 {
            let quant = MseQuantizer::new(d, bits, Some(11)).unwrap();
            let (kc, vc) = (
                quant.encode(&x[..t * d]).unwrap(),
                quant.encode(&x[t * d..]).unwrap(),
            );
            let cd = quant.code_dim();
            let (kp, vp) = (
                pack(&kc.codes, cd, bits).unwrap(),
                pack(&vc.codes, cd, bits).unwrap(),
            );
            let keys = CodedRows::Mse {
                codes: &kp,
                norms: kc.norms.view(),
                bits,
                seed: Some(11),
                qjl: None,
            };
            let values = CodedRows::Mse {
                codes: &vp,
                norms: vc.norms.view(),
                bits,
                seed: Some(11),
                qjl: None,
            };
            let lay = Layout {
                heads: 1,
                rows,
                tokens: t,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
            };
            let got = decode_attention(&q, &lay, &keys, None, &values, true).unwrap();
            let want = reference(
                &q,
                &quant.decode(&kc).unwrap(),
                &quant.decode(&vc).unwrap(),
                rows,
                t,
                d,
            );
            close(&got.out, &want, 1e-5);
            for r in 0..rows {
                let total: f64 = got.probs[r * t..(r + 1) * t]
                    .iter()
                    .map(|&v| f64::from(v))
                    .sum();
                assert!((total - 1.0).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn uniform_values_and_channel_keys_match_the_decoded_reference() {
        let (d, t, rows) = (64, 45, 2);
        let x = gaussians(5, 9, 2 * t * d);
        let q = gaussians(6, 9, rows * d);
        for bits in [2, 3, 4, 8] {
            // Keys per channel: lay channels out as rows of tokens.
            let mut kt = vec![0.0f32; t * d];
            for j in 0..t {
                for c in 0..d {
                    kt[c * t + j] = x[j * d + c];
                }
            }
            let kq = UniformQuantizer::new(t, 32, bits).unwrap();
            let kc = kq.encode(&kt).unwrap();
            let kdec_t = kq.decode(&kc).unwrap();
            let mut kdec = vec![0.0f32; t * d];
            for j in 0..t {
                for c in 0..d {
                    kdec[j * d + c] = kdec_t[c * t + j];
                }
            }
            let vq = UniformQuantizer::new(d, 32, bits).unwrap();
            let vc = vq.encode(&x[t * d..]).unwrap();
            let kp = pack(&kc.codes, t, bits).unwrap();
            let vp = pack(&vc.codes, d, bits).unwrap();
            let keys = CodedRows::UniformChannels {
                codes: &kp,
                scales: kc.scales.view(),
                zeros: kc.zeros.view(),
                bits,
                group: 32,
            };
            let values = CodedRows::UniformTokens {
                codes: &vp,
                scales: vc.scales.view(),
                zeros: vc.zeros.view(),
                bits,
                group: 32,
                seed: None,
            };
            let lay = Layout {
                heads: 1,
                rows,
                tokens: t,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
            };
            let got = decode_attention(&q, &lay, &keys, None, &values, false).unwrap();
            let want = reference(&q, &kdec, &vq.decode(&vc).unwrap(), rows, t, d);
            close(&got.out, &want, 1e-5);
        }
    }

    #[test]
    fn bad_sizes_name_the_argument() {
        let lay = Layout {
            heads: 1,
            rows: 1,
            tokens: 2,
            head_dim: 4,
            scale: 0.5,
        };
        let q = [0.0f32; 4];
        let n = [0u16; 2];
        let keys = CodedRows::Mse {
            codes: &[0u8; 3],
            norms: ScalarView::F16(&n),
            bits: 4,
            seed: None,
            qjl: None,
        };
        let values = CodedRows::Dense(&[0.0; 8]);
        let err = decode_attention(&q, &lay, &keys, None, &values, false).unwrap_err();
        assert!(err.to_string().starts_with("keys.codes"), "{err}");
        let lay0 = Layout { tokens: 0, ..lay };
        assert!(decode_attention(&q, &lay0, &keys, None, &values, false)
            .unwrap_err()
            .to_string()
            .starts_with("tokens"));
    }
}
