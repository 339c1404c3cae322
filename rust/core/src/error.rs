//! The one error type of kvqrs-core. Each variant names the offending argument, what was
//! expected and what was found, so the Python exception message is actionable on its own.

use thiserror::Error;

/// Result alias used by every fallible kernel.
pub type Result<T> = std::result::Result<T, KvqError>;

/// Every way a kernel call can be rejected.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum KvqError {
    /// A bit width outside the supported range (`min..=max`).
    #[error("{arg}: expected a bit width in {min}..{max}, got {actual}")]
    InvalidBits {
        arg: &'static str,
        min: u32,
        max: u32,
        actual: i64,
    },

    /// A dimension (head_dim, rank, sketch size, count) that is not allowed.
    #[error("{arg}: expected {expected}, got {actual}")]
    InvalidDimension {
        arg: &'static str,
        expected: String,
        actual: i64,
    },

    /// A real-valued argument (a logit scale) outside its allowed range.
    #[error("{arg}: expected {expected}, got {value}")]
    InvalidValue {
        arg: &'static str,
        expected: &'static str,
        value: f64,
    },

    /// A buffer whose length does not match the shape implied by the other arguments.
    #[error("{arg}: expected {expected}, got {actual}")]
    ShapeMismatch {
        arg: &'static str,
        expected: String,
        actual: String,
    },

    /// A code that does not fit in the declared bit width.
    #[error("{arg}: code {value} at row {row}, position {col} does not fit in {bits} bits (expected < {limit})")]
    CodeOutOfRange {
        arg: &'static str,
        row: usize,
        col: usize,
        value: u32,
        bits: u32,
        limit: u32,
    },

    /// NaN or infinity where a finite value is required.
    #[error("{arg}: expected finite values, got {value} at row {row}, position {col}")]
    NonFinite {
        arg: &'static str,
        row: usize,
        col: usize,
        value: f32,
    },

    /// An input value that must be finite and non-negative (a log-coded scalar) and is not.
    #[error(
        "{arg}: expected finite non-negative values, got {value} at row {row}, position {col}"
    )]
    NegativeOrNonFinite {
        arg: &'static str,
        row: usize,
        col: usize,
        value: f32,
    },

    /// A stored scalar (norm, scale) that is negative or not finite.
    #[error("{arg}: expected finite stored scalars (non-negative for norms and scales), got {value} at row {row}")]
    InvalidScalar {
        arg: &'static str,
        row: usize,
        value: f32,
    },

    /// The vector norm of a row exceeds the float32 range.
    #[error("{arg}: row {row} overflows float32 (expected values whose norm, range or result stays below 3.4e38)")]
    NormOverflow { arg: &'static str, row: usize },

    /// A row whose absmax scale (its largest coded magnitude) rounds to float16 infinity.
    #[error("{arg}: absmax scale overflows float16 at row {row} (its largest coded magnitude is {value}; expected below 65520, which rounds to float16's largest finite value 65504)")]
    ScaleOverflow {
        arg: &'static str,
        row: usize,
        value: f32,
    },

    /// A basis that is not usable (wrong shape or non-finite entries).
    #[error("{arg}: {reason}")]
    InvalidBasis { arg: &'static str, reason: String },

    /// Bytes that are not a valid kvqrs container (truncated, altered, hostile).
    #[error("compressed cache: {what}")]
    CorruptData { what: String },

    /// An instruction-set path this CPU cannot run.
    #[error("isa: expected one of the supported paths ({available}), got {requested}")]
    UnsupportedIsa {
        requested: String,
        available: String,
    },

    /// A bit-packing path this CPU cannot run.
    #[error("pack path: {requested} is not supported here ({why}); supported: {available}")]
    UnsupportedPackPath {
        requested: String,
        why: String,
        available: String,
    },
}
