//! A decode step over a [`LayerStore`]: attention of a few query rows over the coded tokens
//! (the fused kernel of [`crate::kernels::attention`], reading the store's parts) and over a
//! few full-precision tokens (attention sinks and the residual window), merged by
//! log-sum-exp: `out = e^(lse_c - lse) out_c + e^(lse_w - lse) out_w`,
//! `lse = logaddexp(lse_c, lse_w)`.
//!
//! Which parts the kernel reads as which rows is declared once per layer ([`PartRows`]: the
//! row formats of [`crate::rows::Rows`] over part indices, bases and means held by value);
//! a step resolves the indices to the store's buffers (`Reader`, checking each part's dtype
//! against where it sits: bytes, stored scalars or float rows) and borrows them as the
//! kernel's [`crate::kernels::attention::CodedRows`] ([`Rows::view`]).

use std::borrow::Cow;

use rayon::prelude::*;

use crate::dtype::Dtype;
use crate::error::{KvqError, Result};
use crate::kernels::attention::{check_queries, decode_attention, Attention, AttentionShape};
use crate::par;
use crate::rows::{Field, Resolve, Rows, ScalarParts, Side};
use crate::scalars::ScalarRead;
use crate::simd::{self, ops};
use crate::store::{to_f32, LayerStore};

/// Stored scalars of a store: a part of float16 / float32 scalars, or log codes and their
/// exponent bytes (two uint8 parts), by index.
pub type PartScalars = ScalarParts<usize, usize>;

/// One side's rows over a store's parts (indices, see [`LayerStore::index`]): packed bytes
/// are uint8 parts, stored scalars float16 / float32 parts ([`PartScalars`]), float rows any
/// float part (read as float32); bases and means are held by value.
pub type PartRows = Rows<usize, PartScalars, usize, Vec<f32>>;

/// HeadQ's side code over a store's parts (as [`PartRows`]).
pub type PartSide = Side<usize, PartScalars, Vec<f32>>;

/// Resolves part indices to a store's buffers as the kernel reads them (every head's rows
/// `room` tokens apart): borrowed, or copied for float16 / bfloat16 values read as float32
/// and scalars at an address not aligned to their size. A part index outside the store, or a
/// part whose dtype does not fit where it sits, is an error naming the field.
struct Reader<'s> {
    store: &'s LayerStore,
}

impl<'s> Reader<'s> {
    /// Part `i`'s buffer and dtype.
    fn part(&self, i: usize, at: Field<'_>) -> Result<(&'s [u8], Dtype)> {
        let n = self.store.specs().count();
        if i >= n {
            return Err(arg("rows", format!("{at}: a part index below {n}"), i));
        }
        Ok((self.store.buffer(i), self.store.dtype(i)))
    }

    fn mismatch(&self, i: usize, at: Field<'_>, what: &str) -> KvqError {
        KvqError::ShapeMismatch {
            arg: "store",
            expected: format!(
                "{at}: part {:?} as {what}",
                self.store.specs().nth(i).map_or("?", |s| &s.name)
            ),
            actual: self.store.dtype(i).name().into(),
        }
    }
}

impl<'a, 's> Resolve<'a, usize, PartScalars, usize, Vec<f32>> for Reader<'s> {
    type Bytes = &'s [u8];
    type Scalars = ScalarParts<&'s [u8], ScalarRead<'s>>;
    type Floats = Cow<'s, [f32]>;
    type Table = &'a [f32];
    type Error = KvqError;

    fn bytes(&mut self, &i: &'a usize, at: Field<'_>) -> Result<&'s [u8]> {
        match self.part(i, at)? {
            (b, Dtype::U8) => Ok(b),
            _ => Err(self.mismatch(i, at, "uint8 bytes")),
        }
    }

    fn scalars(&mut self, part: &'a PartScalars, at: Field<'_>) -> Result<Self::Scalars> {
        Ok(match *part {
            ScalarParts::Plain(i) => {
                let (b, dtype) = self.part(i, at)?;
                let read = ScalarRead::from_le(b, dtype);
                ScalarParts::Plain(
                    read.ok_or_else(|| self.mismatch(i, at, "float16 or float32 stored scalars"))?,
                )
            }
            ScalarParts::Log { codes, exps, group } => ScalarParts::Log {
                codes: self.bytes(&codes, at)?,
                exps: self.bytes(&exps, at)?,
                group,
            },
        })
    }

    fn floats(&mut self, &i: &'a usize, at: Field<'_>) -> Result<Cow<'s, [f32]>> {
        Ok(match self.part(i, at)? {
            (b, Dtype::F32) => crate::scalars::plain(b),
            (b, dtype) => {
                Cow::Owned(to_f32(dtype, b).ok_or_else(|| self.mismatch(i, at, "float values"))?)
            }
        })
    }

    fn table(&mut self, table: &'a Vec<f32>, _: Field<'_>) -> Result<&'a [f32]> {
        Ok(table)
    }
}

