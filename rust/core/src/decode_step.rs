//! A decode step over a [`LayerStore`]: attention of a few query rows over the coded tokens
//! (the fused kernel of [`crate::kernels::attention`], reading the store's parts) and over a
//! few full-precision tokens (attention sinks and the residual window), merged by
//! log-sum-exp: `out = e^(lse_c - lse) out_c + e^(lse_w - lse) out_w`,
//! `lse = logaddexp(lse_c, lse_w)`.
//!
//! Which parts the kernel reads as which rows is declared once per layer ([`RowSpec`], the
//! part indices of a [`crate::kernels::attention::CodedRows`] variant): a new row kind is one
//! more variant here and its match arm in `RowSpec::rows`. The rows of the `matched` scheme
//! borrow more than the reads ([`CodedRows::ChannelRuns`] a slice of runs,
//! [`CodedRows::Centred`] its inner rows), so a step builds them in stages that each outlive
//! the next: reads, then runs (`RowSpec::runs`), then the base rows, then the mean around
//! them (`RowSpec::wrap`).

use std::borrow::Cow;

use rayon::prelude::*;

use crate::error::{KvqError, Result};
use crate::format::Dtype;
use crate::kernels::attention::{
    decode_attention, Attention, AttentionShape, ChannelRun, CodedRows, QjlRows, SideRows,
};
use crate::par;
use crate::scalars::{LogView, ScalarView};
use crate::simd::{self, ops};
use crate::store::{to_f32, LayerStore};

/// The parts of a store that make one side's rows (indices into the store's parts).
#[derive(Debug, Clone, PartialEq)]
pub enum RowSpec {
    /// [`CodedRows::Mse`], optionally with the QJL sketch `(signs, norms, seed)`; with `log`
    /// `(exponent part, group)` the norms part holds 8-bit log codes (docs/kernels.md
    /// section 13).
    Mse {
        codes: usize,
        norms: usize,
        bits: u32,
        seed: Option<u64>,
        qjl: Option<(usize, usize, u64)>,
        log: Option<(usize, usize)>,
    },
    /// [`CodedRows::UniformTokens`].
    UniformTokens {
        codes: usize,
        scales: usize,
        zeros: usize,
        bits: u32,
        group: usize,
        seed: Option<u64>,
    },
    /// [`CodedRows::UniformChannels`].
    UniformChannels {
        codes: usize,
        scales: usize,
        zeros: usize,
        bits: u32,
        group: usize,
    },
    /// [`CodedRows::Dense`]: a float part (any float dtype, read as float32).
    Dense { values: usize },
    /// [`CodedRows::ChannelRuns`]: runs of basis columns coded per channel, and the basis
    /// (basis_heads x head_dim x head_dim float32).
    ChannelRuns {
        runs: Vec<RunSpec>,
        group: usize,
        basis: Vec<f32>,
        basis_heads: usize,
    },
    /// [`CodedRows::Centred`]: other rows (not themselves centred) around a per-head mean
    /// (mean_heads x head_dim float32).
    Centred {
        rows: Box<RowSpec>,
        mean: Vec<f32>,
        mean_heads: usize,
    },
}

/// The parts of one [`ChannelRun`] (its codes, scales and zero points), its bits and columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunSpec {
    pub codes: usize,
    pub scales: usize,
    pub zeros: usize,
    pub bits: u32,
    pub start: usize,
    pub stop: usize,
}

/// HeadQ's side code: the store's parts plus the basis (as [`SideRows`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SideSpec {
    pub codes: usize,
    pub scales: usize,
    pub basis: Vec<f32>,
    pub basis_heads: usize,
    pub rank: usize,
    pub bits: u32,
    pub sign: f32,
}

/// A part's whole buffer (every head's rows `room` tokens apart), as read by the kernel:
/// borrowed from the store (a copy only for float16 / bfloat16 values read as float32, or
/// scalars at an address not aligned to their size).
enum Read<'a> {
    Bytes(&'a [u8]),
    F16(Cow<'a, [u16]>),
    F32(Cow<'a, [f32]>),
}

impl Read<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Read::Bytes(b) => b,
            _ => &[],
        }
    }
    fn scalars(&self) -> ScalarView<'_> {
        match self {
            Read::F16(v) => ScalarView::F16(v),
            Read::F32(v) => ScalarView::F32(v),
            Read::Bytes(_) => ScalarView::F32(&[]),
        }
    }
    fn floats(&self) -> &[f32] {
        match self {
            Read::F32(v) => v,
            _ => &[],
        }
    }
}

/// Numbers every bit pattern of which is a value: bytes can be read as them in place.
trait Plain: Copy {
    fn from_le(b: &[u8]) -> Self;
}

impl Plain for u16 {
    fn from_le(b: &[u8]) -> Self {
        u16::from_le_bytes([b[0], b[1]])
    }
}

