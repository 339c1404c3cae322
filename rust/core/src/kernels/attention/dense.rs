//! Full-precision rows (heads x stride x head_dim float32, the first tokens of each held): plain dot products for keys,
//! float32-lane weighted sums for values.

use std::ops::Range;

use super::super::{check_finite_from, check_len};
use super::reader::{mul, unrotate, Lanes, BLOCK};
use super::{AttentionShape, KeyRows, Names, ValueRows};
use crate::error::Result;
use crate::simd::{ops, Isa};

/// Validated dense rows.
pub(super) struct DensePlan<'a> {
    x: &'a [f32],
    /// Token room per head.
    stride: usize,
    head_dim: usize,
}

impl<'a> DensePlan<'a> {
    pub(super) fn new(x: &'a [f32], names: &Names, lay: &AttentionShape) -> Result<Self> {
        let d = lay.head_dim;
        let vectors = mul(names.dense, lay.heads, lay.stride)?;
        check_len(
            names.dense,
            x.len(),
            mul(names.dense, vectors, d)?,
            "heads x stride x head_dim values",
        )?;
        let plan = Self {
            x,
            stride: lay.stride,
            head_dim: d,
        };
        for h in 0..lay.heads {
            // Rows are named as counted over the held tokens of every head.
            check_finite_from(names.dense, plan.rows(h, 0..lay.tokens), d, h * lay.tokens)?;
        }
        Ok(plan)
    }

    /// Rows `span` of head `h`.
    fn rows(&self, h: usize, span: Range<usize>) -> &[f32] {
        let (t, d) = (self.stride, self.head_dim);
        &self.x[(h * t + span.start) * d..(h * t + span.end) * d]
    }
}

impl KeyRows for DensePlan<'_> {
    fn queries(&self, _isa: Isa, q: &[f32], _h: usize, _lay: &AttentionShape) -> Vec<f32> {
        q.to_vec()
    }

    fn add_scores(&self, isa: Isa, q: &[f32], h: usize, span: Range<usize>, s: &mut [f32]) {
        let n = span.len();
        let mut dots = vec![0.0f32; s.len() / n];
        for (j, k) in self.rows(h, span).chunks_exact(self.head_dim).enumerate() {
            ops::dots(isa, q, k, &mut dots);
            for (r, &v) in dots.iter().enumerate() {
                s[r * n + j] += v;
            }
        }
    }
}

impl ValueRows for DensePlan<'_> {
    fn acc_dim(&self) -> usize {
        self.head_dim
    }

    fn accumulate(&self, isa: Isa, p: &[f32], h: usize, span: Range<usize>, acc: &mut [f64]) {
        let (d, n) = (self.head_dim, span.len());
        let mut lanes = Lanes::new(p.len() / n, d);
        for (b, block) in self.rows(h, span).chunks(BLOCK * d).enumerate() {
            let w = |r: usize, k: usize| p[r * n + b * BLOCK + k];
            lanes.add_block(isa, block, w, acc, (d, 0));
        }
    }

    fn finish(&self, isa: Isa, _h: usize, acc: &mut [f64], sums: &[f64], out: &mut [f32]) {
        unrotate(isa, &None, (acc, self.head_dim, self.head_dim), sums, out);
    }
}
