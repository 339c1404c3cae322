//! HeadQ's side code of the keys (docs/kernels.md section 7), added in score space:
//! `sign * s_j * sum_i (U^T q)_i (code_i - h)`.

use std::ops::Range;

use super::super::headq::HeadqCoder;
use super::super::{check_bits, check_len, check_row_len};
use super::reader::{mul, RowReader};
use super::{AttentionShape, KeyRows, SideRows};
use crate::error::{KvqError, Result};
use crate::scalars::ScalarView;
use crate::simd::{ops, Isa};

/// The validated HeadQ side code.
pub(super) struct SidePlan<'a> {
    codes: &'a [u8],
    scales: ScalarView<'a>,
    coders: Vec<HeadqCoder>,
    reader: RowReader,
    sign: f32,
    /// Token room per head.
    stride: usize,
}

impl<'a> SidePlan<'a> {
    pub(super) fn new(s: &SideRows<'a>, layout: &AttentionShape, isa: Isa) -> Result<Self> {
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
        let vectors = mul("side.codes", layout.heads, layout.stride)?;
        check_len(
            "side.codes",
            s.codes.len(),
            mul("side.codes", vectors, reader.row_bytes)?,
            "heads x stride x packed side codes",
        )?;
        let held = (layout.heads, layout.stride, layout.tokens);
        s.scales.validate_rows("side.scales", held, false)?;
        Ok(Self {
            codes: s.codes,
            scales: s.scales,
            coders,
            reader,
            sign: s.sign,
            stride: layout.stride,
        })
    }
}

impl KeyRows for SidePlan<'_> {
    /// `U^T q` (rows x rank) with head `h`'s basis.
    fn queries(&self, _isa: Isa, q: &[f32], h: usize, lay: &AttentionShape) -> Vec<f32> {
        let coder = &self.coders[h % self.coders.len()];
        let rank = self.reader.n;
        let mut qu = vec![0.0f32; q.len() / lay.head_dim * rank];
        for (o, row) in qu.chunks_exact_mut(rank).zip(q.chunks_exact(lay.head_dim)) {
            coder.project_row(row, o);
        }
        qu
    }

    fn add_scores(&self, isa: Isa, qu: &[f32], h: usize, span: Range<usize>, s: &mut [f32]) {
        let (t, c0, n) = (self.stride, span.start, span.len());
        let mut dots = vec![0.0f32; s.len() / n];
        let mut sc = vec![0.0f32; n];
        self.scales.read(isa, h * t + c0, &mut sc);
        self.reader.each_row(isa, self.codes, (h, t), span, |j, c| {
            ops::dots(isa, qu, c, &mut dots);
            let scale = self.sign * sc[j - c0];
            for (r, &v) in dots.iter().enumerate() {
                s[r * n + j - c0] += scale * v;
            }
        });
    }
}
