//! Coded keys and values decoded to the head domain through the attention layouts' own readers,
//! for dense attention over many query rows at once (a prompt's prefill), where reading each
//! token once per query row would cost more than decoding it once.
//!
//! A layout with a decoder of its own (MSE rows with or without their QJL residual, per-token
//! runs in a basis, either alone or around a mean) decodes its rows directly; any other is read through its attention reader: a
//! key layout's scores of the unit query rows `e_i` are the coordinates `k_hat_j[i]` (plus the
//! term it leaves to the log-sum-exp, a mean's `e_i . mu`), and a value layout's read-out of
//! one-hot weights is `v_hat_j` (about head_dim times the multiply-adds of a decoder). The
//! decoded rows are those the fused kernel reads implicitly, up to float32 rounding.

use std::ops::Range;

use super::{
    check_shape, key_only_values, AttentionShape, CodedRows, KeyRows, Plan, ValueRows, CHUNK,
    KEY_NAMES, VALUE_NAMES,
};
use crate::error::Result;
use crate::simd::Isa;

/// Tokens per value read-out: its one-hot weights cost `VALUE_BLOCK` multiply-adds per decoded
/// coordinate.
const VALUE_BLOCK: usize = 16;

/// The `n x n` identity, row-major.
fn identity(n: usize) -> Vec<f32> {
    let mut eye = vec![0.0f32; n * n];
    eye.iter_mut().step_by(n + 1).for_each(|v| *v = 1.0);
    eye
}

/// Keys and values of `lay.heads` heads x `lay.tokens` tokens decoded to the head domain, each
/// heads x tokens x head_dim float32 (`lay.rows` is ignored).
///
/// Errors: as [`super::decode_attention`] for the layout and buffers (values of a key-only
/// layout, bad bits, buffers that do not match), and non-finite decoded rows.
pub fn reconstruct_with(
    isa: Isa,
    lay: &AttentionShape,
    keys: &CodedRows,
    values: &CodedRows,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let isa = isa.checked()?;
    let d = lay.head_dim;
    let klay = AttentionShape { rows: d, ..*lay };
    check_shape(&klay)?;
    if let Some(class) = values.key_only() {
        return Err(key_only_values(class));
    }
    let kplan = Plan::new(keys, &KEY_NAMES, &klay)?;
    let vlay = AttentionShape {
        rows: VALUE_BLOCK,
        ..klay
    };
    let vplan = Plan::new(values, &VALUE_NAMES, &vlay)?;
    let vrows = vplan
        .values()
        .ok_or_else(|| key_only_values(values.class()))?;
    let size = lay.heads * lay.tokens * d;
    let (mut k, mut v) = (vec![0.0f32; size], vec![0.0f32; size]);
    let per_head = lay.tokens * d;
    let all = 0..lay.tokens;
    for h in 0..lay.heads {
        let at = h * per_head..(h + 1) * per_head;
        if !kplan.decode(isa, h, all.clone(), &mut k[at.clone()]) {
            decode_keys(isa, kplan.keys(), h, &klay, &mut k[at.clone()]);
        }
        if !vplan.decode(isa, h, all.clone(), &mut v[at.clone()]) {
            decode_values(isa, vrows, h, &klay, &mut v[at]);
        }
    }
    super::check_finite("keys", &k, d)?;
    super::check_finite("values", &v, d)?;
    Ok((k, v))
}

/// Head `h`'s keys (tokens x d) as the scores of the unit query rows, in the driver's chunks.
fn decode_keys(isa: Isa, keys: &dyn KeyRows, h: usize, lay: &AttentionShape, out: &mut [f32]) {
    let (d, t) = (lay.head_dim, lay.tokens);
    let eye = identity(d);
    let qp = keys.queries(isa, &eye, h, lay);
    let shift = keys.lse_shift(isa, &eye, h, lay);
    let step = keys.token_step();
    let len = CHUNK.div_ceil(step) * step;
    let mut s = Vec::new();
    for c0 in (0..t).step_by(len) {
        let span: Range<usize> = c0..(c0 + len).min(t);
        let n = span.len();
        s.clear();
        s.resize(d * n, 0.0);
        keys.add_scores(isa, &qp, h, span, &mut s);
        for (j, row) in out[c0 * d..(c0 + n) * d].chunks_exact_mut(d).enumerate() {
            for (i, o) in row.iter_mut().enumerate() {
                *o = s[i * n + j] + shift.as_ref().map_or(0.0, |c| c[i]);
            }
        }
    }
}

