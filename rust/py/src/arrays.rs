//! Borrowing NumPy buffers and building outputs. The binding takes flat, C-contiguous arrays;
//! the Python layer reshapes and makes the one explicit contiguous copy when needed.

use half::f16;
use half::slice::HalfFloatSliceExt;
use kvqrs_core::dtype::Dtype;
use kvqrs_core::scalars::{FloatView, ScalarPlane, ScalarView};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::errors::arg_error;

/// Borrows a contiguous 1-D array as a slice, or raises naming the argument.
pub fn slice<'a, T: numpy::Element>(
    arr: &'a PyReadonlyArray1<'_, T>,
    arg: &str,
) -> PyResult<&'a [T]> {
    arr.as_slice().map_err(|_| {
        arg_error(format!(
            "{arg}: expected a C-contiguous array, got a strided view"
        ))
    })
}

/// Borrows a contiguous 1-D array as a slice, or raises naming the argument `at` (formatted
/// only then).
pub fn slice_at<'a, T: numpy::Element>(
    arr: &'a PyReadonlyArray1<'_, T>,
    at: impl std::fmt::Display,
) -> PyResult<&'a [T]> {
    arr.as_slice().map_err(|_| {
        arg_error(format!(
            "{at}: expected a C-contiguous array, got a strided view"
        ))
    })
}

/// Stored scalars (norms, scales) as handed in from Python: float16 or float32.
#[derive(FromPyObject)]
pub enum Scalars<'py> {
    /// float16 storage.
    F16(PyReadonlyArray1<'py, f16>),
    /// float32 storage.
    F32(PyReadonlyArray1<'py, f32>),
}

impl Scalars<'_> {
    /// Borrows the caller's buffer as a core scalar view (no copy).
    pub fn view(&self, arg: impl std::fmt::Display) -> PyResult<ScalarView<'_>> {
        let floats = match self {
            Scalars::F16(a) => FloatView::F16(slice_at(a, arg)?.reinterpret_cast()),
            Scalars::F32(a) => FloatView::F32(slice_at(a, arg)?),
        };
        Ok(ScalarView::Float(floats))
    }
}

/// The core dtype of a dtype's NumPy name (`uint8`, `float16`, `float32`, `float64`,
/// `bfloat16`: how dtypes cross the binding), or an error naming `what`.
pub fn dtype(name: &str, what: &str) -> PyResult<Dtype> {
    Dtype::from_name(name).ok_or_else(|| {
        arg_error(format!(
            "{what}: expected a dtype name (uint8, float16, float32, float64, bfloat16), got {name:?}"
        ))
    })
}

/// A core scalar plane as a NumPy float16 or float32 array.
pub fn plane_to_py<'py>(py: Python<'py>, plane: ScalarPlane) -> Bound<'py, PyAny> {
    match plane {
        ScalarPlane::F16(v) => {
            PyArray1::from_vec(py, v.into_iter().map(f16::from_bits).collect::<Vec<_>>()).into_any()
        }
        ScalarPlane::F32(v) => PyArray1::from_vec(py, v).into_any(),
    }
}