/// Checks that `keys`, `side` and `values` name parts of `store` of the dtypes their places
/// take (as a step reads them), that the values are per-token rows and that no mean sits
/// inside another. What a layer declares once, before its steps.
pub fn check_rows(
    store: &LayerStore,
    keys: &PartRows,
    side: Option<&PartSide>,
    values: &PartRows,
) -> Result<()> {
    if let Some(what) = values.key_only() {
        return Err(KvqError::ShapeMismatch {
            arg: "values",
            expected: format!("value rows ({what} are a key layout)"),
            actual: values.class().into(),
        });
    }
    one_mean(keys, "keys")?;
    one_mean(values, "values")?;
    keys.map("keys", &mut Reader { store })?;
    values.map("values", &mut Reader { store })?;
    if let Some(s) = side {
        s.map(&mut Reader { store })?;
    }
    Ok(())
}

/// Errors when `rows` (side `name`) put a mean around rows around a mean.
fn one_mean(rows: &PartRows, name: &'static str) -> Result<()> {
    if let Rows::Centred { rows: inner, .. } = rows {
        if matches!(**inner, Rows::Centred { .. }) {
            return Err(KvqError::ShapeMismatch {
                arg: name,
                expected: "rows around one mean".into(),
                actual: "centred rows in centred rows".into(),
            });
        }
    }
    Ok(())
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

/// `acc[r] += sum_j p[r, j] v_j` for each query row `r` of `p` (rows x tokens, one row per
/// entry of `live`; a row not `live` is left out: weight 0, its sums unused) over the sinks'
/// rows then the window's (`values`: two slices of rows of head_dim, `acc`: rows x head_dim),
/// in blocks of [`WINDOW_BLOCK`] tokens of the joined sequence (a block may span both: the
/// bits do not depend on where the sinks end). Every query row at once (`ops::axpy_rows`
/// reads each value row once for a few query rows), each `(r, i)` summed in token order as
/// one row alone would be; `part` is float32 scratch of rows x head_dim, `wts` of the rows'
/// weights of a block.
fn window_sums(
    isa: simd::Isa,
    (p, live): (&[f32], &[bool]),
    values: [&[f32]; 2],
    (part, wts): (&mut [f32], &mut Vec<f32>),
    acc: &mut [f64],
) {
    let rows = live.len();
    let (w, d) = (p.len() / rows, acc.len() / rows);
    let ns = values[0].len() / d;
    for a in (0..w).step_by(WINDOW_BLOCK) {
        let b = (a + WINDOW_BLOCK).min(w);
        part.fill(0.0);
        for (lo, hi, rows_of, first) in
            [(a, b.min(ns), values[0], 0), (a.max(ns), b, values[1], ns)]
        {
            if lo >= hi {
                continue;
            }
            wts.clear();
            for (r, &on) in live.iter().enumerate() {
                if on {
                    wts.extend_from_slice(&p[r * w + lo..r * w + hi]);
                } else {
                    wts.resize(wts.len() + (hi - lo), 0.0);
                }
            }
            let mat = &rows_of[(lo - first) * d..(hi - first) * d];
            ops::axpy_rows(isa, (&mut *part, rows), wts, (1, d), mat, d);
        }
        acc.iter_mut()
            .zip(part.iter())
            .for_each(|(x, &y)| *x += f64::from(y));
    }
}

/// Errors unless the full-precision buffers, the query tokens, the batch and the mask fit
/// `step`'s layout.
fn check_step(step: &Step) -> Result<()> {
    let (heads, rows, d) = (step.layout.heads, step.layout.rows, step.layout.head_dim);
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
    Ok(())
}

/// Errors: what [`decode_attention`] raises (the store must hold at least one token), a part
/// index outside the store or a part whose dtype does not fit its place (as [`check_rows`]),
/// full-precision buffers or a mask of other sizes, non-finite full-precision logits.
pub fn attend(
    store: &LayerStore,
    keys: &PartRows,
    side: Option<&PartSide>,
    values: &PartRows,
    step: &Step,
) -> Result<Attention> {
    let lay = AttentionShape {
        tokens: store.tokens(),
        stride: store.room(),
        ..step.layout
    };
    check_step(step)?;
    one_mean(keys, "keys")?;
    one_mean(values, "values")?;
    let (kr, vr) = (
        keys.map("keys", &mut Reader { store })?,
        values.map("values", &mut Reader { store })?,
    );
    let sr = side.map(|s| s.map(&mut Reader { store })).transpose()?;
    let side_rows = sr.as_ref().map(Side::view);
    let coded = decode_attention(
        step.q,
        &lay,
        &kr.view(),
        side_rows.as_ref(),
        &vr.view(),
        false,
    )?;
    merge_full_precision(step, coded)
}

/// Attention of `step.q` over its full-precision tokens alone (the attention sinks, then the
/// window: a cache layer that has coded nothing yet), in the arithmetic of [`attend`]'s
/// full-precision part: the same bits as that part merged with a coded part of no weight. A
/// query row whose every token is masked gets zeros and a log-sum-exp of -inf.
///
/// Errors: head_dim < 2, no query rows, a non-finite or non-positive scale, query rows not
/// finite or of another size, no full-precision token, what [`attend`] raises for the
/// buffers, the mask and non-finite logits.
pub fn attend_full_precision(step: &Step) -> Result<Attention> {
    check_queries(step.q, &step.layout)?;
    check_step(step)?;
    if step.sinks.len + step.window.len == 0 {
        return Err(arg(
            "window",
            "at least one full-precision token (sinks + window)".into(),
            0,
        ));
    }
    let (heads, rows, d) = (step.layout.heads, step.layout.rows, step.layout.head_dim);
    let none = Attention {
        out: vec![0.0; heads * rows * d],
        lse: vec![f32::NEG_INFINITY; heads * rows],
        probs: Vec::new(),
    };
    merge_full_precision(step, none)
}

/// `coded` (a softmax part over coded tokens, or none: log-sum-exp -inf) merged by
/// log-sum-exp with the softmax part over `step`'s full-precision tokens (checked by
/// [`check_step`]).
fn merge_full_precision(step: &Step, mut coded: Attention) -> Result<Attention> {
    let lay = step.layout;
    let (heads, rows, d) = (lay.heads, lay.rows, lay.head_dim);
    let w = step.sinks.len + step.window.len;
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
        // Per row: logits, then the softmax weights in place (`live`: a row with a visible
        // full-precision token), then every live row's value sums at once, then the merge.
        let (mut live, mut ms, mut sums) =
            (vec![false; rows], vec![0.0f32; rows], vec![0.0f64; rows]);
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
            (live[r], ms[r], sums[r]) = (true, m, ops::exp_sum(isa, sr, m));
        }
        if !live.contains(&true) {
            return None;
        }
        let mut acc = vec![0.0f64; rows * d];
        let (mut part, mut wts) = (
            vec![0.0f32; rows * d],
            Vec::with_capacity(rows * WINDOW_BLOCK),
        );
        window_sums(isa, (&s, &live), [sv, wv], (&mut part, &mut wts), &mut acc);
        for r in (0..rows).filter(|&r| live[r]) {
            let (m, sum) = (ms[r], sums[r]);
            let lse_w = f64::from(m) + sum.ln();
            let lse_c = f64::from(lse[r]);
            let top = lse_c.max(lse_w);
            let total = top + ((lse_c - top).exp() + (lse_w - top).exp()).ln();
            let (fc, fw) = ((lse_c - total).exp(), (lse_w - total).exp() / sum);
            let ar = &acc[r * d..(r + 1) * d];
            for (o, &a) in out[r * d..(r + 1) * d].iter_mut().zip(ar) {
                *o = (f64::from(*o) * fc + a * fw) as f32;
            }
            lse[r] = total as f32;
        }
        None
    };
    // Heads are independent; small windows stay on the calling thread (see par::par_min_attend).
    let (out, lse) = (&mut coded.out, &mut coded.lse);
    let bad: Vec<Option<(usize, usize, f32)>> = if heads * rows * w * 2 * d < par::par_min_attend()
    {
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
    use crate::kernels::attention::{ChannelRun, CodedRows};
    use crate::kernels::mse::MseQuantizer;
    use crate::kernels::pack::pack;
    use crate::rng::gaussians;
    use crate::rows::Run;
    use crate::scalars::{plain, FloatView, ScalarView};
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
        let keys = Rows::Mse {
            codes: 0,
            norms: ScalarParts::Plain(1),
            bits: 4,
            seed: Some(3),
            qjl: None,
        };
        let values = Rows::Dense(2);
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
                norms: ScalarView::Float(FloatView::F16(&flat_norms)),
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
        let far = Rows::Dense(9);
        let err = attend(&store, &keys, None, &far, &step).unwrap_err();
        assert_eq!(
            err.to_string(),
            "rows: expected values.values: a part index below 3, got 9"
        );
        // A part whose dtype does not fit its place: float rows as codes, codes as scalars.
        let swapped = Rows::Mse {
            codes: 2,
            norms: ScalarParts::Plain(0),
            bits: 4,
            seed: Some(3),
            qjl: None,
        };
        let err = check_rows(&store, &swapped, None, &values).unwrap_err();
        assert_eq!(
            err.to_string(),
            "store: expected keys.codes: part \"v.values\" as uint8 bytes, got float32"
        );
        let bad_norms = Rows::Mse {
            codes: 0,
            norms: ScalarParts::Plain(0),
            bits: 4,
            seed: Some(3),
            qjl: None,
        };
        assert!(attend(&store, &bad_norms, None, &values, &step)
            .unwrap_err()
            .to_string()
            .contains("keys.norms: part \"k.codes\" as float16 or float32 stored scalars"));
        check_rows(&store, &keys, None, &values).unwrap();
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

    /// Full-precision tokens alone (no store) equal a float64 softmax over them; a row whose
    /// every token is masked gets zeros and -inf; no token is an error.
    #[test]
    fn full_precision_tokens_alone_equal_a_float64_softmax() {
        let (heads, rows, d, w) = (2usize, 3usize, 16usize, 6usize);
        let inputs = Inputs::new(31, heads, rows, d, w);
        let step = inputs.step(heads, rows, d, 0.3);
        let got = attend_full_precision(&step).unwrap();
        let none = Attention {
            out: vec![0.0; heads * rows * d],
            lse: vec![f32::NEG_INFINITY; heads * rows],
            probs: Vec::new(),
        };
        assert_merged(&got, &none, &step);
        let mut mask = inputs.mask.clone();
        mask[w..2 * w].fill(f32::NEG_INFINITY);
        let hidden = attend_full_precision(&Step {
            mask: Some(&mask),
            ..step
        })
        .unwrap();
        for h in 0..heads {
            assert_eq!(hidden.lse[h * rows + 1], f32::NEG_INFINITY);
            assert!(hidden.out[(h * rows + 1) * d..][..d]
                .iter()
                .all(|&o| o == 0.0));
            assert_eq!(hidden.lse[h * rows], got.lse[h * rows]);
        }
        let empty = Step {
            window: FpTokens::NONE,
            mask: None,
            ..step
        };
        let err = attend_full_precision(&empty).unwrap_err().to_string();
        assert!(err.contains("window"), "{err}");
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
        let run_specs: Vec<Run<usize, PartScalars>> = (cols.iter().enumerate())
            .map(|(i, &(bits, start, stop))| Run {
                codes: 3 * i,
                scales: ScalarParts::Plain(3 * i + 1),
                zeros: ScalarParts::Plain(3 * i + 2),
                bits,
                start,
                stop,
            })
            .collect();
        let (kbasis, vbasis) = (gaussians(20, 2, d * d), gaussians(21, 2, heads * d * d));
        let (kmean, vmean) = (gaussians(22, 2, d), gaussians(23, 2, heads * d));
        let centred = |basis: &[f32], basis_heads, mean: &[f32], mean_heads| Rows::Centred {
            rows: Box::new(Rows::ChannelRuns {
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
        let runs: Vec<ChannelRun> = (cols.iter().enumerate())
            .map(|(i, &(bits, start, stop))| ChannelRun {
                codes: &flat[3 * i],
                scales: ScalarView::Float(FloatView::F32(&floats[3 * i + 1])),
                zeros: ScalarView::Float(FloatView::F32(&floats[3 * i + 2])),
                bits,
                start,
                stop,
            })
            .collect();
        let base = |basis, basis_heads| CodedRows::ChannelRuns {
            runs: runs.clone(),
            group,
            basis,
            basis_heads,
        };
        let (kb, vb) = (base(&kbasis, 1), base(&vbasis, heads));
        let coded = decode_attention(
            q,
            &lay.compact(t),
            &CodedRows::Centred {
                rows: Box::new(kb),
                mean: &kmean,
                mean_heads: 1,
            },
            None,
            &CodedRows::Centred {
                rows: Box::new(vb),
                mean: &vmean,
                mean_heads: heads,
            },
            false,
        )
        .unwrap();
        assert_merged(&got, &coded, &step);
        let twice = Rows::Centred {
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
