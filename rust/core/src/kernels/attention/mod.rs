//! Fused decode attention straight from a compressed KV cache, for one or a few query rows per
//! KV head (docs/kernels.md section 11). No key or value is reconstructed in the head domain:
//! each stored row is decoded, in registers of the active SIMD path, to its values in the code
//! domain (the rotated domain for rotation schemes) and used there at once.
//!
//! The kernel is split along the row layouts, as faiss's distance computers compose a decoder
//! and a similarity: each layout (one file: `mse`, `uniform`, `dense`, HeadQ's `side`
//! code, the per-channel runs of a calibrated basis in `runs`, the per-token runs of a basis in
//! `token_runs` (keys only), and a [`CodedRows::Centred`] mean around any of them) implements
//! `KeyRows` (prepare the query rows once per head, then add their scores against a span of
//! tokens) and, for value layouts, `ValueRows` (add the weighted sum of a span of value rows to
//! a float64 accumulator, then map it back once). This file holds the driver that is the same
//! for every layout:
//!
//! - each head's tokens are split into fixed chunks of [`CHUNK`] tokens (whole KIVI key groups),
//!   and every (head, chunk) pair is one rayon task (one step of a loop on the calling thread
//!   for calls below `par::par_min_attend()` multiply-adds): scores, the chunk's maximum, `exp` (the
//!   SIMD polynomial of `simd::scalar::exp`) and its float64 sum, and the value sums;
//! - the chunks of a head are merged by log-sum-exp in chunk order, `sum = sum_c e^(m_c - m)
//!   sum_c`, the accumulators alike, and the log-sum-exp is returned so that callers can merge
//!   another softmax part exactly.
//!
//! The chunks depend on the token count only, and every floating-point step is elementwise or
//! a fixed-order reduction, so the scalar reference, every SIMD path and every thread count
//! give the same bits.

mod dense;
mod mse;
mod reader;
mod reconstruct;
mod runs;
mod side;
mod token_runs;
mod uniform;

use std::ops::Range;

use self::dense::DensePlan;
use self::mse::MsePlan;
pub use self::reconstruct::reconstruct_with;
use self::runs::{CentredPlan, RunsPlan};
use self::side::SidePlan;
use self::token_runs::TokenRunsPlan;
use self::uniform::{ChannelsPlan, TokensPlan};
use super::{check_finite, check_head_dim, check_len, check_row_len};
use crate::error::{KvqError, Result};
use crate::par;
use crate::rows::{Qjl, Rows, Run, Side, TokenRun};
use crate::scalars::ScalarView;
use crate::simd::{self, ops, Isa};

/// The QJL sketch of the rotated residual that follows an MSE stage, as the kernel reads it.
pub type QjlRows<'a> = Qjl<&'a [u8], ScalarView<'a>>;

/// Stored rows of one side of the cache as the kernel reads them: the row formats of
/// [`Rows`] over borrowed parts (packed bytes, stored scalars, float32 rows and tables).
pub type CodedRows<'a> = Rows<&'a [u8], ScalarView<'a>, &'a [f32]>;

/// One run of basis columns of [`CodedRows::ChannelRuns`] as the kernel reads it.
pub type ChannelRun<'a> = Run<&'a [u8], ScalarView<'a>>;

/// One run of basis columns of [`CodedRows::TokenRuns`] as the kernel reads it.
pub type TokenRunView<'a> = TokenRun<&'a [u8]>;

/// HeadQ side code of the keys as the kernel reads it.
pub type SideRows<'a> = Side<&'a [u8], ScalarView<'a>, &'a [f32]>;

/// The shape of one decode-attention call: KV heads, query rows per head, cached tokens (and
/// their room per head), head_dim, and the logit scale.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// KV heads (every leading index flattened).
    pub heads: usize,
    /// Query rows per KV head (GQA group size x query tokens).
    pub rows: usize,
    /// Cached tokens per head.
    pub tokens: usize,
    /// Token room per head of the coded arrays (`>= tokens`): each head's rows of a part
    /// start `stride` tokens' worth of entries after the previous head's (a layer store's
    /// buffers, which keep room to append); equal to `tokens` for compact arrays.
    pub stride: usize,
    /// head_dim d.
    pub head_dim: usize,
    /// Logit scale (1/sqrt(d) for plain attention).
    pub scale: f32,
}

impl AttentionShape {
    /// Sizes of compact arrays (`stride == tokens`).
    pub fn new(heads: usize, rows: usize, tokens: usize, head_dim: usize, scale: f32) -> Self {
        Self {
            heads,
            rows,
            tokens,
            stride: tokens,
            head_dim,
            scale,
        }
    }