impl Plain for f32 {
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// Little-endian `bytes` as `T` values: borrowed when aligned (the store's allocations are),
/// else copied.
fn plain<T: Plain>(bytes: &[u8]) -> Cow<'_, [T]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: every bit pattern of a `Plain` type is a valid value, and `align_to` returns
        // only the aligned middle; it is used only when nothing is left over on either side.
        let (pre, mid, post) = unsafe { bytes.align_to::<T>() };
        if pre.is_empty() && post.is_empty() {
            return Cow::Borrowed(mid);
        }
    }
    let size = std::mem::size_of::<T>();
    Cow::Owned(bytes.chunks_exact(size).map(T::from_le).collect())
}

fn read(store: &LayerStore, i: usize, kind: char) -> Result<Read<'_>> {
    let bytes = store.buffer(i);
    let dtype = store.dtype(i);
    let bad = |what: &str| KvqError::ShapeMismatch {
        arg: "store",
        expected: format!(
            "part {} as {what}",
            store.specs().nth(i).map_or("?", |s| &s.name)
        ),
        actual: format!("{dtype:?}"),
    };
    Ok(match (kind, dtype) {
        ('b', Dtype::U8) => Read::Bytes(bytes),
        ('s', Dtype::F16) => Read::F16(plain(bytes)),
        ('s', Dtype::F32) | ('f', Dtype::F32) => Read::F32(plain(bytes)),
        ('f', _) => Read::F32(Cow::Owned(
            to_f32(dtype, bytes).ok_or_else(|| bad("float values"))?,
        )),
        ('b', _) => return Err(bad("uint8 codes")),
        _ => return Err(bad("float16 or float32 stored scalars")),
    })
}

/// The reads of one side (in the order [`RowSpec::rows`] takes them).
fn reads<'a>(store: &'a LayerStore, spec: &RowSpec) -> Result<Vec<Read<'a>>> {
    spec.parts()
        .into_iter()
        .map(|(i, k)| read(store, i, k))
        .collect()
}

impl RowSpec {
    /// The parts it reads, in order, each with how: `b` packed bytes, `s` stored scalars,
    /// `f` float values.
    fn parts(&self) -> Vec<(usize, char)> {
        match *self {
            RowSpec::ChannelRuns { ref runs, .. } => runs
                .iter()
                .flat_map(|r| [(r.codes, 'b'), (r.scales, 's'), (r.zeros, 's')])
                .collect(),
            RowSpec::Centred { ref rows, .. } => rows.parts(),
            RowSpec::Mse {
                codes,
                norms,
                qjl,
                log,
                ..
            } => {
                let mut v = vec![(codes, 'b'), (norms, if log.is_some() { 'b' } else { 's' })];
                if let Some((s, n, _)) = qjl {
                    v.extend([(s, 'b'), (n, 's')]);
                }
                // The exponents last, so that the sketch's reads keep their places.
                v.extend(log.map(|(e, _)| (e, 'b')));
                v
            }
            RowSpec::UniformTokens {
                codes,
                scales,
                zeros,
                ..
            }
            | RowSpec::UniformChannels {
                codes,
                scales,
                zeros,
                ..
            } => vec![(codes, 'b'), (scales, 's'), (zeros, 's')],
            RowSpec::Dense { values } => vec![(values, 'f')],
        }
    }

    /// Largest part index it reads.
    fn max_index(&self) -> usize {
        self.parts().iter().map(|p| p.0).max().unwrap_or(0)
    }

    /// The runs of [`RowSpec::ChannelRuns`] (of the inner rows of [`RowSpec::Centred`]) over
    /// its reads; empty for other rows.
    fn runs<'a>(&self, r: &'a [Read<'a>]) -> Vec<ChannelRun<'a>> {
        match self {
            RowSpec::ChannelRuns { runs, .. } => (runs.iter().zip(r.chunks_exact(3)))
                .map(|(run, p)| ChannelRun {
                    codes: p[0].bytes(),
                    scales: p[1].scalars(),
                    zeros: p[2].scalars(),
                    bits: run.bits,
                    start: run.start,
                    stop: run.stop,
                })
                .collect(),
            RowSpec::Centred { rows, .. } => rows.runs(r),
            _ => Vec::new(),
        }
    }

    /// `base` (the rows of [`RowSpec::rows`]) around the mean of [`RowSpec::Centred`], or
    /// `base` itself.
    fn wrap<'a>(&'a self, base: &'a CodedRows<'a>) -> CodedRows<'a> {
        match self {
            RowSpec::Centred {
                mean, mean_heads, ..
            } => CodedRows::Centred {
                rows: base,
                mean,
                mean_heads: *mean_heads,
            },
            _ => *base,
        }
    }

    /// The rows without the mean of [`RowSpec::Centred`] (see [`RowSpec::wrap`]); `runs` are
    /// those of [`RowSpec::runs`].
    fn rows<'a>(&'a self, r: &'a [Read<'a>], runs: &'a [ChannelRun<'a>]) -> CodedRows<'a> {
        match *self {
            RowSpec::ChannelRuns {
                group,
                ref basis,
                basis_heads,
                ..
            } => CodedRows::ChannelRuns {
                runs,
                group,
                basis,
                basis_heads,
            },
            RowSpec::Centred { ref rows, .. } => rows.rows(r, runs),
            RowSpec::Mse {
                bits,
                seed,
                qjl,
                log,
                ..
            } => CodedRows::Mse {
                codes: r[0].bytes(),
                norms: match log {
                    None => r[1].scalars(),
                    Some((_, group)) => ScalarView::Log(LogView {
                        codes: r[1].bytes(),
                        exps: r[r.len() - 1].bytes(),
                        group,
                        row: 0,
                    }),
                },
                bits,
                seed,
                qjl: qjl.map(|(_, _, s)| QjlRows {
                    signs: r[2].bytes(),
                    norms: r[3].scalars(),
                    seed: s,
                }),
            },
            RowSpec::UniformTokens {
                bits, group, seed, ..
            } => CodedRows::UniformTokens {
                codes: r[0].bytes(),
                scales: r[1].scalars(),
                zeros: r[2].scalars(),
                bits,
                group,
                seed,
            },
            RowSpec::UniformChannels { bits, group, .. } => CodedRows::UniformChannels {
                codes: r[0].bytes(),
                scales: r[1].scalars(),
                zeros: r[2].scalars(),
                bits,
                group,
            },
            RowSpec::Dense { .. } => CodedRows::Dense(r[0].floats()),
        }
    }
}

