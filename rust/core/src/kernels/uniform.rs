//! Asymmetric min-max uniform quantization of contiguous groups (the KIVI quantizer; docs/schemes.md,
//! docs/kernels.md section 9). Each group of `group` consecutive values of a row gets a scale
//! and a zero point; KIVI's per-channel keys are handled by the caller laying channels out as
//! rows (groups of tokens), its per-token values by groups of channels within a row.

use super::{check_bits, check_finite, check_row_len, rows_of};
use crate::alloc::output_vec;
use crate::error::{KvqError, Result};
use crate::par;
use crate::scalars::{ScalarPlane, ScalarView};

/// Codes (one byte each) plus one scale and one zero point per group.
#[derive(Debug, Clone, PartialEq)]
pub struct UniformCodes {
    /// rows x n codes.
    pub codes: Vec<u8>,
    /// rows x groups scales `(max - min) / (2^b - 1)`.
    pub scales: ScalarPlane,
    /// rows x groups zero points (the group minimum).
    pub zeros: ScalarPlane,
}

/// The quantizer for rows of `n` values in groups of `group` (the last group may be shorter).
#[derive(Debug, Clone, Copy)]
pub struct UniformQuantizer {
    n: usize,
    group: usize,
    bits: u32,
}

impl UniformQuantizer {
    /// Errors on bits outside 1..=8 or a zero / oversized row or group length.
    pub fn new(n: usize, group: usize, bits: u32) -> Result<Self> {
        check_bits("bits", bits)?;
        check_row_len("n", n)?;
        check_row_len("group", group)?;
        Ok(Self { n, group, bits })
    }

    /// Values per row.
    pub fn row_len(&self) -> usize {
        self.n
    }

    /// Code width in bits.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.n.div_ceil(self.group)
    }

    fn top(&self) -> f32 {
        ((1u32 << self.bits) - 1) as f32
    }

    /// Encodes rows of `n` values. Scales and zero points are rounded to their storage first
    /// and the codes are computed with the stored values, so decoding sees what encoding saw.
    /// Rows run in parallel (each row's bytes are the same for any thread count).
    pub fn encode(&self, x: &[f32]) -> Result<UniformCodes> {
        let rows = rows_of("x", x.len(), self.n)?;
        check_finite("x", x, self.n)?;
        let g = self.groups();
        let (mut scales, mut zeros) = (vec![0.0f32; rows * g], vec![0.0f32; rows * g]);
        let top = self.top();
        par::rows2(
            rows,
            self.n,
            (x, self.n),
            (&mut scales, g),
            (&mut zeros, g),
            || (),
            |_, first, xs, ss, zs| {
                for (k, row) in xs.chunks_exact(self.n).enumerate() {
                    for (j, grp) in row.chunks(self.group).enumerate() {
                        let lo = grp.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                        let hi = grp.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                        let scale = (hi - lo) / top;
                        if !scale.is_finite() {
                            return Err(first + k);
                        }
                        ss[k * g + j] = scale;
                        // `min` leaves the sign of a zero minimum unspecified: + 0.0 stores
                        // +0.0 for either, so the bytes match the oracle on every platform.
                        zs[k * g + j] = lo + 0.0;
                    }
                }
                Ok(())
            },
        )
        .map_err(|row| KvqError::NormOverflow { arg: "x", row })?;
        let (scales, zeros) = (ScalarPlane::store(&scales), ScalarPlane::store(&zeros));
        let mut codes = vec![0u8; x.len()];
        let _ = par::rows1(
            rows,
            self.n,
            (x, self.n),
            (&mut codes, self.n),
            || (),
            |_, first, xs, cs| {
                for (k, (row, out)) in xs
                    .chunks_exact(self.n)
                    .zip(cs.chunks_exact_mut(self.n))
                    .enumerate()
                {
                    let r = first + k;
                    for (j, (grp, cg)) in row
                        .chunks(self.group)
                        .zip(out.chunks_mut(self.group))
                        .enumerate()
                    {
                        let (s, z) = (scales.get(r * g + j), zeros.get(r * g + j));
                        // clamp(floor(t + 0.5), 0, top) without a floor call: for t + 0.5 in
                        // [0, top] truncation is the floor, and both forms send everything
                        // below 0 to 0 and above top to top (an integer), so the codes are
                        // the same bits and the loop vectorises.
                        for (c, &v) in cg.iter_mut().zip(grp) {
                            let t = if s > 0.0 { (v - z) / s } else { 0.0 };
                            *c = (t + 0.5).clamp(0.0, top) as u8;
                        }
                    }
                }
                Ok(())
            },
        );
        Ok(UniformCodes {
            codes,
            scales,
            zeros,
        })
    }

    /// Decodes `zero + scale * code` into rows of `n` values.
    pub fn decode(&self, c: &UniformCodes) -> Result<Vec<f32>> {
        self.decode_parts(&c.codes, c.scales.view(), c.zeros.view())
    }

    /// [`UniformQuantizer::decode`] from borrowed codes, scales and zero points.
    pub fn decode_parts(
        &self,
        codes: &[u8],
        scales: ScalarView<'_>,
        zeros: ScalarView<'_>,
    ) -> Result<Vec<f32>> {
        let rows = rows_of("codes", codes.len(), self.n)?;
        let g = self.groups();
        scales.validate("scales", rows * g)?;
        zeros.validate_signed("zeros", rows * g)?;
        super::check_codes("codes", codes, self.n, self.bits)?;
        let mut out = output_vec(codes.len());
        for (r, (cr, orow)) in codes
            .chunks_exact(self.n)
            .zip(out.chunks_exact_mut(self.n))
            .enumerate()
        {
            for (j, (cg, og)) in cr
                .chunks(self.group)
                .zip(orow.chunks_mut(self.group))
                .enumerate()
            {
                let (s, z) = (scales.get(r * g + j), zeros.get(r * g + j));
                og.iter_mut()
                    .zip(cg)
                    .for_each(|(o, &k)| *o = z + s * f32::from(k));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_exact_and_partial_groups_work() {
        let q = UniformQuantizer::new(5, 2, 2).unwrap();
        let x = [-1.0, 2.0, 0.5, 0.5, 3.0];
        let c = q.encode(&x).unwrap();
        assert_eq!(c.codes, vec![0, 3, 0, 0, 0]);
        let y = q.decode(&c).unwrap();
        assert_eq!(y, vec![-1.0, 2.0, 0.5, 0.5, 3.0]);
    }

    #[test]
    fn error_is_at_most_half_a_step() {
        let q = UniformQuantizer::new(32, 32, 3).unwrap();
        let x: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin()).collect();
        let c = q.encode(&x).unwrap();
        let y = q.decode(&c).unwrap();
        let step = c.scales.get(0);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= 0.5 * step * 1.001 + 1e-3, "{a} vs {b}");
        }
    }
}