    /// The same sizes over `tokens` tokens of compact arrays (`stride == tokens`).
    pub fn compact(self, tokens: usize) -> Self {
        Self {
            tokens,
            stride: tokens,
            ..self
        }
    }
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

/// Argument names per side, so that errors name `keys.codes` or `values.codes`.
struct Names {
    codes: &'static str,
    norms: &'static str,
    /// The exponent bytes of log-coded norms.
    norm_exps: &'static str,
    scales: &'static str,
    zeros: &'static str,
    bits: &'static str,
    group: &'static str,
    qjl_signs: &'static str,
    qjl_norms: &'static str,
    dense: &'static str,
    basis: &'static str,
    mean: &'static str,
}

const KEY_NAMES: Names = Names {
    codes: "keys.codes",
    norms: "keys.norms",
    norm_exps: "keys.norm_exps",
    scales: "keys.scales",
    zeros: "keys.zeros",
    bits: "keys.bits",
    group: "keys.group",
    qjl_signs: "keys.qjl_signs",
    qjl_norms: "keys.qjl_norms",
    dense: "keys.values",
    basis: "keys.basis",
    mean: "keys.mean",
};

const KEY_RUN_NAMES: Names = Names {
    codes: "keys.runs.codes",
    scales: "keys.runs.scales",
    zeros: "keys.runs.zeros",
    bits: "keys.runs.bits",
    group: "keys.group",
    ..KEY_NAMES
};

const VALUE_NAMES: Names = Names {
    codes: "values.codes",
    norms: "values.norms",
    norm_exps: "values.norm_exps",
    scales: "values.scales",
    zeros: "values.zeros",
    bits: "values.bits",
    group: "values.group",
    qjl_signs: "values.qjl_signs",
    qjl_norms: "values.qjl_norms",
    dense: "values.values",
    basis: "values.basis",
    mean: "values.mean",
};

const VALUE_RUN_NAMES: Names = Names {
    codes: "values.runs.codes",
    scales: "values.runs.scales",
    zeros: "values.runs.zeros",
    bits: "values.runs.bits",
    group: "values.group",
    ..VALUE_NAMES
};

impl Names {
    /// The names of the arrays of one run of [`CodedRows::ChannelRuns`] on this side.
    fn runs(&self) -> &'static Names {
        if self.codes == KEY_NAMES.codes {
            &KEY_RUN_NAMES
        } else {
            &VALUE_RUN_NAMES
        }
    }
}

/// Tokens per task: small enough to balance a few KV heads over the cores, large enough that
/// the per-chunk merge (rows x head_dim float64 values) costs nothing.
pub const CHUNK: usize = 256;

/// The scores of one key row layout.
trait KeyRows: Sync {
    /// The query rows of head `h` (rows x head_dim) prepared for this layout (rotated into the
    /// code domain, projected on a basis, ...), once per call.
    fn queries(&self, isa: Isa, q: &[f32], h: usize, lay: &AttentionShape) -> Vec<f32>;
    /// Adds the raw scores `q . k_hat_j` of the prepared rows `qp` for the tokens `span` of
    /// head `h` to `s` (rows x span.len()).
    fn add_scores(&self, isa: Isa, qp: &[f32], h: usize, span: Range<usize>, s: &mut [f32]);
    /// Chunks of tokens start at multiples of this (the tokens of a KIVI key group).
    fn token_step(&self) -> usize {
        1
    }
    /// A per-query-row term `c_r` of every token's logit that is left out of the scores (it
    /// is the same for every token, so the softmax ignores it) but belongs to the log-sum-exp:
    /// the driver adds `scale * c_r` to it. None when the layout has none.
    fn lse_shift(
        &self,
        _isa: Isa,
        _q: &[f32],
        _h: usize,
        _lay: &AttentionShape,
    ) -> Option<Vec<f32>> {
        None
    }
}

/// The weighted sums of one value row layout.
trait ValueRows: Sync {
    /// Width of the float64 accumulator per query row.
    fn acc_dim(&self) -> usize;
    /// Adds `sum_j p[r, j] v_j` for the tokens `span` of head `h` (in the layout's own domain)
    /// to `acc` (rows x acc_dim); `p` is rows x span.len().
    fn accumulate(&self, isa: Isa, p: &[f32], h: usize, span: Range<usize>, acc: &mut [f64]);
    /// `out` (rows x head_dim) = head `h`'s accumulator divided by `sums`, mapped back to the
    /// head domain (`acc` is scratch).
    fn finish(&self, isa: Isa, h: usize, acc: &mut [f64], sums: &[f64], out: &mut [f32]);
}

