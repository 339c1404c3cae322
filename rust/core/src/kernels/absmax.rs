//! Symmetric per-row absmax codes (docs/kernels.md section 14): one float16 scale per row, the
//! largest magnitude over the row's coded coordinates, and a bit width per coordinate (0: not
//! coded). The keys of a calibrated-basis codec with a fixed size per token: each row is one
//! token's coordinates, already divided by their calibrated standard deviations by the caller.
//!
//! Encode, per row (float32, in this order): `a = max_{i in C} |x_i|` (0 when no coordinate is
//! coded), `s = f16(a)` (round to nearest even; an error if it rounds to infinity), and for each
//! coded coordinate with `L = 2^w_i - 1`: `u = x_i / s` (0 when `s = 0`),
//! `t = ((u + 1) * 0.5) * L`, `code = clamp(floor(t + 0.5), 0, L)`; uncoded coordinates store
//! code 0. Decode: `x_hat_i = ((2 code - L) / L) * s` (the integer `2 code - L` converted to
//! float32, one division, one multiply), 0 where the coordinate is not coded.

use half::f16;

use super::{check_finite, check_row_len, rows_of};
use crate::alloc::output_vec;
use crate::error::{KvqError, Result};
use crate::par;

/// Widest code of a coordinate.
pub const MAX_WIDTH: u8 = 8;

/// Codes (one byte per coordinate) plus one float16 scale per row.
#[derive(Debug, Clone, PartialEq)]
pub struct AbsmaxCodes {
    /// rows x d codes (0 in the uncoded coordinates).
    pub codes: Vec<u8>,
    /// rows float16 scales (bit patterns): each row's largest coded magnitude, rounded.
    pub scales: Vec<u16>,
}

/// Checks every width in `0..=MAX_WIDTH` and `1 <= d <= MAX_ROW_LEN`; returns each coordinate's
/// top code `L = 2^w - 1` as float32 (0 for an uncoded coordinate).
fn tops(widths: &[u8]) -> Result<Vec<f32>> {
    check_row_len("widths", widths.len())?;
    if let Some(&w) = widths.iter().find(|&&w| w > MAX_WIDTH) {
        return Err(KvqError::InvalidBits {
            arg: "widths",
            min: 0,
            max: u32::from(MAX_WIDTH),
            actual: i64::from(w),
        });
    }
    Ok(widths.iter().map(|&w| ((1u32 << w) - 1) as f32).collect())
}

/// A row's largest magnitude over its coded coordinates (`top > 0`), 0 when none is coded.
#[inline]
pub fn row_absmax(row: &[f32], top: &[f32]) -> f32 {
    row.iter()
        .zip(top)
        .filter(|(_, &l)| l > 0.0)
        .fold(0.0f32, |m, (&v, _)| m.max(v.abs()))
}

/// The float16 scale of a row's largest coded magnitude `a`, or None when it rounds to
/// infinity (`a >= 65520`).
#[inline]
pub fn scale_of(a: f32) -> Option<f16> {
    let s = f16::from_f32(a);
    s.is_finite().then_some(s)
}

/// The code of `x` under the stored scale `s` and top code `top > 0`.
#[inline]
pub fn code_of(x: f32, s: f32, top: f32) -> u8 {
    let u = if s > 0.0 { x / s } else { 0.0 };
    let t = ((u + 1.0) * 0.5) * top;
    // clamp(floor(t + 0.5), 0, top) without a floor call: for t + 0.5 in [0, top] truncation is
    // the floor, and both forms send everything below 0 to 0 and above top to top (an integer).
    (t + 0.5).clamp(0.0, top) as u8
}

/// The reconstruction level of code `c` under top code `top = 2^w - 1 > 0` and scale `s`:
/// `((2c - top) / top) * s`, the integer `2c - top` exact.
#[inline]
pub fn level(c: u8, top: u32, s: f32) -> f32 {
    let k = 2 * i32::from(c) - top as i32;
    (k as f32 / top as f32) * s
}

