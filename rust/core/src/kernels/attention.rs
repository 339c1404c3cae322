//! Fused decode attention straight from a compressed KV cache, for one or a few query rows per
//! KV head (issue 6; docs/kernels.md section 11). Nothing is decoded back to keys or values:
//!
//! - the query is rotated once (rotation schemes) and turned into a lookup table over the
//!   stored symbols (a packed byte when `8 % bits == 0`, else one unpacked code):
//!   `table[p][a] = sum_t w_(p,t) * value(code_t(a))`, so a score is one table read per byte;
//!   MSE keys: `w = R q`, `value = centroid`, score `||k|| * sum_p table[p][byte_p]`;
//!   QJL residual (qkqv): `w = S R q`, `value = +-1`, times `sqrt(pi/2)/m * ||r||`
//!   (the estimator of Zandieh et al. 2024);
//!   uniform groups along a token (block): the same per group, `z_g sum_(i in g) w_i +
//!   s_g * lookup`; KIVI per-channel keys: `sum_c q_c z_(c,g) + sum_c (q_c s_(c,g)) code_(c,j)`;
//!   HeadQ: `+ sign * s_j * sum_i (U^T q)_i (code_i - h)` (SPEC 2.6);
//! - a numerically stable softmax (max subtracted, float64 normaliser, log-sum-exp returned so
//!   that callers can merge another softmax part exactly);
//! - the weighted sum of values accumulated from their codes in the code domain: each coded
//!   row is decoded once through a per-symbol table (shared by every query row of the group) and
//!   added with weight `p_j ||v_j||` to a float64 accumulator per query row; the QJL value
//!   residual is accumulated in sketch space and mapped back once with `S^T`, uniform values
//!   with their zero points summed per group; the result is un-rotated once.
//!
//! The query rows of one KV head (a GQA group of query heads times the query tokens) share one
//! pass over that head's codes. Heads run in parallel (rayon); each head's arithmetic is
//! sequential in a fixed order, so results do not depend on the thread count.

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
use crate::reduce::dot;
use crate::scalars::ScalarView;

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

/// How a packed row is read through lookup tables: bytes (alphabet 256) when the codes never
/// straddle a byte and every group boundary falls on a byte, else unpacked codes.
#[derive(Debug, Clone, Copy)]
struct Symbols {
    n: usize,
    bits: u32,
    row_bytes: usize,
    per: usize,
    aligned: bool,
    positions: usize,
    alphabet: usize,
}

impl Symbols {
    fn new(n: usize, bits: u32, group: Option<usize>) -> Self {
        let per = (8 / bits) as usize;
        let row_bytes = packed_len(n, bits);
        if 8 % bits == 0 && group.is_none_or(|g| g % per == 0) {
            Self {
                n,
                bits,
                row_bytes,
                per,
                aligned: true,
                positions: row_bytes,
                alphabet: 256,
            }
        } else {
            Self {
                n,
                bits,
                row_bytes,
                per: 1,
                aligned: false,
                positions: n,
                alphabet: 1 << bits,
            }
        }
    }

    fn table_len(&self) -> usize {
        self.positions * self.alphabet
    }

    /// Symbol positions per group of `group` codes.
    fn group_positions(&self, group: usize) -> usize {
        group / self.per
    }

    /// The symbols of one packed row: the row itself, or its codes unpacked into `scratch`.
    #[inline]
    fn read<'b>(&self, row: &'b [u8], scratch: &'b mut [u8]) -> &'b [u8] {
        if self.aligned {
            row
        } else {
            unpack_range(row, self.bits, 0, &mut scratch[..self.n]);
            &scratch[..self.n]
        }
    }

    /// Code number `t` of symbol `a`.
    #[inline]
    fn code(&self, a: usize, t: usize) -> usize {
        (a >> (t as u32 * self.bits)) & ((1usize << self.bits) - 1)
    }

