//! A decode step over a [`LayerStore`]: attention of a few query rows over the coded tokens
//! (the fused kernel of [`crate::kernels::attention`], reading the store's parts) and over a
//! few full-precision tokens (attention sinks and the residual window), merged by
//! log-sum-exp: `out = e^(lse_c - lse) out_c + e^(lse_w - lse) out_w`,
//! `lse = logaddexp(lse_c, lse_w)`.
//!
//! Which parts the kernel reads as which rows is declared once per layer ([`RowSpec`], the
//! part indices of a [`crate::kernels::attention::CodedRows`] variant): a new row kind is one
//! more variant here and its match arm in [`RowSpec::rows`].

use std::borrow::Cow;

use rayon::prelude::*;

use crate::error::{KvqError, Result};
use crate::format::Dtype;
use crate::kernels::attention::{
    decode_attention, Attention, CodedRows, Layout, QjlRows, SideRows,
};
use crate::par;
use crate::scalars::ScalarView;
use crate::store::{to_f32, LayerStore};

/// The parts of a store that make one side's rows (indices into the store's parts).
#[derive(Debug, Clone, PartialEq)]
pub enum RowSpec {
    /// [`CodedRows::Mse`], optionally with the QJL sketch `(signs, norms, seed)`.
    Mse {
        codes: usize,
        norms: usize,
        bits: u32,
        seed: Option<u64>,
        qjl: Option<(usize, usize, u64)>,
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

/// A part's bytes for every head (contiguous), as read by the kernel.
enum Read<'a> {
    Bytes(Cow<'a, [u8]>),
    F16(Vec<u16>),
    F32(Vec<f32>),
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

fn read(store: &LayerStore, i: usize, kind: char) -> Result<Read<'_>> {
    let rows = store.specs().nth(i).map_or(0, |s| s.outer.iter().product());
    let bytes = store.rows(i, 0..rows);
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
        ('s', Dtype::F16) => Read::F16(
            bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect(),
        ),
        ('s', Dtype::F32) | ('f', _) => {
            Read::F32(to_f32(dtype, &bytes).ok_or_else(|| bad("float values"))?)
        }
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
            RowSpec::Mse {
                codes, norms, qjl, ..
            } => {
                let mut v = vec![(codes, 'b'), (norms, 's')];
                if let Some((s, n, _)) = qjl {
                    v.extend([(s, 'b'), (n, 's')]);
                }
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

    fn rows<'a>(&self, r: &'a [Read<'a>]) -> CodedRows<'a> {
        match *self {
            RowSpec::Mse {
                bits, seed, qjl, ..
            } => CodedRows::Mse {
                codes: r[0].bytes(),
                norms: r[1].scalars(),
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

/// What a layer's decode step reads besides its store.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    /// heads x rows x head_dim float32 query rows (a GQA group's query heads times the new
    /// tokens, stacked per KV head: row `r` is query token `r % tokens`).
    pub q: &'a [f32],
    /// KV heads (batch x kv_heads), query rows per head, head_dim, logit scale.
    pub layout: Layout,
    /// Query tokens per row group (`rows` is a multiple).
    pub tokens: usize,
    /// heads x window x head_dim full-precision keys and values (sinks, then window).
    pub fp_keys: &'a [f32],
    pub fp_values: &'a [f32],
    /// Full-precision tokens.
    pub window: usize,
    /// Optional additive mask of the full-precision tokens, batch x tokens x window (0 or
    /// -inf, or any finite bias); head `h` reads batch `h / (heads / batch)`.
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
    let lay = Layout {
        tokens: store.tokens(),
        ..step.layout
    };
    let (heads, rows, d, w) = (lay.heads, lay.rows, lay.head_dim, step.window);
    let fp_len = heads * w * d;
    if step.fp_keys.len() != fp_len || step.fp_values.len() != fp_len {
        return Err(arg(
            "fp_keys",
            format!("heads x window x head_dim = {fp_len} values (keys and values)"),
            step.fp_keys.len().max(step.fp_values.len()),
        ));
    }
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
    let (kr, vr) = (reads(store, keys)?, reads(store, values)?);
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
        &keys.rows(&kr),
        side_rows.as_ref(),
        &values.rows(&vr),
        false,
    )?;
    if w == 0 {
        return Ok(coded);
    }
    let per_batch = heads / step.batch;
    let window_head = |h: usize, out: &mut [f32], lse: &mut [f32]| -> Option<(usize, usize, f32)> {
        let kh = &step.fp_keys[h * w * d..(h + 1) * w * d];
        let vh = &step.fp_values[h * w * d..(h + 1) * w * d];
        let mut s = vec![0.0f64; w];
        let mut acc = vec![0.0f64; d];
        for r in 0..rows {
            let qr = &step.q[(h * rows + r) * d..(h * rows + r + 1) * d];
            let i = r % step.tokens;
            for (j, sj) in s.iter_mut().enumerate() {
                let dot: f64 = qr
                    .iter()
                    .zip(&kh[j * d..(j + 1) * d])
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
                let mut v = dot * f64::from(lay.scale);
                if let Some(m) = step.mask {
                    v += f64::from(m[((h / per_batch) * step.tokens + i) * w + j]);
                }
                if v.is_nan() || (v > 0.0 && (v as f32).is_infinite()) {
                    return Some((r, j, v as f32));
                }
                *sj = v;
            }
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                continue; // every full-precision token masked: the coded part alone
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            let mut sum = 0.0f64;
            for (j, &sj) in s.iter().enumerate() {
                let p = (sj - m).exp();
                sum += p;
                for (a, &v) in acc.iter_mut().zip(&vh[j * d..(j + 1) * d]) {
                    *a += p * f64::from(v);
                }
            }
            let lse_w = m + sum.ln();
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
        let keys = RowSpec::Mse {
            codes: 0,
            norms: 1,
            bits: 4,
            seed: Some(3),
            qjl: None,
        };
        let values = RowSpec::Dense { values: 2 };
        let q = gaussians(3, 2, heads * rows * d);
        let fk = gaussians(4, 2, heads * w * d);
        let fv = gaussians(5, 2, heads * w * d);
        let mut mask = vec![0.0f32; rows * w];
        mask[w - 1] = f32::NEG_INFINITY; // query token 0 does not see the newest window token
        let lay = Layout {
            heads,
            rows,
            tokens: 0,
            head_dim: d,
            scale: 0.25,
        };
        let step = Step {
            q: &q,
            layout: lay,
            tokens: rows,
            fp_keys: &fk,
            fp_values: &fv,
            window: w,
            mask: Some(&mask),
            batch: 1,
        };
        let got = attend(&store, &keys, None, &values, &step).unwrap();
        let flat_codes: Vec<u8> = all_codes.concat();
        let flat_norms: Vec<u16> = all_norms.concat();
        let coded = decode_attention(
            &q,
            &Layout { tokens: t, ..lay },
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
        for h in 0..heads {
            for r in 0..rows {
                let qr = &q[(h * rows + r) * d..][..d];
                let s: Vec<f64> = (0..w)
                    .map(|j| {
                        let dot: f64 = (0..d)
                            .map(|c| f64::from(qr[c]) * f64::from(fk[(h * w + j) * d + c]))
                            .sum();
                        dot * 0.25 + f64::from(mask[(r % rows) * w + j])
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
        // Bad sizes name the argument.
        let short = Step {
            fp_keys: &fk[1..],
            ..step
        };
        let err = attend(&store, &keys, None, &values, &short)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("fp_keys"), "{err}");
        let far = RowSpec::Dense { values: 9 };
        assert!(attend(&store, &keys, None, &far, &step).is_err());
    }
}