/// Encodes rows of `d = widths.len()` values. Errors: a width above 8, `x` not whole rows,
/// a NaN or infinity anywhere in `x` (uncoded coordinates included), a row whose largest coded
/// magnitude rounds to float16 infinity. Rows run in parallel (the same bytes for any thread
/// count; errors name the lowest failing row).
pub fn encode(x: &[f32], widths: &[u8]) -> Result<AbsmaxCodes> {
    let top = tops(widths)?;
    let d = widths.len();
    let rows = rows_of("x", x.len(), d)?;
    check_finite("x", x, d)?;
    let mut codes = vec![0u8; x.len()];
    let mut scales = vec![0u16; rows];
    par::rows2(
        rows,
        d,
        (x, d),
        (&mut codes, d),
        (&mut scales, 1),
        || (),
        |_, first, xs, cs, ss| {
            for (k, ((row, out), sc)) in xs
                .chunks_exact(d)
                .zip(cs.chunks_exact_mut(d))
                .zip(ss.iter_mut())
                .enumerate()
            {
                let s16 = scale_of(row_absmax(row, &top)).ok_or(first + k)?;
                *sc = s16.to_bits();
                let s = s16.to_f32();
                for ((c, &v), &l) in out.iter_mut().zip(row).zip(&top) {
                    *c = if l > 0.0 { code_of(v, s, l) } else { 0 };
                }
            }
            Ok(())
        },
    )
    .map_err(|row| KvqError::ScaleOverflow {
        arg: "x",
        row,
        value: row_absmax(&x[row * d..(row + 1) * d], &top),
    })?;
    Ok(AbsmaxCodes { codes, scales })
}