/// Full-precision tokens of every KV head read in place from a buffer with room for `room`
/// tokens per head (heads x room x head_dim float32): head `h` holds tokens `start .. start +
/// len` of its row. A cache's window buffer is read this way without a copy per step.
#[derive(Debug, Clone, Copy)]
pub struct FpTokens<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    /// Token room per head.
    pub room: usize,
    /// First token read in each head's row, and how many.
    pub start: usize,
    pub len: usize,
}

impl<'a> FpTokens<'a> {
    /// No tokens.
    pub const NONE: FpTokens<'static> = FpTokens {
        keys: &[],
        values: &[],
        room: 0,
        start: 0,
        len: 0,
    };

    /// Every token of contiguous heads x `len` x head_dim keys and values.
    pub fn joined(keys: &'a [f32], values: &'a [f32], len: usize) -> Self {
        Self {
            keys,
            values,
            room: len,
            start: 0,
            len,
        }
    }

    /// Head `h`'s keys and values (len x d each).
    fn head(&self, h: usize, d: usize) -> (&'a [f32], &'a [f32]) {
        let at = (h * self.room + self.start) * d;
        (
            &self.keys[at..at + self.len * d],
            &self.values[at..at + self.len * d],
        )
    }

    /// Errors unless both buffers hold `heads` rows of `room` tokens and the span fits.
    fn check(&self, name: &'static str, heads: usize, d: usize) -> Result<()> {
        let size = heads.checked_mul(self.room).and_then(|x| x.checked_mul(d));
        let fits = self
            .start
            .checked_add(self.len)
            .is_some_and(|end| end <= self.room);
        if !fits || size != Some(self.keys.len()) || size != Some(self.values.len()) {
            return Err(KvqError::ShapeMismatch {
                arg: name,
                expected: format!(
                    "{heads} heads x room {} x head_dim {d} keys and values, tokens {}..{} of each head",
                    self.room,
                    self.start,
                    self.start.saturating_add(self.len)
                ),
                actual: format!("{} keys, {} values", self.keys.len(), self.values.len()),
            });
        }
        Ok(())
    }
}

/// What a layer's decode step reads besides its store.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    /// heads x rows x head_dim float32 query rows (a GQA group's query heads times the new
    /// tokens, stacked per KV head: row `r` is query token `r % tokens`).
    pub q: &'a [f32],
    /// KV heads (batch x kv_heads), query rows per head, head_dim, logit scale.
    pub layout: AttentionShape,
    /// Query tokens per row group (`rows` is a multiple).
    pub tokens: usize,
    /// The full-precision tokens, read in this order: the attention sinks, then the window.
    pub sinks: FpTokens<'a>,
    pub window: FpTokens<'a>,
    /// Optional additive mask of the full-precision tokens (sinks, then window), batch x
    /// tokens x (sinks + window) (0 or -inf, or any finite bias); head `h` reads batch
    /// `h / (heads / batch)`.
    pub mask: Option<&'a [f32]>,
    /// Batch rows (divides `heads`).
    pub batch: usize,
}

fn arg(arg: &'static str, expected: String, actual: usize) -> KvqError {
    KvqError::ShapeMismatch {
        arg,
        expected,
        actual: actual.to_string(),
    }
}

