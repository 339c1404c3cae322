//! Log-coded scalars: non-negative values (the MSE stage's norms) in 8 bits each on a grid of
//! 1/16 octave, relative to one exponent byte per group of consecutive values (the octave of
//! the group's largest value; docs/kernels.md section 13). Encoding reads the grid index from
//! the float32 bits with integer and comparison operations only, and decoding is a table read
//! and an exponent shift, so every path (this one, the WGSL shader, the NumPy oracle) gives
//! the same bytes and floats.

use super::{check_row_len, rows_of};
use crate::error::{KvqError, Result};

/// Bias of a stored exponent byte: byte `b` is octave `b - 127`.
pub const BIAS: i32 = 127;
/// Smallest stored exponent byte: octave -111, whose lowest level `2^((16 * -111 + 15 - 254)
/// / 16)` is `2^-126`, a normal float32.
pub const EXP_MIN: u8 = 16;
/// Largest stored exponent byte: octave 127, whose top level `2^(2047 / 16)` is below
/// `f32::MAX`.
pub const EXP_MAX: u8 = 254;
/// The code of zero (and of values more than an octave below a group's smallest level).
pub const ZERO: u8 = 255;
/// Largest code of a non-zero level.
const LOWEST: i32 = 254;

/// `T_k`: the smallest float32 `>= 2^((k + 0.5) / 16)` (bit patterns): a mantissa `m` in
/// `[1, 2)` rounds to grid step `#{k : m >= T_k}`.
const THRESHOLDS: [u32; 16] = [
    0x3f82cd87, 0x3f88980f, 0x3f8ea43a, 0x3f94f4f0, 0x3f9b8d3a, 0x3fa27044, 0x3fa9a15b, 0x3fb123f6,
    0x3fb8fbb0, 0x3fc12c4d, 0x3fc9b9be, 0x3fd2a81e, 0x3fdbfbb8, 0x3fe5b907, 0x3fefe4ba, 0x3ffa83b3,
];

/// `L_j`: the float32 nearest `2^(j / 16)` (bit patterns), the levels of one octave.
const LEVELS: [u32; 16] = [
    0x3f800000, 0x3f85aac3, 0x3f8b95c2, 0x3f91c3d3, 0x3f9837f0, 0x3f9ef532, 0x3fa5fed7, 0x3fad583f,
    0x3fb504f3, 0x3fbd08a4, 0x3fc5672a, 0x3fce248c, 0x3fd744fd, 0x3fe0ccdf, 0x3feac0c7, 0x3ff5257d,
];

/// Grid index `round(16 log2 v)` of a normal positive float32, or None for zero (of either
/// sign) and subnormals (callers have rejected negative and non-finite values).
#[inline]
pub fn grid_index(v: f32) -> Option<i32> {
    // Without the sign bit: -0.0 passes the callers' `>= 0` check and is zero.
    let bits = v.to_bits() & 0x7fff_ffff;
    let biased = (bits >> 23) as i32;
    if biased == 0 {
        return None;
    }
    let m = (bits & 0x007f_ffff) | 0x3f80_0000;
    let j = THRESHOLDS.iter().filter(|&&t| m >= t).count() as i32;
    Some(16 * (biased - 127) + j)
}

/// The grid index of the top level of the octave of exponent byte `b`: `16 (b - 127) + 15`.
#[inline]
fn top(b: u8) -> i32 {
    16 * (i32::from(b) - BIAS) + 15
}

/// The exponent byte of a group whose largest grid index is `r`: its octave `floor(r / 16)`,
/// clamped to the stored range.
#[inline]
fn exponent(r: i32) -> u8 {
    (r.div_euclid(16) + BIAS).clamp(i32::from(EXP_MIN), i32::from(EXP_MAX)) as u8
}

/// The value of code `c` under exponent byte `b`: `L_(k mod 16) 2^floor(k / 16)`,
/// `k = 16 (b - 127) + 15 - c` (0 for [`ZERO`]). `b` must lie in `EXP_MIN..=EXP_MAX`
/// (checked by [`check_exps`]).
#[inline]
pub fn level(c: u8, b: u8) -> f32 {
    if c == ZERO {
        return 0.0;
    }
    let k = top(b) - i32::from(c);
    let (octave, step) = (k.div_euclid(16), k.rem_euclid(16) as usize);
    f32::from_bits((LEVELS[step] as i32 + (octave << 23)) as u32)
}