/// Decodes rows of `d = widths.len()` codes with their float16 scales (bit patterns, one per
/// row). Errors: a width above 8, codes not whole rows, a scale count other than the rows, a
/// negative or non-finite scale, a code above its coordinate's `2^w - 1` (any code but 0 in an
/// uncoded coordinate).
pub fn decode(codes: &[u8], scales: &[u16], widths: &[u8]) -> Result<Vec<f32>> {
    let top = tops(widths)?;
    let d = widths.len();
    let rows = rows_of("codes", codes.len(), d)?;
    super::check_len("scales", scales.len(), rows, "one float16 scale per row")?;
    if let Some((row, v)) = scales
        .iter()
        .map(|&b| f16::from_bits(b).to_f32())
        .enumerate()
        .find(|(_, v)| !(v.is_finite() && *v >= 0.0))
    {
        return Err(KvqError::InvalidScalar {
            arg: "scales",
            row,
            value: v,
        });
    }
    if let Some(i) = codes
        .iter()
        .enumerate()
        .position(|(i, &c)| f32::from(c) > top[i % d])
    {
        let w = u32::from(widths[i % d]);
        return Err(KvqError::CodeOutOfRange {
            arg: "codes",
            row: i / d,
            col: i % d,
            value: u32::from(codes[i]),
            bits: w,
            limit: 1 << w,
        });
    }
    let tops_u32: Vec<u32> = widths.iter().map(|&w| (1u32 << w) - 1).collect();
    let mut out = output_vec(codes.len());
    let _ = par::rows1(
        rows,
        d,
        (codes, d),
        (&mut out, d),
        || (),
        |_, first, cs, os| {
            for (k, (row, orow)) in cs.chunks_exact(d).zip(os.chunks_exact_mut(d)).enumerate() {
                let s = f16::from_bits(scales[first + k]).to_f32();
                for ((o, &c), &l) in orow.iter_mut().zip(row).zip(&tops_u32) {
                    *o = if l > 0 { level(c, l, s) } else { 0.0 };
                }
            }
            Ok(())
        },
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&s| f16::from_f32(s).to_bits()).collect()
    }

    #[test]
    fn endpoints_and_zero_are_levels() {
        // Width 2: levels -1, -1/3, 1/3, 1 (times the scale 3).
        let w = [2u8, 2, 2, 2, 0];
        let x = [-3.0, -1.0, 1.0, 3.0, 100.0];
        let c = encode(&x, &w).unwrap();
        assert_eq!(c.codes, vec![0, 1, 2, 3, 0]);
        assert_eq!(c.scales, bits(&[3.0]));
        assert_eq!(
            decode(&c.codes, &c.scales, &w).unwrap(),
            vec![-3.0, -1.0, 1.0, 3.0, 0.0]
        );
    }

    #[test]
    fn mixed_widths_within_half_a_step() {
        let w: Vec<u8> = (0..24).map(|i| (i % 9) as u8).collect();
        let x: Vec<f32> = (0..48).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let c = encode(&x, &w).unwrap();
        let y = decode(&c.codes, &c.scales, &w).unwrap();
        for (r, (xr, yr)) in x.chunks(24).zip(y.chunks(24)).enumerate() {
            let s = f16::from_bits(c.scales[r]).to_f32();
            for ((&a, &b), &wi) in xr.iter().zip(yr).zip(&w) {
                if wi == 0 {
                    assert_eq!(b, 0.0);
                } else {
                    let step = 2.0 * s / ((1u32 << wi) - 1) as f32;
                    // Half a step, plus the float16 rounding of the scale at the clamped ends.
                    assert!(
                        (a - b).abs() <= 0.5 * step + s * 1e-3,
                        "{a} vs {b} at width {wi}"
                    );
                }
            }
        }
    }

    #[test]
    fn zero_rows_and_no_coded_coordinates() {
        let c = encode(&[0.0; 4], &[3, 3]).unwrap();
        // s = 0: u = 0, t = L / 2, code (L + 1) / 2, which decodes to 0.
        assert_eq!(c.codes, vec![4, 4, 4, 4]);
        assert_eq!(c.scales, vec![0, 0]);
        assert_eq!(decode(&c.codes, &c.scales, &[3, 3]).unwrap(), vec![0.0; 4]);
        let c = encode(&[5.0, -7.0], &[0, 0]).unwrap();
        assert_eq!((c.codes, c.scales), (vec![0, 0], vec![0]));
        let c = encode(&[], &[1, 2]).unwrap();
        assert!(c.codes.is_empty() && c.scales.is_empty());
    }

    #[test]
    fn big_batches_match_the_sequential_rows() {
        let w: Vec<u8> = (0..100).map(|i| (i % 9) as u8).collect();
        let x: Vec<f32> = (0..100 * 700)
            .map(|i| ((i as f32) * 0.013).sin() * (1 + i % 37) as f32)
            .collect();
        let c = encode(&x, &w).unwrap();
        let y = decode(&c.codes, &c.scales, &w).unwrap();
        for r in [0, 350, 699] {
            let row = &x[r * 100..(r + 1) * 100];
            let one = encode(row, &w).unwrap();
            assert_eq!(one.codes, &c.codes[r * 100..(r + 1) * 100]);
            assert_eq!(one.scales[0], c.scales[r]);
            assert_eq!(
                decode(&one.codes, &one.scales, &w).unwrap(),
                &y[r * 100..(r + 1) * 100]
            );
        }
    }

    #[test]
    fn errors_name_the_problem() {
        let e = encode(&[1.0, 2.0], &[9, 1]).unwrap_err();
        assert_eq!(e.to_string(), "widths: expected a bit width in 0..8, got 9");
        assert!(encode(&[1.0, 2.0, 3.0], &[1, 1]).is_err());
        assert!(encode(&[1.0], &[]).is_err());
        let e = encode(&[1.0, 2.0, 3.0, f32::NAN], &[1, 0]).unwrap_err();
        assert!(e.to_string().contains("row 1, position 1"), "{e}");
        // 65519 rounds to 65504; 65520 rounds to infinity. Uncoded coordinates do not count.
        assert!(encode(&[65519.0, 1e30], &[8, 0]).is_ok());
        let e = encode(&[1.0, 1.0, 65520.0, -1.0], &[8, 8]).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("absmax scale overflows float16") && msg.contains("row 1"),
            "{msg}"
        );
        let e = decode(&[4, 0], &bits(&[1.0]), &[2, 2]).unwrap_err();
        assert!(e.to_string().contains("code 4 at row 0, position 0"), "{e}");
        assert!(decode(&[0, 1], &bits(&[1.0]), &[2, 0]).is_err());
        assert!(decode(&[0, 0], &bits(&[1.0, 1.0]), &[2, 2]).is_err());
        assert!(decode(&[0, 0], &bits(&[-1.0]), &[2, 2]).is_err());
        assert!(decode(&[0, 0], &[0x7c00], &[2, 2]).is_err());
        assert!(decode(&[0, 0], &bits(&[1.0]), &[2, 9]).is_err());
    }
}