/// Attention of `step.q` over the store's coded tokens (keys `keys` with the optional HeadQ
/// `side`, values `values`) and the full-precision tokens of `step`, merged by log-sum-exp.
/// Returns out (heads x rows x head_dim) and lse (heads x rows) of the whole softmax.
///
/// Full-precision tokens summed per block of [`WINDOW_BLOCK`] in float32 lanes before the sum is
/// carried into float64, as the fused kernel sums coded values: a float32 sum of 32 terms
/// `p_j v_j` errs by at most about `32 * 2^-24` of `sum_j |p_j v_j|`.
const WINDOW_BLOCK: usize = 32;

/// `acc += sum_j p_j v_j` over the sinks' rows then the window's (`values`: two slices of rows
/// of head_dim = `acc.len()`), in blocks of [`WINDOW_BLOCK`] tokens of the joined sequence (a
/// block may span both: the bits do not depend on where the sinks end); `part` is float32
/// scratch of head_dim.
fn window_sums(isa: simd::Isa, p: &[f32], values: [&[f32]; 2], part: &mut [f32], acc: &mut [f64]) {
    let d = acc.len();
    let ns = values[0].len() / d;
    for a in (0..p.len()).step_by(WINDOW_BLOCK) {
        let b = (a + WINDOW_BLOCK).min(p.len());
        part.fill(0.0);
        if a < ns {
            let e = b.min(ns);
            ops::axpy_rows_f32(isa, part, &p[a..e], &values[0][a * d..e * d], d);
        }
        if b > ns {
            let s = a.max(ns);
            ops::axpy_rows_f32(
                isa,
                part,
                &p[s..b],
                &values[1][(s - ns) * d..(b - ns) * d],
                d,
            );
        }
        acc.iter_mut()
            .zip(part.iter())
            .for_each(|(x, &y)| *x += f64::from(y));
    }
}

