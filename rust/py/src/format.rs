//! Binding of the compressed-cache container (kvqrs_core::format): sections in and out as
//! `(name, dtype code, shape, bytes)` tuples; the Python layer (kvqrs.format) gives them meaning.

use kvqrs_core::format::{self, Dtype, Section};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{arg_error, py_result};

type PySection<'py> = (String, u8, Vec<u64>, Bound<'py, PyBytes>);

/// Serialize sections into container bytes.
#[pyfunction]
pub fn container_write<'py>(
    py: Python<'py>,
    sections: Vec<PySection<'py>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let sections = sections
        .into_iter()
        .map(|(name, code, shape, payload)| {
            let dtype = Dtype::from_code(code).ok_or_else(|| {
                arg_error(format!("sections: unknown dtype code {code} for {name:?}"))
            })?;
            Ok(Section {
                name,
                dtype,
                shape,
                payload: payload.as_bytes().to_vec(),
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let bytes = py.allow_threads(|| format::write(&sections));
    Ok(PyBytes::new(py, &py_result(bytes)?))
}

/// Parse and verify container bytes into sections.
#[pyfunction]
pub fn container_read<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Vec<PySection<'py>>> {
    let sections = py_result(py.allow_threads(|| format::read(data)))?;
    Ok(sections
        .into_iter()
        .map(|s| (s.name, s.dtype as u8, s.shape, PyBytes::new(py, &s.payload)))
        .collect())
}
