//! The full-precision window of a cache layer in a preallocated buffer: a decode step's new
//! tokens are checked storable (finite, at most `MAX_STATE`) and copied in place, O(new
//! tokens), where joining them to the window would copy the whole window.

use crate::error::{KvqError, Result};

/// The largest magnitude a cache stores: far above any real key or value, and low enough that
/// no norm (head_dim up to 2^20), rotated coordinate, group range or basis coordinate of such
/// values overflows float32 when they are coded, steps later, with tokens of other updates.
pub const MAX_STATE: f32 = 1e35;

/// Whether every value is finite and at most [`MAX_STATE`] in magnitude (the check a cache
/// makes on arrival of new tokens).
pub fn all_storable(x: &[f32]) -> bool {
    // One pass: NaN and infinities fail the comparison too. A fold, not `all`, so it vectorizes.
    x.iter().fold(true, |ok, v| ok & (v.abs() <= MAX_STATE))
}

/// Copies `src`, `rows` x `n` x `d` float32 (C order: each (batch, head) row's new tokens),
/// into `dst`, `rows` x `cap` x `d`, at tokens `at .. at + n` of each row. Errors (nothing
/// copied) when the lengths do not match or the tokens do not fit.
pub fn append_tokens(
    dst: &mut [f32],
    (cap, at): (usize, usize),
    src: &[f32],
    (rows, n, d): (usize, usize, usize),
) -> Result<()> {
    let fits = at.checked_add(n).is_some_and(|end| end <= cap)
        && rows.checked_mul(n).and_then(|x| x.checked_mul(d)) == Some(src.len())
        && rows.checked_mul(cap).and_then(|x| x.checked_mul(d)) == Some(dst.len());
    if !fits {
        return Err(KvqError::ShapeMismatch {
            arg: "window",
            expected: format!("{rows} rows of {n} tokens of {d} values at token {at} of {cap}"),
            actual: format!("{} new values, a buffer of {}", src.len(), dst.len()),
        });
    }
    if n * d == 0 {
        return Ok(());
    }
    for (r, s) in src.chunks_exact(n * d).enumerate() {
        let start = (r * cap + at) * d;
        dst[start..start + n * d].copy_from_slice(s);
    }
    Ok(())
}

/// Tokens `lo .. lo + n` of each of the `rows` rows of `src` (`rows` x `cap` x `d` float32),
/// contiguous in C order (`rows` x `n` x `d`): the window tokens a flush encodes. Errors when
/// the span does not fit.
pub fn gather_tokens(
    src: &[f32],
    (cap, lo, n): (usize, usize, usize),
    (rows, d): (usize, usize),
) -> Result<Vec<f32>> {
    let fits = lo.checked_add(n).is_some_and(|end| end <= cap)
        && rows.checked_mul(cap).and_then(|x| x.checked_mul(d)) == Some(src.len());
    if !fits {
        return Err(KvqError::ShapeMismatch {
            arg: "window",
            expected: format!(
                "{rows} rows of {cap} tokens of {d} values holding tokens {lo} .. {lo} + {n}"
            ),
            actual: format!("a buffer of {}", src.len()),
        });
    }
    let mut out = Vec::with_capacity(rows * n * d);
    for r in 0..rows {
        out.extend_from_slice(&src[(r * cap + lo) * d..(r * cap + lo + n) * d]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_each_rows_tokens_after_its_held_ones() {
        let (rows, cap, d) = (3, 5, 2);
        let mut dst = vec![0.0f32; rows * cap * d];
        let src: Vec<f32> = (0..rows * 2 * d).map(|i| i as f32 + 1.0).collect();
        append_tokens(&mut dst, (cap, 1), &src, (rows, 2, d)).unwrap();
        for r in 0..rows {
            let row = &dst[r * cap * d..(r + 1) * cap * d];
            assert_eq!(&row[..d], &[0.0, 0.0]);
            assert_eq!(&row[d..3 * d], &src[r * 2 * d..(r + 1) * 2 * d]);
            assert!(row[3 * d..].iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn gathers_each_rows_span() {
        let (rows, cap, d) = (2, 4, 3);
        let src: Vec<f32> = (0..rows * cap * d).map(|i| i as f32).collect();
        let got = gather_tokens(&src, (cap, 1, 2), (rows, d)).unwrap();
        let want: Vec<f32> = [3..9, 15..21]
            .into_iter()
            .flatten()
            .map(|i| i as f32)
            .collect();
        assert_eq!(got, want);
        assert!(gather_tokens(&src, (cap, 3, 2), (rows, d)).is_err());
        assert!(gather_tokens(&src[1..], (cap, 0, 1), (rows, d)).is_err());
    }

    #[test]
    fn refuses_tokens_that_do_not_fit() {
        let mut dst = vec![0.0f32; 2 * 4 * 3];
        assert!(append_tokens(&mut dst, (4, 3), &[1.0; 2 * 2 * 3], (2, 2, 3)).is_err());
        assert!(append_tokens(&mut dst, (4, 0), &[1.0; 5], (2, 1, 3)).is_err());
        assert!(dst.iter().all(|&v| v == 0.0));
        assert!(append_tokens(&mut dst, (4, 4), &[], (2, 0, 3)).is_ok());
        assert!(
            !all_storable(&[1.0, f32::NAN]) && all_storable(&[1.0, -2.0, MAX_STATE, -MAX_STATE])
        );
        assert!(!all_storable(&[1.0, -1.01 * MAX_STATE]) && !all_storable(&[f32::INFINITY]));
    }
}