/// One validated side of the cache.
enum Plan<'a> {
    Mse(MsePlan<'a>),
    Tokens(TokensPlan<'a>),
    Channels(ChannelsPlan<'a>),
    Dense(DensePlan<'a>),
    Runs(RunsPlan<'a>),
    TokenRuns(TokenRunsPlan<'a>),
    Centred(CentredPlan<'a>),
}

impl<'a> Plan<'a> {
    fn new(rows: &CodedRows<'a>, names: &Names, lay: &AttentionShape) -> Result<Self> {
        Ok(match *rows {
            Rows::Mse {
                codes,
                norms,
                bits,
                seed,
                qjl,
            } => Plan::Mse(MsePlan::new((codes, norms, bits, seed), qjl, names, lay)?),
            Rows::UniformTokens {
                codes,
                scales,
                zeros,
                bits,
                group,
                seed,
            } => Plan::Tokens(TokensPlan::new(
                (codes, scales, zeros),
                (bits, group, seed),
                names,
                lay,
            )?),
            Rows::UniformChannels {
                codes,
                scales,
                zeros,
                bits,
                group,
            } => Plan::Channels(ChannelsPlan::new(
                (codes, scales, zeros),
                (bits, group),
                names,
                lay,
            )?),
            Rows::Dense(x) => Plan::Dense(DensePlan::new(x, names, lay)?),
            Rows::ChannelRuns {
                ref runs,
                group,
                basis,
                basis_heads,
            } => Plan::Runs(RunsPlan::new(
                runs,
                (group, basis, basis_heads),
                (names, names.runs()),
                lay,
            )?),
            Rows::TokenRuns {
                ref runs,
                scales,
                basis,
                basis_heads,
            } => Plan::TokenRuns(TokenRunsPlan::new(
                runs,
                (scales, basis, basis_heads),
                (names, names.runs()),
                lay,
            )?),
            Rows::Centred {
                ref rows,
                mean,
                mean_heads,
            } => Plan::Centred(CentredPlan::new(
                Box::new(Plan::new(rows, names, lay)?),
                (mean, mean_heads),
                names,
                lay,
            )?),
        })
    }

    /// Head `h`'s rows `span` decoded to the head domain into `out` (span.len() x head_dim)
    /// by the layout's own decoder; false (nothing written) for layouts without one.
    fn decode(&self, isa: Isa, h: usize, span: Range<usize>, out: &mut [f32]) -> bool {
        match self {
            Plan::Mse(p) => p.decode(isa, h, span, out),
            Plan::TokenRuns(p) => p.decode(isa, h, span, out),
            Plan::Centred(p) => return p.decode(isa, h, span, out),
            _ => return false,
        }
        true
    }

    fn keys(&self) -> &dyn KeyRows {
        match self {
            Plan::Mse(p) => p,
            Plan::Tokens(p) => p,
            Plan::Channels(p) => p,
            Plan::Dense(p) => p,
            Plan::Runs(p) => p,
            Plan::TokenRuns(p) => p,
            Plan::Centred(p) => p,
        }
    }

    /// None for the key layouts (per-channel groups, token runs: rejected as values before
    /// planning).
    fn values(&self) -> Option<&dyn ValueRows> {
        match self {
            Plan::Mse(p) => Some(p),
            Plan::Tokens(p) => Some(p),
            Plan::Channels(_) | Plan::TokenRuns(_) => None,
            Plan::Dense(p) => Some(p),
            Plan::Runs(p) => Some(p),
            Plan::Centred(p) => p.inner().values().map(|_| p as &dyn ValueRows),
        }
    }
}

/// A non-finite logit: (query row of the head, token, value).
type Bad = (usize, usize, f32);

/// One chunk's softmax part: per query row the maximum logit, `sum_j e^(l_j - max)` and the
/// value accumulator; the weights `e^(l_j - max)` when probabilities are wanted.
struct Part {
    max: Vec<f32>,
    sums: Vec<f64>,
    acc: Vec<f64>,
    weights: Vec<f32>,
}

/// The scores, softmax part and value sums of tokens `span` of head `h`.
#[allow(clippy::too_many_arguments)]
fn chunk(
    isa: Isa,
    keys: &[&dyn KeyRows],
    qp: &[Vec<f32>],
    values: &dyn ValueRows,
    h: usize,
    span: Range<usize>,
    lay: &AttentionShape,
    want_probs: bool,
) -> std::result::Result<Part, Bad> {
    let (rows, n) = (lay.rows, span.len());
    let mut s = vec![0.0f32; rows * n];
    for (k, q) in keys.iter().zip(qp) {
        k.add_scores(isa, q, h, span.clone(), &mut s);
    }
    let mut max = vec![0.0f32; rows];
    let mut sums = vec![0.0f64; rows];
    for (r, sr) in s.chunks_exact_mut(n).enumerate() {
        max[r] = match ops::scale_max(isa, sr, lay.scale) {
            Some(m) => m,
            None => {
                let j = sr.iter().position(|v| !v.is_finite()).unwrap_or(0);
                return Err((r, span.start + j, sr[j]));
            }
        };
        sums[r] = ops::exp_sum(isa, sr, max[r]);
    }
    let mut acc = vec![0.0f64; rows * values.acc_dim()];
    values.accumulate(isa, &s, h, span, &mut acc);
    Ok(Part {
        max,
        sums,
        acc,
        weights: if want_probs { s } else { Vec::new() },
    })
}

/// Head `h`'s (out, lse, probs) from its chunks in token order, merged by log-sum-exp;
/// `shift` (rows) is the logit term the scores left out (`KeyRows::lse_shift`), added to the
/// log-sum-exp as `scale * shift`.
fn merge(
    isa: Isa,
    values: &dyn ValueRows,
    (h, parts, shift): (usize, &[&Part], &[f64]),
    lay: &AttentionShape,
    want_probs: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (rows, t, w) = (lay.rows, lay.tokens, values.acc_dim());
    let mut sums = vec![0.0f64; rows];
    let mut acc = vec![0.0f64; rows * w];
    let mut lse = vec![0.0f32; rows];
    // factors[c * rows + r] = e^(m_(c,r) - m_r): 1 exactly for the chunk holding the maximum.
    let mut factors = vec![0.0f64; parts.len() * rows];
    for r in 0..rows {
        let m = parts
            .iter()
            .map(|p| p.max[r])
            .fold(f32::NEG_INFINITY, f32::max);
        for (c, p) in parts.iter().enumerate() {
            let f = (f64::from(p.max[r]) - f64::from(m)).exp();
            factors[c * rows + r] = f;
            sums[r] += f * p.sums[r];
            let (dst, src) = (&mut acc[r * w..(r + 1) * w], &p.acc[r * w..(r + 1) * w]);
            dst.iter_mut().zip(src).for_each(|(a, &v)| *a += f * v);
        }
        lse[r] = (f64::from(m) + sums[r].ln() + f64::from(lay.scale) * shift[r]) as f32;
    }
    let mut out = vec![0.0f32; rows * lay.head_dim];
    values.finish(isa, h, &mut acc, &sums, &mut out);
    let mut probs = Vec::new();
    if want_probs {
        probs.resize(rows * t, 0.0);
        let mut j0 = 0;
        for (c, p) in parts.iter().enumerate() {
            let n = p.weights.len() / rows;
            for r in 0..rows {
                let f = factors[c * rows + r];
                let dst = &mut probs[r * t + j0..r * t + j0 + n];
                for (o, &v) in dst.iter_mut().zip(&p.weights[r * n..(r + 1) * n]) {
                    *o = (f64::from(v) * f / sums[r]) as f32;
                }
            }
            j0 += n;
        }
    }
    (out, lse, probs)
}

/// heads x rows: the logit terms the key layouts left out of the scores (`KeyRows::lse_shift`),
/// summed in term order in float64; an error naming the first query row whose term (or its
/// scaled value) is not finite.
fn lse_shifts(
    isa: Isa,
    terms: &[&dyn KeyRows],
    q: &[f32],
    lay: &AttentionShape,
) -> Result<Vec<f64>> {
    let (rows, d) = (lay.rows, lay.head_dim);
    let mut shifts = vec![0.0f64; lay.heads * rows];
    for (h, sh) in shifts.chunks_exact_mut(rows).enumerate() {
        let qh = &q[h * rows * d..(h + 1) * rows * d];
        for k in terms {
            if let Some(c) = k.lse_shift(isa, qh, h, lay) {
                sh.iter_mut().zip(&c).for_each(|(s, &v)| *s += f64::from(v));
            }
        }
        for (r, &v) in sh.iter().enumerate() {
            if !(v * f64::from(lay.scale)).is_finite() || (v as f32).is_infinite() {
                return Err(KvqError::NonFinite {
                    arg: "logits",
                    row: h * rows + r,
                    col: 0,
                    value: v as f32,
                });
            }
        }
    }
    Ok(shifts)
}

/// The error for value rows of a key layout (`class`: per-channel uniform groups, token runs).
fn key_only_values(class: &str) -> KvqError {
    KvqError::InvalidDimension {
        arg: "values",
        expected: format!("value rows ({class} are a key layout)"),
        actual: 0,
    }
}

/// Errors for a head_dim below 2, no tokens or rows, a token room below the tokens, a
/// non-finite or non-positive scale.
fn check_shape(lay: &AttentionShape) -> Result<()> {
    check_head_dim("head_dim", lay.head_dim)?;
    check_row_len("tokens", lay.tokens)?;
    check_row_len("rows", lay.rows)?;
    if lay.stride < lay.tokens {
        return Err(KvqError::InvalidDimension {
            arg: "stride",
            expected: format!("token room per head >= the {} tokens", lay.tokens),
            actual: lay.stride as i64,
        });
    }
    if !(lay.scale.is_finite() && lay.scale > 0.0) {
        return Err(KvqError::InvalidValue {
            arg: "scale",
            expected: "a finite positive logit scale",
            value: f64::from(lay.scale),
        });
    }
    Ok(())
}

/// The checks [`decode_attention`] makes of its query rows and layout, the token counts aside:
/// for a call over full-precision tokens alone (no coded ones).
pub fn check_queries(q: &[f32], layout: &AttentionShape) -> Result<()> {
    check_shape(&layout.compact(1))?;
    let qlen = reader::mul(
        "q",
        reader::mul("q", layout.heads, layout.rows)?,
        layout.head_dim,
    )?;
    check_len("q", q.len(), qlen, "heads x rows x head_dim")?;
    check_finite("q", q, layout.head_dim)
}

/// Decode attention for `layout.rows` query rows per KV head over `layout.tokens` coded keys and
/// values: `out = softmax(scale * (q . k_hat_j + side_j)) @ v_hat`, computed from the codes.
///
/// `q` is heads x rows x head_dim float32 (the query rows of a GQA group of one KV head stacked:
/// no key is copied per query head). Keys may be any [`CodedRows`] (with an optional HeadQ
/// side code); values any but the key layouts [`CodedRows::UniformChannels`] and
/// [`CodedRows::TokenRuns`].
///
/// Errors: head_dim < 2, no tokens, rows == 0, a non-finite or non-positive scale, a buffer
/// whose length does not match the layout (naming it, e.g. `keys.codes`), invalid stored
/// scalars, bad bits or group, a bad HeadQ basis, runs out of order or beyond head_dim, a
/// basis or mean of the wrong size or not finite, non-finite queries or logits (a key mean's
/// `scale * q . mu` included), values whose weighted sums overflow float32
/// ([`KvqError::NormOverflow`] naming the query row).
///
/// Runs on the active instruction-set path ([`simd::active`]); every path returns the same
/// bits.
pub fn decode_attention(
    q: &[f32],
    layout: &AttentionShape,
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
    layout: &AttentionShape,
    keys: &CodedRows,
    side: Option<&SideRows>,
    values: &CodedRows,
    want_probs: bool,
) -> Result<Attention> {
    let isa = isa.checked()?;
    let lay = *layout;
    check_shape(&lay)?;
    let qlen = reader::mul("q", reader::mul("q", lay.heads, lay.rows)?, lay.head_dim)?;
    check_len("q", q.len(), qlen, "heads x rows x head_dim")?;
    check_finite("q", q, lay.head_dim)?;
    if let Some(class) = values.key_only() {
        return Err(key_only_values(class));
    }
    let kplan = Plan::new(keys, &KEY_NAMES, &lay)?;
    let vplan = Plan::new(values, &VALUE_NAMES, &lay)?;
    let splan = side.map(|s| SidePlan::new(s, &lay, isa)).transpose()?;
    let mut terms: Vec<&dyn KeyRows> = vec![kplan.keys()];
    if let Some(sp) = &splan {
        terms.push(sp);
    }
    let vrows = vplan
        .values()
        .ok_or_else(|| key_only_values(values.class()))?;
    let (rows, d, t) = (lay.rows, lay.head_dim, lay.tokens);
    // Multiply-adds of the scores and the read-out: small calls stay on the calling thread.
    let work = (lay.heads * rows).saturating_mul(t.saturating_mul(2 * d));
    // The query rows' preparation and the merge are a few rows per head: on the calling thread
    // (a fork-join costs more than they do); the chunks are the parallel work.
    let qp: Vec<Vec<Vec<f32>>> = (0..lay.heads)
        .map(|h| {
            let qh = &q[h * rows * d..(h + 1) * rows * d];
            terms.iter().map(|k| k.queries(isa, qh, h, &lay)).collect()
        })
        .collect();
    let shifts = lse_shifts(isa, &terms, q, &lay)?;
    let step = terms.iter().map(|k| k.token_step()).max().unwrap_or(1);
    let len = CHUNK.div_ceil(step) * step;
    let chunks = t.div_ceil(len);
    let parts: Vec<std::result::Result<Part, Bad>> =
        par::map_range(lay.heads * chunks, work, par::par_min_attend(), |i| {
            let (h, c) = (i / chunks, i % chunks);
            let span = c * len..((c + 1) * len).min(t);
            chunk(isa, &terms, &qp[h], vrows, h, span, &lay, want_probs)
        });
    let mut heads = Vec::with_capacity(lay.heads);
    for (h, ps) in parts.chunks(chunks).enumerate() {
        // The first non-finite logit of the head, by query row then token (as one pass would).
        if let Some((r, j, value)) = ps
            .iter()
            .filter_map(|p| p.as_ref().err())
            .min_by_key(|b| (b.0, b.1))
        {
            return Err(KvqError::NonFinite {
                arg: "logits",
                row: h * rows + r,
                col: *j,
                value: *value,
            });
        }
        heads.push(
            ps.iter()
                .filter_map(|p| p.as_ref().ok())
                .collect::<Vec<_>>(),
        );
    }
    let merged: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..lay.heads)
        .map(|h| {
            let shift = &shifts[h * rows..(h + 1) * rows];
            merge(isa, vrows, (h, &heads[h], shift), &lay, want_probs)
        })
        .collect();
    let mut res = Attention {
        out: Vec::with_capacity(qlen),
        lse: Vec::with_capacity(lay.heads * rows),
        probs: Vec::new(),
    };
    for (o, l, p) in merged {
        res.out.extend_from_slice(&o);
        res.lse.extend_from_slice(&l);
        res.probs.extend_from_slice(&p);
    }
    // Finite logits and values can still overflow the float32 value sums (values near 3.4e38
    // summed over a block): an error naming the query row, never an infinite output.
    if let Some(i) = res.out.iter().position(|v| !v.is_finite()) {
        return Err(KvqError::NormOverflow {
            arg: "values",
            row: i / d,
        });
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::mse::MseQuantizer;
    use crate::kernels::pack::{pack, packed_len};
    use crate::kernels::uniform::UniformQuantizer;
    use crate::rng::gaussians;
    use crate::scalars::FloatView;

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
            let lay = AttentionShape::new(1, rows, t, d, 1.0 / (d as f32).sqrt());
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
            let lay = AttentionShape::new(1, rows, t, d, 1.0 / (d as f32).sqrt());
            let got = decode_attention(&q, &lay, &keys, None, &values, false).unwrap();
            let want = reference(&q, &kdec, &vq.decode(&vc).unwrap(), rows, t, d);
            close(&got.out, &want, 1e-5);
        }
    }

    #[test]
    fn chunks_merged_by_log_sum_exp_match_the_decoded_reference() {
        // Tokens spanning several chunks (the last one ragged), KIVI groups that do not divide
        // a chunk, one scale large enough that the chunk maxima differ a lot.
        let (d, t, rows) = (16, 3 * CHUNK + 45, 2);
        let x = gaussians(8, 9, 2 * t * d);
        let q: Vec<f32> = gaussians(9, 9, rows * d).iter().map(|v| v * 3.0).collect();
        let quant = MseQuantizer::new(d, 4, Some(5)).unwrap();
        let cd = quant.code_dim();
        let vc = quant.encode(&x[t * d..]).unwrap();
        let vp = pack(&vc.codes, cd, 4).unwrap();
        let mut kt = vec![0.0f32; t * d];
        for j in 0..t {
            for c in 0..d {
                kt[c * t + j] = x[j * d + c];
            }
        }
        let kq = UniformQuantizer::new(t, 7, 4).unwrap();
        let kc = kq.encode(&kt).unwrap();
        let kdec_t = kq.decode(&kc).unwrap();
        let mut kdec = vec![0.0f32; t * d];
        for j in 0..t {
            for c in 0..d {
                kdec[j * d + c] = kdec_t[c * t + j];
            }
        }
        let kp = pack(&kc.codes, t, 4).unwrap();
        let keys = CodedRows::UniformChannels {
            codes: &kp,
            scales: kc.scales.view(),
            zeros: kc.zeros.view(),
            bits: 4,
            group: 7,
        };
        let values = CodedRows::Mse {
            codes: &vp,
            norms: vc.norms.view(),
            bits: 4,
            seed: Some(5),
            qjl: None,
        };
        let lay = AttentionShape::new(1, rows, t, d, 1.0 / (d as f32).sqrt());
        let got = decode_attention(&q, &lay, &keys, None, &values, true).unwrap();
        let want = reference(&q, &kdec, &quant.decode(&vc).unwrap(), rows, t, d);
        close(&got.out, &want, 1e-5);
        for r in 0..rows {
            let p = &got.probs[r * t..(r + 1) * t];
            let total: f64 = p.iter().map(|&v| f64::from(v)).sum();
            assert!((total - 1.0).abs() < 1e-5, "{total}");
            // lse = log sum_j exp(logit_j): p_j = exp(logit_j - lse).
            let s: f64 = (0..d)
                .map(|c| f64::from(q[r * d + c]) * f64::from(kdec[c]))
                .sum::<f64>()
                / (d as f64).sqrt();
            let want_p0 = (s - f64::from(got.lse[r])).exp();
            assert!((f64::from(p[0]) - want_p0).abs() < 1e-5 * (1.0 + want_p0));
        }
    }

    /// Values near the float32 limit whose weighted float32 sums overflow give an error naming
    /// the query row, not an infinite output.
    #[test]
    fn overflowing_value_sums_are_an_error() {
        let (d, t, rows) = (8usize, 64usize, 1usize);
        let lay = AttentionShape::new(1, rows, t, d, 0.125);
        let q = vec![0.0f32; rows * d];
        let keys = vec![0.5f32; t * d];
        let huge = vec![3.0e38f32; t * d];
        let small = vec![1.0f32; t * d];
        let run = |v: &[f32]| {
            decode_attention(
                &q,
                &lay,
                &CodedRows::Dense(&keys),
                None,
                &CodedRows::Dense(v),
                false,
            )
        };
        assert!(run(&small).is_ok());
        match run(&huge) {
            Err(KvqError::NormOverflow {
                arg: "values",
                row: 0,
            }) => {}
            other => panic!("expected an overflow error, got {other:?}"),
        }
    }

    #[test]
    fn bad_sizes_name_the_argument() {
        let lay = AttentionShape::new(1, 1, 2, 4, 0.5);
        let q = [0.0f32; 4];
        let n = [0u16; 2];
        let keys = CodedRows::Mse {
            codes: &[0u8; 3],
            norms: ScalarView::Float(FloatView::F16(&n)),
            bits: 4,
            seed: None,
            qjl: None,
        };
        let values = CodedRows::Dense(&[0.0; 8]);
        let err = decode_attention(&q, &lay, &keys, None, &values, false).unwrap_err();
        assert!(err.to_string().starts_with("keys.codes"), "{err}");
        let lay0 = lay.compact(0);
        assert!(decode_attention(&q, &lay0, &keys, None, &values, false)
            .unwrap_err()
            .to_string()
            .starts_with("tokens"));
        let short = AttentionShape { stride: 1, ..lay };
        assert!(decode_attention(&q, &short, &keys, None, &values, false)
            .unwrap_err()
            .to_string()
            .starts_with("stride"));
    }

    /// Each of `blocks` blocks of `used` entries of `x` placed `room` entries apart, the room
    /// filled with `fill` (what a layer store's buffers hold past each head's tokens).
    fn spread<T: Copy>(x: &[T], blocks: usize, room: usize, fill: T) -> Vec<T> {
        let used = x.len() / blocks;
        let mut out = vec![fill; blocks * room];
        for (o, b) in out.chunks_exact_mut(room).zip(x.chunks_exact(used)) {
            o[..used].copy_from_slice(b);
        }
        out
    }

    /// Rows read `stride` tokens apart give the bits of the compact rows for every row layout;
    /// the room past each head's tokens (filled with NaN scalars and 0xFF codes) is neither
    /// read nor checked.
    #[test]
    fn rows_with_room_per_head_equal_compact_rows() {
        let (heads, rows, d, t, room, g) = (2usize, 3usize, 64usize, 45usize, 61usize, 16usize);
        let q = gaussians(20, 1, heads * rows * d);
        let bytes = |seed: u64, n: usize| -> Vec<u8> {
            (gaussians(seed, 2, n).iter())
                .map(|v| (v.to_bits() >> 9) as u8)
                .collect()
        };
        let positive = |seed: u64, n: usize| -> Vec<f32> {
            gaussians(seed, 3, n)
                .iter()
                .map(|v| 0.5 + v.abs())
                .collect()
        };
        let (rb3, rb1) = (packed_len(d, 3), packed_len(d, 1));
        let (kc, vc, qs) = (
            bytes(1, heads * t * rb3),
            bytes(2, heads * t * rb3),
            bytes(3, heads * t * rb1),
        );
        let norms: Vec<u16> = positive(4, heads * t)
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect();
        let (qn, dense) = (positive(5, heads * t), gaussians(6, 4, heads * t * d));
        // KIVI keys per channel; values in groups of coordinates.
        let (rbt, rbr) = (packed_len(t, 4), packed_len(room, 4));
        let (gt, gr) = (t.div_ceil(g), room.div_ceil(g));
        let cc = bytes(7, heads * d * rbt);
        let (cs, cz) = (positive(8, heads * d * gt), gaussians(9, 5, heads * d * gt));
        let (us, uz) = (
            positive(10, heads * t * (d / g)),
            gaussians(11, 6, heads * t * (d / g)),
        );
        let (sc, ss) = (bytes(12, heads * t * 2), positive(13, heads * t));
        let basis = gaussians(14, 7, d * 4);
        let nan16 = half::f16::NAN.to_bits();
        let wide = |x: &[u8], per: usize| spread(x, heads, room * per, 0xFF);
        let wide_f = |x: &[f32], per: usize| spread(x, heads, room * per, f32::NAN);
        let (kcw, vcw, qsw) = (wide(&kc, rb3), wide(&vc, rb3), wide(&qs, rb1));
        let normsw = spread(&norms, heads, room, nan16);
        let (qnw, densew) = (wide_f(&qn, 1), wide_f(&dense, d));
        let ccw = spread(&cc, heads * d, rbr, 0xFF);
        let (csw, czw) = (
            spread(&cs, heads * d, gr, f32::NAN),
            spread(&cz, heads * d, gr, f32::NAN),
        );
        let (usw, uzw) = (wide_f(&us, d / g), wide_f(&uz, d / g));
        let (scw, ssw) = (wide(&sc, 2), wide_f(&ss, 1));
        let (u2, rb2) = (&kc[..heads * t * packed_len(d, 2)], packed_len(d, 2));
        let u2w = wide(u2, rb2);
        let lay = AttentionShape::new(heads, rows, t, d, 0.125);
        let strided = AttentionShape {
            stride: room,
            ..lay
        };
        // Every row layout as (keys, values), over the compact arrays or their spread copies.
        type Mse<'a> = (&'a [u8], &'a [u8], &'a [u16], &'a [u8], &'a [f32]);
        type Groups<'a> = (&'a [u8], &'a [f32], &'a [f32]);
        fn mse<'a>(
            codes: &'a [u8],
            norms: &'a [u16],
            signs: &'a [u8],
            qn: &'a [f32],
        ) -> CodedRows<'a> {
            CodedRows::Mse {
                codes,
                norms: ScalarView::Float(FloatView::F16(norms)),
                bits: 3,
                seed: Some(2),
                qjl: Some(QjlRows {
                    signs,
                    norms: ScalarView::Float(FloatView::F32(qn)),
                    seed: 9,
                }),
            }
        }
        fn layouts<'a>(
            (kc, vc, norms, qs, qn): Mse<'a>,
            (cc, cs, cz): Groups<'a>,
            (u2, us, uz): Groups<'a>,
            (dense, g): (&'a [f32], usize),
        ) -> [(CodedRows<'a>, CodedRows<'a>); 3] {
            [
                // MSE keys and values with a QJL residual.
                (mse(kc, norms, qs, qn), mse(vc, norms, qs, qn)),
                // KIVI keys per channel, values in groups of coordinates (no rotation).
                (
                    CodedRows::UniformChannels {
                        codes: cc,
                        scales: ScalarView::Float(FloatView::F32(cs)),
                        zeros: ScalarView::Float(FloatView::F32(cz)),
                        bits: 4,
                        group: g,
                    },
                    CodedRows::UniformTokens {
                        codes: u2,
                        scales: ScalarView::Float(FloatView::F32(us)),
                        zeros: ScalarView::Float(FloatView::F32(uz)),
                        bits: 2,
                        group: g,
                        seed: None,
                    },
                ),
                (CodedRows::Dense(dense), CodedRows::Dense(dense)),
            ]
        }
        let compact = layouts(
            (&kc, &vc, &norms, &qs, &qn),
            (&cc, &cs, &cz),
            (u2, &us, &uz),
            (&dense, g),
        );
        let spread_rows = layouts(
            (&kcw, &vcw, &normsw, &qsw, &qnw),
            (&ccw, &csw, &czw),
            (&u2w, &usw, &uzw),
            (&densew, g),
        );
        // HeadQ's side code with every layout.
        let side = |codes, scales| SideRows {
            codes,
            scales: ScalarView::Float(FloatView::F32(scales)),
            basis: &basis,
            basis_heads: 1,
            rank: 4,
            bits: 4,
            sign: 1.0,
        };
        let (s0, s1) = (side(&sc, &ss), side(&scw, &ssw));
        for ((k0, v0), (k1, v1)) in compact.iter().zip(&spread_rows) {
            let want = decode_attention(&q, &lay, k0, Some(&s0), v0, true).unwrap();
            let got = decode_attention(&q, &strided, k1, Some(&s1), v1, true).unwrap();
            assert_eq!(got, want);
        }
    }
}