/// Head `h`'s values (tokens x d) as read-outs of one-hot weights, `VALUE_BLOCK` tokens a call.
fn decode_values(
    isa: Isa,
    values: &dyn ValueRows,
    h: usize,
    lay: &AttentionShape,
    out: &mut [f32],
) {
    let (d, t, w) = (lay.head_dim, lay.tokens, values.acc_dim());
    let mut acc = Vec::new();
    for c0 in (0..t).step_by(VALUE_BLOCK) {
        let n = VALUE_BLOCK.min(t - c0);
        acc.clear();
        acc.resize(n * w, 0.0f64);
        values.accumulate(isa, &identity(n), h, c0..c0 + n, &mut acc);
        let ones = vec![1.0f64; n];
        values.finish(isa, h, &mut acc, &ones, &mut out[c0 * d..(c0 + n) * d]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::{decode_attention_with, QjlRows, TokenRunView};
    use crate::kernels::pack::packed_len;
    use crate::rng::gaussians;
    use crate::scalars::{FloatView, ScalarView};

    const D: usize = 64;

    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        gaussians(seed, 2, n)
            .iter()
            .map(|v| (v.to_bits() >> 9) as u8)
            .collect()
    }

    fn positive(seed: u64, n: usize) -> Vec<f32> {
        gaussians(seed, 3, n)
            .iter()
            .map(|v| 0.5 + v.abs())
            .collect()
    }

    /// Attention over the decoded rows (dense) equals attention over the codes, on every path.
    fn check(heads: usize, t: usize, keys: &CodedRows, values: &CodedRows) {
        let q = gaussians(40, 1, heads * 3 * D);
        let lay = AttentionShape::new(heads, 3, t, D, 0.125);
        // The output, and the log-sum-exp (it sees a key mean, which the softmax ignores).
        let fused =
            decode_attention_with(Isa::Scalar, &q, &lay, keys, None, values, false).unwrap();
        let want = [fused.out, fused.lse].concat();
        for isa in Isa::available() {
            let (k, v) = reconstruct_with(isa, &lay, keys, values).unwrap();
            assert_eq!(k.len(), heads * t * D);
            let (kd, vd) = (CodedRows::Dense(&k), CodedRows::Dense(&v));
            let dense = decode_attention_with(isa, &q, &lay, &kd, None, &vd, false).unwrap();
            let got = [dense.out, dense.lse].concat();
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                    "{isa:?}: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn decoded_mse_qjl_rows_and_a_mean_give_the_fused_attention() {
        let (heads, t) = (2, 37);
        let (rb, rs) = (packed_len(D, 3), packed_len(D, 1));
        let (kc, vc, signs) = (
            bytes(1, heads * t * rb),
            bytes(2, heads * t * rb),
            bytes(3, heads * t * rs),
        );
        let (norms, qn) = (positive(4, heads * t), positive(5, heads * t));
        let mse = |codes| CodedRows::Mse {
            codes,
            norms: ScalarView::Float(FloatView::F32(&norms)),
            bits: 3,
            seed: Some(2),
            qjl: Some(QjlRows {
                signs: &signs,
                norms: ScalarView::Float(FloatView::F32(&qn)),
                seed: 9,
            }),
        };
        check(heads, t, &mse(&kc), &mse(&vc));
        let mean = gaussians(6, 1, heads * D);
        let centred = |rows| CodedRows::Centred {
            rows: Box::new(rows),
            mean: &mean,
            mean_heads: heads,
        };
        check(heads, t, &centred(mse(&kc)), &centred(mse(&vc)));
    }

    #[test]
    fn decoded_token_runs_and_uniform_rows_give_the_fused_attention() {
        let (heads, t, g) = (2, 300, 32);
        let runs = [(5u32, 0usize, 6usize), (3, 6, 20), (2, 20, 64)];
        let packed: Vec<Vec<u8>> = (runs.iter().enumerate())
            .map(|(i, &(bits, a, b))| bytes(10 + i as u64, heads * t * packed_len(b - a, bits)))
            .collect();
        let scales = positive(20, heads * t);
        let basis = gaussians(21, 1, heads * D * D);
        let keys = CodedRows::TokenRuns {
            runs: (runs.iter().zip(&packed))
                .map(|(&(bits, start, stop), codes)| TokenRunView {
                    codes,
                    bits,
                    start,
                    stop,
                })
                .collect(),
            scales: ScalarView::Float(FloatView::F32(&scales)),
            basis: &basis,
            basis_heads: heads,
        };
        let (vs, vz) = (
            positive(22, heads * t * D / g),
            gaussians(23, 1, heads * t * D / g),
        );
        let vc = bytes(24, heads * t * packed_len(D, 4));
        let values = CodedRows::UniformTokens {
            codes: &vc,
            scales: ScalarView::Float(FloatView::F32(&vs)),
            zeros: ScalarView::Float(FloatView::F32(&vz)),
            bits: 4,
            group: g,
            seed: Some(3),
        };
        check(heads, t, &keys, &values);
        // Uniform rows as keys: read through their scores (no decoder of their own).
        check(heads, t, &values, &values);
    }

    #[test]
    fn key_layouts_as_values_are_refused() {
        let x = vec![0.0f32; 4 * D];
        let (k, c) = (CodedRows::Dense(&x), vec![0u8; 4 * D]);
        let s = [1.0f32; 4 * D];
        let channels = CodedRows::UniformChannels {
            codes: &c,
            scales: ScalarView::Float(FloatView::F32(&s)),
            zeros: ScalarView::Float(FloatView::F32(&s)),
            bits: 4,
            group: 4,
        };
        let lay = AttentionShape::new(1, 1, 4, D, 1.0);
        let err = reconstruct_with(Isa::Scalar, &lay, &k, &channels).unwrap_err();
        assert!(err.to_string().contains("values"), "{err}");
    }
}
