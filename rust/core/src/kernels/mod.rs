//! The kernels of docs/kernels.md, one file each, plus the argument checks they share.

pub mod absmax;
pub mod attention;
pub mod hadamard;
pub mod headq;
pub mod lloyd_max;
pub mod log_scalars;
pub mod mse;
pub mod mse_qjl;
pub mod pack;
pub mod paged;
pub mod qjl;
pub mod uniform;

use crate::error::{KvqError, Result};

/// Longest row (head_dim, codes per row, sketch size) any kernel accepts: far above real head
/// dims, and small enough that no size computation can overflow or allocate absurdly.
pub const MAX_ROW_LEN: usize = 1 << 20;

/// Largest random matrix (QJL sketch, random basis) in entries: 2^28 float32 = 1 GiB.
pub const MAX_MATRIX_ENTRIES: usize = 1 << 28;

/// Checks `1 <= len <= MAX_ROW_LEN` for a row length.
pub fn check_row_len(arg: &'static str, len: usize) -> Result<()> {
    if (1..=MAX_ROW_LEN).contains(&len) {
        Ok(())
    } else {
        Err(KvqError::InvalidDimension {
            arg,
            expected: format!("1 <= {arg} <= {MAX_ROW_LEN}"),
            actual: i64::try_from(len).unwrap_or(i64::MAX),
        })
    }
}

/// Checks that a `rows x cols` random matrix stays within `MAX_MATRIX_ENTRIES`.
pub fn check_matrix(arg: &'static str, rows: usize, cols: usize) -> Result<()> {
    match rows.checked_mul(cols) {
        Some(n) if n <= MAX_MATRIX_ENTRIES => Ok(()),
        _ => Err(KvqError::InvalidDimension {
            arg,
            expected: format!("at most {MAX_MATRIX_ENTRIES} matrix entries"),
            actual: i64::try_from(rows.saturating_mul(cols)).unwrap_or(i64::MAX),
        }),
    }
}

/// Checks `1 <= bits <= 8`.
pub fn check_bits(arg: &'static str, bits: u32) -> Result<()> {
    if (1..=8).contains(&bits) {
        Ok(())
    } else {
        Err(KvqError::InvalidBits {
            arg,
            min: 1,
            max: 8,
            actual: i64::from(bits),
        })
    }
}

/// Checks `head_dim >= 2` (the sphere marginal needs at least two dimensions).
pub fn check_head_dim(arg: &'static str, head_dim: usize) -> Result<()> {
    if (2..=MAX_ROW_LEN).contains(&head_dim) {
        Ok(())
    } else {
        Err(KvqError::InvalidDimension {
            arg,
            expected: format!("2 <= head_dim <= {MAX_ROW_LEN}"),
            actual: i64::try_from(head_dim).unwrap_or(i64::MAX),
        })
    }
}

/// Checks that `data` holds a whole number of rows of length `dim`; returns the row count.
pub fn rows_of(arg: &'static str, len: usize, dim: usize) -> Result<usize> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(KvqError::ShapeMismatch {
            arg,
            expected: format!("rows of {dim} values"),
            actual: format!("{len} values"),
        });
    }
    Ok(len / dim)
}

/// Checks an exact buffer length.
pub fn check_len(arg: &'static str, len: usize, expected: usize, what: &str) -> Result<()> {
    if len == expected {
        Ok(())
    } else {
        Err(KvqError::ShapeMismatch {
            arg,
            expected: format!("{expected} values ({what})"),
            actual: format!("{len} values"),
        })
    }
}

/// Rejects codes >= 2^bits, naming the first position.
pub fn check_codes(arg: &'static str, codes: &[u8], width: usize, bits: u32) -> Result<()> {
    let limit = 1u32 << bits;
    // The maximum vectorises; the position is searched only on error.
    if u32::from(codes.iter().fold(0u8, |m, &c| m.max(c))) < limit {
        return Ok(());
    }
    match codes.iter().position(|&c| u32::from(c) >= limit) {
        None => Ok(()),
        Some(i) => Err(KvqError::CodeOutOfRange {
            arg,
            row: i / width,
            col: i % width,
            value: u32::from(codes[i]),
            bits,
            limit,
        }),
    }
}

/// Rejects NaN and infinities, naming the first offending position.
pub fn check_finite(arg: &'static str, data: &[f32], dim: usize) -> Result<()> {
    check_finite_from(arg, data, dim, 0)
}

/// [`check_finite`] of rows that start at row `first` of a larger array (errors name that
/// array's row).
pub fn check_finite_from(arg: &'static str, data: &[f32], dim: usize, first: usize) -> Result<()> {
    match data.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(KvqError::NonFinite {
            arg,
            row: first + i / dim,
            col: i % dim,
            value: data[i],
        }),
    }
}
