//! The kernels of SPEC section 2, one file each, plus the argument checks they share.

pub mod hadamard;
pub mod headq;
pub mod lloyd_max;
pub mod mse;
pub mod pack;
pub mod qjl;

use crate::error::{KvqError, Result};

/// Checks `1 <= bits <= 8`.
pub fn check_bits(arg: &'static str, bits: u32) -> Result<()> {
    if (1..=8).contains(&bits) {
        Ok(())
    } else {
        Err(KvqError::InvalidBits { arg, min: 1, max: 8, actual: i64::from(bits) })
    }
}

/// Checks `head_dim >= 2` (the sphere marginal needs at least two dimensions).
pub fn check_head_dim(arg: &'static str, head_dim: usize) -> Result<()> {
    if head_dim >= 2 {
        Ok(())
    } else {
        Err(KvqError::InvalidDimension {
            arg,
            expected: "head_dim >= 2".to_string(),
            actual: head_dim as i64,
        })
    }
}

/// Checks that `data` holds a whole number of rows of length `dim`; returns the row count.
pub fn rows_of(arg: &'static str, len: usize, dim: usize) -> Result<usize> {
    if dim == 0 || len % dim != 0 {
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

/// Rejects NaN and infinities, naming the first offending position.
pub fn check_finite(arg: &'static str, data: &[f32], dim: usize) -> Result<()> {
    match data.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(KvqError::NonFinite { arg, row: i / dim, col: i % dim, value: data[i] }),
    }
}
