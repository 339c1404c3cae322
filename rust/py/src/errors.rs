//! The only place where kvqrs-core errors become Python exceptions.

use kvqrs_core::KvqError;
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::PyErr;

create_exception!(
    kvqrs,
    KvqrsError,
    PyValueError,
    "Invalid input to a kvqrs function; the message names the argument, the expected and the actual value."
);

/// Converts core results into Python results (one mapping point, as tokenizers' `ToPyResult`).
pub struct ToPyResult<T>(pub Result<T, KvqError>);

impl<T> From<ToPyResult<T>> for pyo3::PyResult<T> {
    fn from(r: ToPyResult<T>) -> Self {
        r.0.map_err(|e| PyErr::new::<KvqrsError, _>(e.to_string()))
    }
}

/// Shorthand: `py_result(core_call)?`.
pub fn py_result<T>(r: Result<T, KvqError>) -> pyo3::PyResult<T> {
    ToPyResult(r).into()
}

/// A Python-side argument error raised by the binding itself (e.g. a non-contiguous array).
pub fn arg_error(msg: String) -> PyErr {
    PyErr::new::<KvqrsError, _>(msg)
}