/// The code of grid index `r` (None: zero) under exponent byte `b`.
#[inline]
fn code_of(r: Option<i32>, b: u8) -> u8 {
    match r.map(|r| top(b) - r) {
        Some(c) if c <= LOWEST => c.max(0) as u8,
        Some(c) if c <= LOWEST + 16 => LOWEST as u8,
        _ => ZERO,
    }
}

/// Codes of rows of `n` non-negative finite values (rows x n) and one exponent byte per group
/// of `group` values (rows x ceil(n / group)).
pub fn encode(values: &[f32], n: usize, group: usize) -> Result<(Vec<u8>, Vec<u8>)> {
    check_row_len("n", n)?;
    check_row_len("group", group)?;
    let rows = rows_of("values", values.len(), n)?;
    if let Some(i) = values.iter().position(|v| !(v.is_finite() && *v >= 0.0)) {
        return Err(KvqError::NegativeOrNonFinite {
            arg: "values",
            row: i / n,
            col: i % n,
            value: values[i],
        });
    }
    let groups = n.div_ceil(group);
    let mut codes = vec![0u8; values.len()];
    let mut exps = vec![0u8; rows * groups];
    for ((row, out), es) in values
        .chunks_exact(n)
        .zip(codes.chunks_exact_mut(n))
        .zip(exps.chunks_exact_mut(groups))
    {
        for ((grp, cg), e) in row.chunks(group).zip(out.chunks_mut(group)).zip(es) {
            let largest = grp.iter().filter_map(|&v| grid_index(v)).max();
            // An all-zero group stores octave 0 (any valid byte would do).
            *e = largest.map_or(BIAS as u8, exponent);
            for (c, &v) in cg.iter_mut().zip(grp) {
                *c = code_of(grid_index(v), *e);
            }
        }
    }
    Ok((codes, exps))
}

/// Checks stored exponent bytes (any code is valid; a byte outside `EXP_MIN..=EXP_MAX` would
/// decode beyond the normal float32 range).
pub fn check_exps(arg: &'static str, exps: &[u8]) -> Result<()> {
    check_exps_from(arg, exps, 0)
}

/// [`check_exps`] of bytes that start at group `first` of a larger array (errors name that
/// array's group).
pub fn check_exps_from(arg: &'static str, exps: &[u8], first: usize) -> Result<()> {
    match exps.iter().position(|e| !(EXP_MIN..=EXP_MAX).contains(e)) {
        None => Ok(()),
        Some(i) => Err(KvqError::ShapeMismatch {
            arg,
            expected: format!("log-code exponent bytes in {EXP_MIN}..={EXP_MAX}"),
            actual: format!("{} at group {}", exps[i], first + i),
        }),
    }
}

