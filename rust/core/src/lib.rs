//! kvqrs-core: the numerical kernels of kvqrs, with no Python dependency.
//!
//! Every kernel follows `docs/kernels.md` (definitions and exact conventions). Inputs are
//! row-major `rows x dim` float32 slices; every function validates its sizes and returns
//! [`KvqError`] instead of panicking.

pub mod alloc;
pub mod decode_step;
pub mod dtype;
pub mod encoders;
pub mod error;
pub mod format;
pub mod kernels;
mod memo;
pub mod paged_write;
mod par;
pub mod reduce;
pub mod rng;
pub mod rows;
pub mod scalars;
pub mod simd;
pub mod store;
pub mod window;

pub use error::{KvqError, Result};
pub use simd::{Isa, PackPath};