    /// `table[p][a] = sum_t weights[p * per + t] * values[code_t(a)]` over the codes present.
    fn build_table(&self, weights: &[f32], values: &[f32], table: &mut [f32]) {
        for (p, t) in table.chunks_exact_mut(self.alphabet).enumerate() {
            let lo = p * self.per;
            let w = &weights[lo..(lo + self.per).min(self.n)];
            for (a, slot) in t.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for (k, &wk) in w.iter().enumerate() {
                    acc += wk * values[self.code(a, k)];
                }
                *slot = acc;
            }
        }
    }

    /// `sum_p table[p][sym[p]]` over positions `p0 .. p1`: four register accumulators over
    /// consecutive positions, combined as `(a0 + a2) + (a1 + a3)` (a fixed order).
    #[inline]
    fn lookup(&self, table: &[f32], sym: &[u8], p0: usize, p1: usize) -> f32 {
        let a = self.alphabet;
        let mut tc = table[p0 * a..p1 * a].chunks_exact(4 * a);
        let mut sc = sym[p0..p1].chunks_exact(4);
        let (mut a0, mut a1, mut a2, mut a3) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
        for (t, s) in (&mut tc).zip(&mut sc) {
            a0 += t[usize::from(s[0])];
            a1 += t[a + usize::from(s[1])];
            a2 += t[2 * a + usize::from(s[2])];
            a3 += t[3 * a + usize::from(s[3])];
        }
        for (t, &s) in tc.remainder().chunks_exact(a).zip(sc.remainder()) {
            a0 += t[usize::from(s)];
        }
        (a0 + a2) + (a1 + a3)
    }

    /// `dtab[a][t] = values[code_t(a)]`: the decode of every symbol (built once per call).
    fn decode_table(&self, values: &[f32]) -> Vec<f32> {
        let mut dtab = vec![0.0f32; self.alphabet * self.per];
        for (a, d) in dtab.chunks_exact_mut(self.per).enumerate() {
            for (t, v) in d.iter_mut().enumerate() {
                *v = values[self.code(a, t)];
            }
        }
        dtab
    }

    /// `out[i] = values[code_i]` for one row through its decode table (`out.len() == n`).
    #[inline]
    fn decode(&self, sym: &[u8], dtab: &[f32], out: &mut [f32]) {
        let mut oc = out.chunks_exact_mut(self.per);
        for (o, &s) in (&mut oc).zip(sym) {
            let at = usize::from(s) * self.per;
            // Element copies: a slice copy of a run-time length of 1..8 floats calls memmove.
            for (x, &v) in o.iter_mut().zip(&dtab[at..at + self.per]) {
                *x = v;
            }
        }
        let rest = oc.into_remainder();
        if !rest.is_empty() {
            let at = usize::from(sym[self.n / self.per]) * self.per;
            rest.copy_from_slice(&dtab[at..at + rest.len()]);
        }
    }
}

/// `acc[i] += w * x[i]` in float64 (the value accumulation; vectorisable).
#[inline]
fn axpy(acc: &mut [f64], w: f64, x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += w * f64::from(v);
    }
}

/// The QJL part of a plan.
struct QjlPlan<'a> {
    signs: &'a [u8],
    norms: ScalarView<'a>,
    sketcher: Arc<QjlSketcher>,
    sym: Symbols,
    k: f32,
}