/// Decodes rows of `n` codes with their group exponent bytes (rows x ceil(n / group)).
pub fn decode(codes: &[u8], exps: &[u8], n: usize, group: usize) -> Result<Vec<f32>> {
    check_row_len("n", n)?;
    check_row_len("group", group)?;
    let rows = rows_of("codes", codes.len(), n)?;
    let groups = n.div_ceil(group);
    super::check_len(
        "exps",
        exps.len(),
        rows * groups,
        "one exponent byte per group",
    )?;
    check_exps("exps", exps)?;
    let mut out = vec![0f32; codes.len()];
    for ((row, o), es) in codes
        .chunks_exact(n)
        .zip(out.chunks_exact_mut(n))
        .zip(exps.chunks_exact(groups))
    {
        for ((cg, og), &e) in row.chunks(group).zip(o.chunks_mut(group)).zip(es) {
            for (v, &c) in og.iter_mut().zip(cg) {
                *v = level(c, e);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tables are what their comments say.
    #[test]
    fn tables_are_the_grid() {
        for k in 0..16 {
            let t = f32::from_bits(THRESHOLDS[k]);
            let exact = 2f64.powf((k as f64 + 0.5) / 16.0);
            assert!(f64::from(t) >= exact, "{k}");
            let below = f32::from_bits(THRESHOLDS[k] - 1);
            assert!(f64::from(below) < exact, "{k}");
            let l = f32::from_bits(LEVELS[k]);
            assert_eq!(l, 2f64.powf(k as f64 / 16.0) as f32, "{k}");
        }
    }

    /// The grid index is `round(16 log2 v)` on both sides of every threshold, over exponents.
    #[test]
    fn grid_index_rounds_the_log() {
        for e in [-126, -3, 0, 1, 40, 127] {
            for (k, &bits) in (0i32..).zip(&THRESHOLDS) {
                let t = f32::from_bits(bits) * 2f32.powi(e);
                let below = f32::from_bits(t.to_bits() - 1);
                assert_eq!(grid_index(t), Some(16 * e + k + 1));
                assert_eq!(grid_index(below), Some(16 * e + k));
            }
        }
        assert_eq!(grid_index(0.0), None);
        assert_eq!(grid_index(-0.0), None);
        assert_eq!(grid_index(1e-40), None);
        assert_eq!(grid_index(1.0), Some(0));
        assert_eq!(grid_index(f32::MAX), Some(2048));
    }

    /// Every code decodes to a normal float32 within 2.2% of what it coded, zero stays zero,
    /// and the extremes clamp as documented.
    #[test]
    fn round_trip_error_is_half_a_step() {
        let v: Vec<f32> = (0..2000)
            .map(|i| (i as f32 * 0.37).sin().abs() * 10f32.powi(i % 7 - 3))
            .chain([0.0, 1e-40, f32::MAX, 3e38])
            .collect();
        let (codes, exps) = encode(&v, v.len(), 16).unwrap();
        let back = decode(&codes, &exps, v.len(), 16).unwrap();
        for (i, (&x, &y)) in v.iter().zip(&back).enumerate() {
            let e = exps[i / 16];
            let smallest = level(254, e);
            if grid_index(x) > Some(top(EXP_MAX)) {
                // Above the top level (clamped): within one step of it.
                assert!((y / x - 1.0).abs() <= 0.044, "{i}: {x} -> {y}");
            } else if x >= smallest {
                assert!((y / x - 1.0).abs() <= 0.0219, "{i}: {x} -> {y}");
            } else {
                assert!(y == 0.0 || y == smallest, "{i}: {x} -> {y}");
            }
            assert!(y == 0.0 || y.is_normal());
        }
        assert_eq!(
            decode(&[0], &[EXP_MAX], 1, 1).unwrap()[0],
            level(0, EXP_MAX)
        );
        assert!(level(0, EXP_MAX).is_finite());
        // The lowest level of the lowest octave is the first above 2^-126.
        assert_eq!(
            level(254, EXP_MIN),
            f32::MIN_POSITIVE * f32::from_bits(LEVELS[1])
        );
        assert_eq!(level(0, BIAS as u8), f32::from_bits(LEVELS[15]));
    }

    /// Whole groups encoded in chunks join to one call's bytes.
    #[test]
    fn chunks_of_whole_groups_join() {
        let v: Vec<f32> = (0..96).map(|i| 1.0 + (i * 7 % 13) as f32).collect();
        let one = encode(&v, 96, 32).unwrap();
        let (a, b) = (
            encode(&v[..64], 64, 32).unwrap(),
            encode(&v[64..], 32, 32).unwrap(),
        );
        assert_eq!(one.0, [a.0, b.0].concat());
        assert_eq!(one.1, [a.1, b.1].concat());
    }

    #[test]
    fn bad_input_is_an_error() {
        // The bad value is named by its row of `n` values and its position in that row.
        assert!(matches!(
            encode(&[1.0, 2.0, 3.0, 4.0, -1.0, 6.0], 3, 2),
            Err(KvqError::NegativeOrNonFinite { row: 1, col: 1, .. })
        ));
        assert_eq!(
            encode(&[1.0, 2.0, f32::NAN], 1, 1).unwrap_err().to_string(),
            "values: expected finite non-negative values, got NaN at row 2, position 0"
        );
        assert!(encode(&[f32::NAN], 1, 1).is_err());
        assert!(encode(&[1.0], 1, 0).is_err());
        assert!(decode(&[0, 0], &[0], 2, 1).is_err());
        assert!(matches!(
            decode(&[0], &[EXP_MAX + 1], 1, 1),
            Err(KvqError::ShapeMismatch { .. })
        ));
    }
}