/// Errors: what [`decode_attention`] raises (the store must hold at least one token), a part
/// index outside the store, full-precision buffers or a mask of other sizes, non-finite
/// full-precision logits.
pub fn attend(
    store: &LayerStore,
    keys: &RowSpec,
    side: Option<&SideSpec>,
    values: &RowSpec,
    step: &Step,
) -> Result<Attention> {
    let n = store.specs().count();
    let top = keys
        .max_index()
        .max(values.max_index())
        .max(side.map_or(0, |s| s.codes.max(s.scales)));
    if top >= n {
        return Err(arg("rows", format!("part indices below {n}"), top));
    }
    let lay = AttentionShape {
        tokens: store.tokens(),
        stride: store.room(),
        ..step.layout
    };
    let (heads, rows, d) = (lay.heads, lay.rows, lay.head_dim);
    step.sinks.check("sinks", heads, d)?;
    step.window.check("window", heads, d)?;
    let w = step.sinks.len + step.window.len;
    if step.tokens == 0 || rows % step.tokens != 0 || step.batch == 0 || heads % step.batch != 0 {
        return Err(arg(
            "tokens",
            format!("query tokens dividing {rows} rows, a batch dividing {heads} heads"),
            step.tokens,
        ));
    }
    if let Some(m) = step.mask {
        if m.len() != step.batch * step.tokens * w {
            return Err(arg(
                "mask",
                format!("batch x tokens x window = {}", step.batch * step.tokens * w),
                m.len(),
            ));
        }
    }
    for (spec, name) in [(keys, "keys"), (values, "values")] {
        if let RowSpec::Centred { rows, .. } = spec {
            if matches!(**rows, RowSpec::Centred { .. }) {
                return Err(KvqError::ShapeMismatch {
                    arg: name,
                    expected: "rows around one mean".into(),
                    actual: "centred rows in centred rows".into(),
                });
            }
        }
    }
    let (kr, vr) = (reads(store, keys)?, reads(store, values)?);
    let (kruns, vruns) = (keys.runs(&kr), values.runs(&vr));
    let (kbase, vbase) = (keys.rows(&kr, &kruns), values.rows(&vr, &vruns));
    let sr = match side {
        Some(s) => Some((read(store, s.codes, 'b')?, read(store, s.scales, 's')?)),
        None => None,
    };
    let side_rows = match (&sr, side) {
        (Some((c, sc)), Some(s)) => Some(SideRows {
            codes: c.bytes(),
            scales: sc.scalars(),
            basis: &s.basis,
            basis_heads: s.basis_heads,
            rank: s.rank,
            bits: s.bits,
            sign: s.sign,
        }),
        _ => None,
    };
    let mut coded = decode_attention(
        step.q,
        &lay,
        &keys.wrap(&kbase),
        side_rows.as_ref(),
        &values.wrap(&vbase),
        false,
    )?;
    if w == 0 {
        return Ok(coded);
    }
    let per_batch = heads / step.batch;
    let isa = simd::active();
    // Per head: the window's scores of every query row in float32 (`ops::dots_tokens`, the
    // fixed order of `reduce::dot`), the SIMD `exp` of the fused kernel with a float64 sum, the
    // float64 value sums, then the merge with the coded part.
    let window_head = |h: usize, out: &mut [f32], lse: &mut [f32]| -> Option<(usize, usize, f32)> {
        let ((sk, sv), (wk, wv)) = (step.sinks.head(h, d), step.window.head(h, d));
        let qh = &step.q[h * rows * d..(h + 1) * rows * d];
        let mut s = vec![0.0f32; rows * w];
        // Score columns: the sinks', then the window's (each row `w` apart).
        ops::dots_tokens(isa, qh, sk, d, &mut s, w);
        ops::dots_tokens(isa, qh, wk, d, &mut s[step.sinks.len..], w);
        let (mut acc, mut part) = (vec![0.0f64; d], vec![0.0f32; d]);
        for (r, sr) in s.chunks_exact_mut(w).enumerate() {
            let i = r % step.tokens;
            ops::scale(isa, sr, lay.scale);
            if let Some(m) = step.mask {
                let mr = &m[((h / per_batch) * step.tokens + i) * w..][..w];
                sr.iter_mut().zip(mr).for_each(|(v, &mv)| *v += mv);
            }
            if let Some(j) = sr.iter().position(|&v| v.is_nan() || v == f32::INFINITY) {
                return Some((r, j, sr[j]));
            }
            let m = sr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if m == f32::NEG_INFINITY {
                continue; // every full-precision token masked: the coded part alone
            }
            let sum = ops::exp_sum(isa, sr, m);
            acc.iter_mut().for_each(|a| *a = 0.0);
            window_sums(isa, sr, [sv, wv], &mut part, &mut acc);
            let lse_w = f64::from(m) + sum.ln();
            let lse_c = f64::from(lse[r]);
            let top = lse_c.max(lse_w);
            let total = top + ((lse_c - top).exp() + (lse_w - top).exp()).ln();
            let (fc, fw) = ((lse_c - total).exp(), (lse_w - total).exp() / sum);
            for (o, &a) in out[r * d..(r + 1) * d].iter_mut().zip(&acc) {
                *o = (f64::from(*o) * fc + a * fw) as f32;
            }
            lse[r] = total as f32;
        }
        None
    };
    // Heads are independent; small windows stay on the calling thread (see par::PAR_MIN_ATTEND).
    let (out, lse) = (&mut coded.out, &mut coded.lse);
    let bad: Vec<Option<(usize, usize, f32)>> = if heads * rows * w * 2 * d < par::PAR_MIN_ATTEND {
        (out.chunks_mut(rows * d).zip(lse.chunks_mut(rows)))
            .enumerate()
            .map(|(h, (o, l))| window_head(h, o, l))
            .collect()
    } else {
        (out.par_chunks_mut(rows * d).zip(lse.par_chunks_mut(rows)))
            .enumerate()
            .map(|(h, (o, l))| window_head(h, o, l))
            .collect()
    };
    if let Some((h, (r, j, value))) = bad.iter().enumerate().find_map(|(h, b)| b.map(|b| (h, b))) {
        return Err(KvqError::NonFinite {
            arg: "logits",
            row: h * rows + r,
            col: j,
            value,
        });
    }
    Ok(coded)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::mse::MseQuantizer;
    use crate::kernels::pack::pack;
    use crate::rng::gaussians;
    use crate::store::{ChunkPart, PartSpec};

    fn spec(name: &str, dtype: Dtype, heads: usize, inner: Vec<usize>) -> PartSpec {
        PartSpec {
            name: name.into(),
            dtype,
            widen: dtype == Dtype::F16,
            outer: vec![1, heads],
            inner,
            num: 1,
            den: 1,
        }
    }

    /// Bytes read as numbers: in place when aligned, copied (the same values) when not.
    #[test]
    fn plain_reads_borrow_aligned_bytes_and_copy_the_rest() {
        let words: Vec<u32> = (0..9).map(|i| 0x3C00_4000 + i).collect();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let want16 = |b: &[u8]| -> Vec<u16> {
            b.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        // `bytes` is a fresh allocation (aligned); one byte in, it is not.
        let aligned = plain::<u16>(&bytes[..16]);
        assert!(matches!(aligned, Cow::Borrowed(_)));
        assert_eq!(aligned.as_ref(), want16(&bytes[..16]).as_slice());
        let shifted = plain::<u16>(&bytes[1..17]);
        assert!(matches!(shifted, Cow::Owned(_)));
        assert_eq!(shifted.as_ref(), want16(&bytes[1..17]).as_slice());
        let f = plain::<f32>(&bytes[2..34]);
        assert!(matches!(f, Cow::Owned(_)));
        let want: Vec<f32> = (bytes[2..34].chunks_exact(4))
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(f.as_ref(), want.as_slice());
    }

    /// The step over a store filled by appends equals the kernel over the joined codes merged
    /// by log-sum-exp with a float64 softmax over the full-precision tokens.
    #[test]
    fn a_step_equals_the_kernel_merged_with_the_window() {
        let (heads, d, rows, w) = (2usize, 16usize, 2usize, 5usize);
        let quant = MseQuantizer::new(d, 4, Some(3)).unwrap();
        let cd = quant.code_dim();
        let pb = crate::kernels::pack::packed_len(cd, 4);
        let mut store = LayerStore::new(vec![
            spec("k.codes", Dtype::U8, heads, vec![pb]),
            spec("k.norms", Dtype::F16, heads, vec![]),
            spec("v.values", Dtype::F32, heads, vec![d]),
        ])
        .unwrap();
        // Keys appended in chunks of 3 tokens; the reference keeps the joined codes.
        let (chunks, per) = (7usize, 3usize);
        let t = chunks * per;
        let x = gaussians(1, 2, heads * t * d);
        let v = gaussians(2, 2, heads * t * d);
        let mut all_codes = vec![Vec::new(); heads];
        let mut all_norms: Vec<Vec<u16>> = vec![Vec::new(); heads];
        for c in 0..chunks {
            let mut codes = Vec::new();
            let mut norms = Vec::new();
            let mut vals = Vec::new();
            for h in 0..heads {
                let rows_x = &x[(h * t + c * per) * d..(h * t + (c + 1) * per) * d];
                let e = quant.encode(rows_x).unwrap();
                let p = pack(&e.codes, cd, 4).unwrap();
                let crate::scalars::ScalarPlane::F16(n) = e.norms else {
                    panic!("float16 norms expected")
                };
                all_codes[h].extend_from_slice(&p);
                all_norms[h].extend_from_slice(&n);
                codes.extend_from_slice(&p);
                norms.extend(n.iter().flat_map(|b| b.to_le_bytes()));
                vals.extend(
                    v[(h * t + c * per) * d..(h * t + (c + 1) * per) * d]
                        .iter()
                        .flat_map(|f| f.to_le_bytes()),
                );
            }
            let shapes = [
                vec![1, heads, per, pb],
                vec![1, heads, per],
                vec![1, heads, per, d],
            ];
            let parts = [
                ChunkPart {
                    dtype: Dtype::U8,
                    shape: &shapes[0],
                    bytes: &codes,
                },
                ChunkPart {
                    dtype: Dtype::F16,
                    shape: &shapes[1],
                    bytes: &norms,
                },
                ChunkPart {
                    dtype: Dtype::F32,
                    shape: &shapes[2],
                    bytes: &vals,
                },
            ];
            store.append(&parts, per).unwrap();
        }
        // The kernel reads the store's buffers in place, heads `room` tokens apart.
        assert!(store.room() > t);
        let keys = RowSpec::Mse {
            codes: 0,
            norms: 1,
            bits: 4,
            seed: Some(3),
            qjl: None,
            log: None,
        };
        let values = RowSpec::Dense { values: 2 };
        let inputs = Inputs::new(3, heads, rows, d, w);
        let step = inputs.step(heads, rows, d, 0.25);
        let (q, lay, fk) = (&inputs.q, step.layout, &inputs.fk);
        let got = attend(&store, &keys, None, &values, &step).unwrap();
        let flat_codes: Vec<u8> = all_codes.concat();
        let flat_norms: Vec<u16> = all_norms.concat();
        let coded = decode_attention(
            q,
            &lay.compact(t),
            &CodedRows::Mse {
                codes: &flat_codes,
                norms: ScalarView::F16(&flat_norms),
                bits: 4,
                seed: Some(3),
                qjl: None,
            },
            None,
            &CodedRows::Dense(&v),
            false,
        )
        .unwrap();
        assert_merged(&got, &coded, &step);
        // Bad sizes name the argument.
        let short = Step {
            window: FpTokens {
                keys: &fk[1..],
                ..step.window
            },
            ..step
        };
        let err = attend(&store, &keys, None, &values, &short)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("window"), "{err}");
        let past = Step {
            sinks: FpTokens {
                start: 1,
                ..step.window
            },
            ..step
        };
        let err = attend(&store, &keys, None, &values, &past)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("sinks"), "{err}");
        // Sinks and window read in place from buffers with spare room: the bits of the joined
        // tokens, whichever token the window starts at.
        for (ns, lo, spare) in [(1usize, 0usize, 3usize), (2, 5, 0), (3, 2, 9)] {
            let (ks, vs) = split_rows(fk, &inputs.fv, (heads, w, d), ns, (lo, spare));
            let split = Step {
                sinks: FpTokens::joined(&ks.0, &vs.0, ns),
                window: FpTokens {
                    keys: &ks.1,
                    values: &vs.1,
                    room: lo + (w - ns) + spare,
                    start: lo,
                    len: w - ns,
                },
                ..step
            };
            let again = attend(&store, &keys, None, &values, &split).unwrap();
            assert_eq!((&again.out, &again.lse), (&got.out, &got.lse), "{ns} {lo}");
        }
        let far = RowSpec::Dense { values: 9 };
        assert!(attend(&store, &keys, None, &far, &step).is_err());
    }

    /// Heads x w x d keys and values split into the first `ns` tokens of each head (joined) and
    /// the rest at token `lo` of rows with `lo + (w - ns) + spare` tokens of room (NaN
    /// elsewhere: a read outside the span shows).
    #[allow(clippy::type_complexity)]
    fn split_rows(
        k: &[f32],
        v: &[f32],
        (heads, w, d): (usize, usize, usize),
        ns: usize,
        (lo, spare): (usize, usize),
    ) -> ((Vec<f32>, Vec<f32>), (Vec<f32>, Vec<f32>)) {
        let room = lo + (w - ns) + spare;
        let split = |x: &[f32]| {
            let mut sinks = Vec::new();
            let mut rest = vec![f32::NAN; heads * room * d];
            for h in 0..heads {
                let row = &x[h * w * d..(h + 1) * w * d];
                sinks.extend_from_slice(&row[..ns * d]);
                rest[(h * room + lo) * d..(h * room + lo + w - ns) * d]
                    .copy_from_slice(&row[ns * d..]);
            }
            (sinks, rest)
        };
        let ((sk, wk), (sv, wv)) = (split(k), split(v));
        ((sk, wk), (sv, wv))
    }

    /// Queries, full-precision tokens and a mask (query token 0 does not see the newest
    /// window token) of one batch row, drawn from `seed`.
    struct Inputs {
        q: Vec<f32>,
        fk: Vec<f32>,
        fv: Vec<f32>,
        mask: Vec<f32>,
        window: usize,
    }

    impl Inputs {
        fn new(seed: u64, heads: usize, rows: usize, d: usize, w: usize) -> Self {
            let mut mask = vec![0.0f32; rows * w];
            mask[w - 1] = f32::NEG_INFINITY;
            Self {
                q: gaussians(seed, 2, heads * rows * d),
                fk: gaussians(seed + 1, 2, heads * w * d),
                fv: gaussians(seed + 2, 2, heads * w * d),
                mask,
                window: w,
            }
        }

        /// The step of every row as one query token's.
        fn step(&self, heads: usize, rows: usize, d: usize, scale: f32) -> Step<'_> {
            Step {
                q: &self.q,
                layout: AttentionShape::new(heads, rows, 0, d, scale),
                tokens: rows,
                sinks: FpTokens::NONE,
                window: FpTokens::joined(&self.fk, &self.fv, self.window),
                mask: Some(&self.mask),
                batch: 1,
            }
        }
    }

    /// `got` equals `coded` merged by log-sum-exp with a float64 softmax over the
    /// full-precision tokens of `step` (one batch row), to 1e-5.
    fn assert_merged(got: &Attention, coded: &Attention, step: &Step) {
        let AttentionShape {
            heads,
            rows,
            head_dim: d,
            scale,
            ..
        } = step.layout;
        let (w, fk, fv) = (step.window.len, step.window.keys, step.window.values);
        for h in 0..heads {
            for r in 0..rows {
                let qr = &step.q[(h * rows + r) * d..][..d];
                let s: Vec<f64> = (0..w)
                    .map(|j| {
                        let dot: f64 = (0..d)
                            .map(|c| f64::from(qr[c]) * f64::from(fk[(h * w + j) * d + c]))
                            .sum();
                        dot * f64::from(scale)
                            + step
                                .mask
                                .map_or(0.0, |m| f64::from(m[(r % step.tokens) * w + j]))
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|v| (v - m).exp()).sum();
                let lse_w = m + sum.ln();
                let lse_c = f64::from(coded.lse[h * rows + r]);
                let lse = lse_c.max(lse_w) + (-(lse_c - lse_w).abs()).exp().ln_1p();
                assert!((f64::from(got.lse[h * rows + r]) - lse).abs() < 1e-5);
                for c in 0..d {
                    let ow: f64 = (0..w)
                        .map(|j| (s[j] - m).exp() / sum * f64::from(fv[(h * w + j) * d + c]))
                        .sum();
                    let want = (lse_c - lse).exp() * f64::from(coded.out[(h * rows + r) * d + c])
                        + (lse_w - lse).exp() * ow;
                    let g = f64::from(got.out[(h * rows + r) * d + c]);
                    assert!(
                        (g - want).abs() < 1e-5 * (1.0 + want.abs()),
                        "{g} vs {want}"
                    );
                }
            }
        }
    }

    /// The matched rows (runs of basis columns around a mean; columns 6, 7 of width 0): keys
    /// around one shared mean, values the same runs in another basis around a mean per head,
    /// read from a store filled by appends, equal the kernel over the joined buffers merged
    /// with the window; a mean around a mean is refused.
    #[test]
    fn matched_rows_step_equals_the_kernel_merged_with_the_window() {
        let (heads, d, rows, w, group) = (2usize, 8usize, 3usize, 4usize, 8usize);
        let cols = [(3u32, 0usize, 3usize), (2, 3, 6)];
        let mut specs = Vec::new();
        for (bits, lo, hi) in cols {
            for (name, dtype, num, den) in [
                ("codes", Dtype::U8, bits as usize, 8),
                ("scales", Dtype::F32, 1, group),
                ("zeros", Dtype::F32, 1, group),
            ] {
                specs.push(PartSpec {
                    name: format!("{name}{bits}"),
                    dtype,
                    widen: false,
                    outer: vec![1, heads, hi - lo],
                    inner: vec![],
                    num,
                    den,
                });
            }
        }
        let mut store = LayerStore::new(specs.clone()).unwrap();
        // Random codes and nonnegative scalars in chunks of two groups; `joined` keeps each part's outer
        // rows joined along tokens (the kernel's layout of the whole).
        let (chunks, per) = (3usize, 2 * group);
        store.reserve(chunks * per + 5); // rows `room` tokens apart, past the tokens held
        let mut joined: Vec<Vec<Vec<u8>>> = specs
            .iter()
            .map(|p| vec![Vec::new(); p.outer.iter().product()])
            .collect();
        for c in 0..chunks {
            let mut bytes = Vec::new();
            for (i, p) in specs.iter().enumerate() {
                let n = p.units(per);
                let outer: usize = p.outer.iter().product();
                let seed = (10 * c + i) as u64;
                let b: Vec<u8> = if p.dtype == Dtype::U8 {
                    gaussians(seed, 7, outer * n)
                        .iter()
                        .map(|g| (g.to_bits() >> 11) as u8)
                        .collect()
                } else {
                    gaussians(seed, 8, outer * n)
                        .iter()
                        .flat_map(|g| (0.2 * g.abs()).to_le_bytes())
                        .collect()
                };
                let size = b.len() / outer;
                for (o, row) in joined[i].iter_mut().enumerate() {
                    row.extend_from_slice(&b[o * size..(o + 1) * size]);
                }
                bytes.push((vec![1, heads, p.outer[2], n], b));
            }
            let parts: Vec<ChunkPart> = (specs.iter().zip(&bytes))
                .map(|(p, (shape, b))| ChunkPart {
                    dtype: p.dtype,
                    shape,
                    bytes: b,
                })
                .collect();
            store.append(&parts, per).unwrap();
        }
        let t = chunks * per;
        assert!(store.room() > t);
        let run_specs: Vec<RunSpec> = (cols.iter().enumerate())
            .map(|(i, &(bits, start, stop))| RunSpec {
                codes: 3 * i,
                scales: 3 * i + 1,
                zeros: 3 * i + 2,
                bits,
                start,
                stop,
            })
            .collect();
        let (kbasis, vbasis) = (gaussians(20, 2, d * d), gaussians(21, 2, heads * d * d));
        let (kmean, vmean) = (gaussians(22, 2, d), gaussians(23, 2, heads * d));
        let centred = |basis: &[f32], basis_heads, mean: &[f32], mean_heads| RowSpec::Centred {
            rows: Box::new(RowSpec::ChannelRuns {
                runs: run_specs.clone(),
                group,
                basis: basis.to_vec(),
                basis_heads,
            }),
            mean: mean.to_vec(),
            mean_heads,
        };
        let keys = centred(&kbasis, 1, &kmean, 1);
        let values = centred(&vbasis, heads, &vmean, heads);
        let inputs = Inputs::new(24, heads, rows, d, w);
        let step = inputs.step(heads, rows, d, 0.3);
        let (q, lay) = (&inputs.q, step.layout);
        let got = attend(&store, &keys, None, &values, &step).unwrap();
        let flat: Vec<Vec<u8>> = joined.iter().map(|p| p.concat()).collect();
        let floats: Vec<Vec<f32>> = (flat.iter())
            .map(|b| {
                b.chunks_exact(4)
                    .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                    .collect()
            })
            .collect();
        let runs: Vec<ChannelRun> = (run_specs.iter())
            .map(|r| ChannelRun {
                codes: &flat[r.codes],
                scales: ScalarView::F32(&floats[r.scales]),
                zeros: ScalarView::F32(&floats[r.zeros]),
                bits: r.bits,
                start: r.start,
                stop: r.stop,
            })
            .collect();
        let base = |basis, basis_heads| CodedRows::ChannelRuns {
            runs: &runs,
            group,
            basis,
            basis_heads,
        };
        let (kb, vb) = (base(&kbasis, 1), base(&vbasis, heads));
        let coded = decode_attention(
            q,
            &lay.compact(t),
            &CodedRows::Centred {
                rows: &kb,
                mean: &kmean,
                mean_heads: 1,
            },
            None,
            &CodedRows::Centred {
                rows: &vb,
                mean: &vmean,
                mean_heads: heads,
            },
            false,
        )
        .unwrap();
        assert_merged(&got, &coded, &step);
        let twice = RowSpec::Centred {
            rows: Box::new(keys.clone()),
            mean: kmean.clone(),
            mean_heads: 1,
        };
        let err = attend(&store, &twice, None, &values, &step)
            .unwrap_err()
            .to_string();
        assert!(err.contains("one mean"), "{err}");
    }
}