/// A validated side of the cache with its codebook, rotation and sketch built once per call.
enum Plan<'a> {
    Mse {
        codes: &'a [u8],
        norms: ScalarView<'a>,
        rot: Option<Rotation>,
        centroids: Vec<f32>,
        sym: Symbols,
        qjl: Option<QjlPlan<'a>>,
    },
    Tokens {
        codes: &'a [u8],
        scales: ScalarView<'a>,
        zeros: ScalarView<'a>,
        rot: Option<Rotation>,
        levels: Vec<f32>,
        sym: Symbols,
        group: usize,
        groups: usize,
    },
    Channels {
        codes: &'a [u8],
        scales: ScalarView<'a>,
        zeros: ScalarView<'a>,
        bits: u32,
        group: usize,
        groups: usize,
        row_bytes: usize,
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
                let sym = Symbols::new(cd, bits, None);
                check_len(
                    names.codes,
                    codes.len(),
                    mul(names.codes, vectors, sym.row_bytes)?,
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
                        let qsym = Symbols::new(cd, 1, None);
                        check_len(
                            names.qjl_signs,
                            q.signs.len(),
                            mul(names.qjl_signs, vectors, qsym.row_bytes)?,
                            "heads x tokens x ceil(d'/8) sign bytes",
                        )?;
                        q.norms.validate(names.qjl_norms, vectors)?;
                        Some(QjlPlan {
                            signs: q.signs,
                            norms: q.norms,
                            sketcher: QjlSketcher::cached(cd, cd, q.seed)?,
                            sym: qsym,
                            k: ((PI / 2.0).sqrt() / cd as f64) as f32,
                        })
                    }
                };
                Ok(Plan::Mse {
                    codes,
                    norms,
                    rot,
                    centroids: codebook(cd, bits)?.centroids_f32.clone(),
                    sym,
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
                let sym = Symbols::new(cd, bits, Some(group));
                let groups = cd.div_ceil(group);
                check_len(
                    names.codes,
                    codes.len(),
                    mul(names.codes, vectors, sym.row_bytes)?,
                    "heads x tokens x packed codes",
                )?;
                scales.validate(names.scales, mul(names.scales, vectors, groups)?)?;
                zeros.validate_signed(names.zeros, vectors * groups)?;
                Ok(Plan::Tokens {
                    codes,
                    scales,
                    zeros,
                    rot,
                    levels: levels(bits),
                    sym,
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
                let row_bytes = packed_len(t, bits);
                let groups = t.div_ceil(group);
                let channels = mul(names.codes, h, d)?;
                check_len(
                    names.codes,
                    codes.len(),
                    mul(names.codes, channels, row_bytes)?,
                    "heads x head_dim x packed tokens",
                )?;
                scales.validate(names.scales, mul(names.scales, channels, groups)?)?;
                zeros.validate_signed(names.zeros, channels * groups)?;
                Ok(Plan::Channels {
                    codes,
                    scales,
                    zeros,
                    bits,
                    group,
                    groups,
                    row_bytes,
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
    sym: Symbols,
    levels: Vec<f32>,
    sign: f32,
}

impl<'a> SidePlan<'a> {
    fn new(s: &SideRows<'a>, layout: &Layout) -> Result<Self> {
        check_bits("side.bits", s.bits)?;
        check_row_len("side.rank", s.rank)?;
        if s.sign != 1.0 && s.sign != -1.0 {
            return Err(KvqError::InvalidDimension {
                arg: "side.sign",
                expected: "+1 or -1".into(),
                actual: s.sign as i64,
            });
        }
        if s.basis_heads == 0 || layout.heads % s.basis_heads != 0 {
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
            .map(|u| HeadqCoder::new(u, layout.head_dim, s.rank, s.bits))
            .collect::<Result<Vec<_>>>()?;
        let sym = Symbols::new(s.rank, s.bits, None);
        let vectors = layout.heads * layout.tokens;
        check_len(
            "side.codes",
            s.codes.len(),
            mul("side.codes", vectors, sym.row_bytes)?,
            "heads x tokens x packed side codes",
        )?;
        s.scales.validate("side.scales", vectors)?;
        let half = coders[0].half();
        let levels = (0..1u32 << s.bits).map(|v| v as f32 - half).collect();
        Ok(Self {
            codes: s.codes,
            scales: s.scales,
            coders,
            sym,
            levels,
            sign: s.sign,
        })
    }
}

/// Rotates one query row into `out` (d' values), or copies it when there is no rotation.
fn rotate(rot: &Option<Rotation>, q: &[f32], out: &mut [f32]) {
    match rot {
        Some(r) => r.forward_row(q, out),
        None => out.copy_from_slice(q),
    }
}

/// Raw scores `q . k_hat` (plus the side correction), rows x tokens, for head `h`.
fn head_scores(
    plan: &Plan,
    side: Option<&SidePlan>,
    q: &[f32],
    h: usize,
    lay: &Layout,
    s: &mut [f32],
) {
    let (t, d, rows) = (lay.tokens, lay.head_dim, lay.rows);
    match plan {
        Plan::Mse {
            codes,
            norms,
            rot,
            centroids,
            sym,
            qjl,
        } => {
            let cd = sym.n;
            let tl = sym.table_len();
            let mut tables = vec![0.0f32; rows * tl];
            let mut qr = vec![0.0f32; cd];
            let mut qjl_tables = qjl.as_ref().map(|p| vec![0.0f32; rows * p.sym.table_len()]);
            let mut sq = vec![0.0f32; cd];
            for r in 0..rows {
                rotate(rot, &q[r * d..(r + 1) * d], &mut qr);
                sym.build_table(&qr, centroids, &mut tables[r * tl..(r + 1) * tl]);
                if let (Some(p), Some(qt)) = (qjl, qjl_tables.as_mut()) {
                    p.sketcher.project_row(&qr, &mut sq);
                    let ql = p.sym.table_len();
                    p.sym
                        .build_table(&sq, &[1.0, -1.0], &mut qt[r * ql..(r + 1) * ql]);
                }
            }
            let rb = sym.row_bytes;
            let mut scratch = vec![0u8; cd];
            for (j, row) in codes[h * t * rb..(h + 1) * t * rb]
                .chunks_exact(rb)
                .enumerate()
            {
                let sy = sym.read(row, &mut scratch);
                let nj = norms.get(h * t + j);
                for (r, table) in tables.chunks_exact(tl).enumerate() {
                    s[r * t + j] = nj * sym.lookup(table, sy, 0, sym.positions);
                }
            }
            if let (Some(p), Some(qt)) = (qjl, qjl_tables.as_ref()) {
                let (qb, ql) = (p.sym.row_bytes, p.sym.table_len());
                for (j, row) in p.signs[h * t * qb..(h + 1) * t * qb]
                    .chunks_exact(qb)
                    .enumerate()
                {
                    let kr = p.k * p.norms.get(h * t + j);
                    for (r, table) in qt.chunks_exact(ql).enumerate() {
                        s[r * t + j] += kr * p.sym.lookup(table, row, 0, p.sym.positions);
                    }
                }
            }
        }
        Plan::Tokens {
            codes,
            scales,
            zeros,
            rot,
            levels,
            sym,
            group,
            groups,
        } => {
            let cd = sym.n;
            let tl = sym.table_len();
            let gp = sym.group_positions(*group);
            let mut tables = vec![0.0f32; rows * tl];
            let mut sums = vec![0.0f32; rows * groups];
            let mut qr = vec![0.0f32; cd];
            for r in 0..rows {
                rotate(rot, &q[r * d..(r + 1) * d], &mut qr);
                sym.build_table(&qr, levels, &mut tables[r * tl..(r + 1) * tl]);
                for (g, c) in qr.chunks(*group).enumerate() {
                    sums[r * groups + g] = c.iter().sum();
                }
            }
            let rb = sym.row_bytes;
            let mut scratch = vec![0u8; cd];
            for (j, row) in codes[h * t * rb..(h + 1) * t * rb]
                .chunks_exact(rb)
                .enumerate()
            {
                let sy = sym.read(row, &mut scratch);
                let base = (h * t + j) * groups;
                for (r, table) in tables.chunks_exact(tl).enumerate() {
                    let mut acc = 0.0f32;
                    for g in 0..*groups {
                        let p1 = ((g + 1) * gp).min(sym.positions);
                        acc += zeros.get(base + g) * sums[r * groups + g]
                            + scales.get(base + g) * sym.lookup(table, sy, g * gp, p1);
                    }
                    s[r * t + j] = acc;
                }
            }
        }
        Plan::Channels {
            codes,
            scales,
            zeros,
            bits,
            group,
            groups,
            row_bytes,
        } => {
            s.fill(0.0);
            let mut buf = vec![0u8; *group];
            let mut zsum = vec![0.0f32; rows];
            for g in 0..*groups {
                let (t0, t1) = (g * group, ((g + 1) * group).min(t));
                let code = &mut buf[..t1 - t0];
                zsum.fill(0.0);
                for c in 0..d {
                    let ch = h * d + c;
                    unpack_range(
                        &codes[ch * row_bytes..(ch + 1) * row_bytes],
                        *bits,
                        t0,
                        code,
                    );
                    let (sc, z) = (scales.get(ch * groups + g), zeros.get(ch * groups + g));
                    for (r, zs) in zsum.iter_mut().enumerate() {
                        let qc = q[r * d + c];
                        *zs += qc * z;
                        let w = qc * sc;
                        for (o, &k) in s[r * t + t0..r * t + t1].iter_mut().zip(code.iter()) {
                            *o += w * f32::from(k);
                        }
                    }
                }
                for (r, zs) in zsum.iter().enumerate() {
                    s[r * t + t0..r * t + t1].iter_mut().for_each(|o| *o += zs);
                }
            }
        }
        Plan::Dense(x) => {
            for (j, k) in x[h * t * d..(h + 1) * t * d].chunks_exact(d).enumerate() {
                for r in 0..rows {
                    s[r * t + j] = dot(&q[r * d..(r + 1) * d], k);
                }
            }
        }
    }
    if let Some(sp) = side {
        let coder = &sp.coders[h % sp.coders.len()];
        let rank = sp.sym.n;
        let tl = sp.sym.table_len();
        let mut tables = vec![0.0f32; rows * tl];
        let mut qu = vec![0.0f32; rank];
        for r in 0..rows {
            coder.project_row(&q[r * d..(r + 1) * d], &mut qu);
            sp.sym
                .build_table(&qu, &sp.levels, &mut tables[r * tl..(r + 1) * tl]);
        }
        let rb = sp.sym.row_bytes;
        let mut scratch = vec![0u8; rank];
        for (j, row) in sp.codes[h * t * rb..(h + 1) * t * rb]
            .chunks_exact(rb)
            .enumerate()
        {
            let sy = sp.sym.read(row, &mut scratch);
            let sc = sp.sign * sp.scales.get(h * t + j);
            for (r, table) in tables.chunks_exact(tl).enumerate() {
                s[r * t + j] += sc * sp.sym.lookup(table, sy, 0, sp.sym.positions);
            }
        }
    }
}

/// Un-rotates (or copies) a float64 code-domain accumulator divided by `sum` into `out`.
fn finish(rot: &Option<Rotation>, acc: &[f64], sum: f64, buf: &mut [f32], out: &mut [f32]) {
    for (b, &a) in buf.iter_mut().zip(acc) {
        *b = (a / sum) as f32;
    }
    match rot {
        Some(r) => r.inverse_row(buf, out),
        None => out.copy_from_slice(&buf[..out.len()]),
    }
}

/// `sum_j p_j v_hat_j / sums` for head `h` from the unnormalised weights `p` (rows x tokens).
fn head_values(plan: &Plan, p: &[f32], sums: &[f64], h: usize, lay: &Layout, out: &mut [f32]) {
    let (t, d, rows) = (lay.tokens, lay.head_dim, lay.rows);
    match plan {
        Plan::Mse {
            codes,
            norms,
            rot,
            centroids,
            sym,
            qjl,
        } => {
            let cd = sym.n;
            let dtab = sym.decode_table(centroids);
            let mut acc = vec![0.0f64; rows * cd];
            let mut dec = vec![0.0f32; cd];
            let mut scratch = vec![0u8; cd];
            let rb = sym.row_bytes;
            for (j, row) in codes[h * t * rb..(h + 1) * t * rb]
                .chunks_exact(rb)
                .enumerate()
            {
                sym.decode(sym.read(row, &mut scratch), &dtab, &mut dec);
                let nj = f64::from(norms.get(h * t + j));
                for (r, ar) in acc.chunks_exact_mut(cd).enumerate() {
                    axpy(ar, f64::from(p[r * t + j]) * nj, &dec);
                }
            }
            if let Some(q) = qjl {
                // The residual accumulated in sketch space, u = sum_j p_j ||r_j|| sigma_j, then
                // mapped back once: acc += sqrt(pi/2)/m * S^T u (rows of S in increasing order).
                let qtab = q.sym.decode_table(&[1.0, -1.0]);
                let mut u = vec![0.0f64; rows * cd];
                let qb = q.sym.row_bytes;
                for (j, row) in q.signs[h * t * qb..(h + 1) * t * qb]
                    .chunks_exact(qb)
                    .enumerate()
                {
                    q.sym.decode(row, &qtab, &mut dec);
                    let rn = f64::from(q.norms.get(h * t + j));
                    for (r, ur) in u.chunks_exact_mut(cd).enumerate() {
                        axpy(ur, f64::from(p[r * t + j]) * rn, &dec);
                    }
                }
                let k = f64::from(q.k);
                for (ar, ur) in acc.chunks_exact_mut(cd).zip(u.chunks_exact(cd)) {
                    for (srow, &ui) in q.sketcher.matrix().chunks_exact(cd).zip(ur) {
                        axpy(ar, k * ui, srow);
                    }
                }
            }
            let mut buf = vec![0.0f32; cd];
            for (r, ar) in acc.chunks_exact(cd).enumerate() {
                finish(rot, ar, sums[r], &mut buf, &mut out[r * d..(r + 1) * d]);
            }
        }
        Plan::Tokens {
            codes,
            scales,
            zeros,
            rot,
            levels,
            sym,
            group,
            groups,
        } => {
            let cd = sym.n;
            let dtab = sym.decode_table(levels);
            let mut acc = vec![0.0f64; rows * cd];
            let mut zacc = vec![0.0f64; rows * groups];
            let mut dec = vec![0.0f32; cd];
            let mut scratch = vec![0u8; cd];
            let rb = sym.row_bytes;
            for (j, row) in codes[h * t * rb..(h + 1) * t * rb]
                .chunks_exact(rb)
                .enumerate()
            {
                sym.decode(sym.read(row, &mut scratch), &dtab, &mut dec);
                let base = (h * t + j) * groups;
                for (r, ar) in acc.chunks_exact_mut(cd).enumerate() {
                    let pj = f64::from(p[r * t + j]);
                    for (g, (ag, dg)) in ar.chunks_mut(*group).zip(dec.chunks(*group)).enumerate() {
                        axpy(ag, pj * f64::from(scales.get(base + g)), dg);
                        zacc[r * groups + g] += pj * f64::from(zeros.get(base + g));
                    }
                }
            }
            let mut buf = vec![0.0f32; cd];
            for (r, ar) in acc.chunks_exact_mut(cd).enumerate() {
                for (i, a) in ar.iter_mut().enumerate() {
                    *a += zacc[r * groups + i / group];
                }
                finish(rot, ar, sums[r], &mut buf, &mut out[r * d..(r + 1) * d]);
            }
        }
        Plan::Channels { .. } => {}
        Plan::Dense(x) => {
            let mut acc = vec![0.0f64; d];
            let mut buf = vec![0.0f32; d];
            for r in 0..rows {
                acc.fill(0.0);
                for (j, v) in x[h * t * d..(h + 1) * t * d].chunks_exact(d).enumerate() {
                    let pj = f64::from(p[r * t + j]);
                    for (a, &vc) in acc.iter_mut().zip(v) {
                        *a += pj * f64::from(vc);
                    }
                }
                finish(&None, &acc, sums[r], &mut buf, &mut out[r * d..(r + 1) * d]);
            }
        }
    }
}

/// One head: scores, softmax, values. Errors only on a non-finite logit.
/// One head's (out, lse, probs).
type HeadResult = (Vec<f32>, Vec<f32>, Vec<f32>);

fn head(
    kp: &Plan,
    side: Option<&SidePlan>,
    vp: &Plan,
    q: &[f32],
    h: usize,
    lay: &Layout,
    want_probs: bool,
) -> Result<HeadResult> {
    let (t, rows) = (lay.tokens, lay.rows);
    let mut s = vec![0.0f32; rows * t];
    head_scores(kp, side, q, h, lay, &mut s);
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
    head_values(vp, &s, &sums, h, lay, &mut out);
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
pub fn decode_attention(
    q: &[f32],
    layout: &Layout,
    keys: &CodedRows,
    side: Option<&SideRows>,
    values: &CodedRows,
    want_probs: bool,
) -> Result<Attention> {
    let lay = *layout;
    check_head_dim("head_dim", lay.head_dim)?;
    check_row_len("tokens", lay.tokens)?;
    check_row_len("rows", lay.rows)?;
    if !(lay.scale.is_finite() && lay.scale > 0.0) {
        return Err(KvqError::InvalidDimension {
            arg: "scale",
            expected: "a finite positive logit scale".into(),
            actual: lay.scale as i64,
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
    let kp = Plan::new(keys, &KEY_NAMES, &lay)?;
    let vp = Plan::new(values, &VALUE_NAMES, &lay)?;
    let sp = side.map(|s| SidePlan::new(s, &lay)).transpose()?;
    let per_head: Vec<Result<HeadResult>> = (0..lay.heads)
        .into_par_iter()
        .map(|h| {
            let qh = &q[h * lay.rows * lay.head_dim..(h + 1) * lay.rows * lay.head_dim];
            head(&kp, sp.as_ref(), &vp, qh, h, &lay, want_probs)
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
