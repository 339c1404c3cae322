//! The row objects of `kvqrs.kernels.attention` as the binding reads them: one typed struct per
//! Python row class, extracted by attribute name (`#[derive(FromPyObject)]`), so a wrong object
//! is a `TypeError` naming the class and field (`MSERows.codes`, the cause chained) and never a
//! panic; an object of no row class is a `TypeError` naming its class.
//!
//! Every row format is declared once here and read by three entry points that differ only in
//! what stands for a stored part, hence the type parameters: `B` for a part of bytes (packed
//! codes, QJL signs), `S` for stored scalars (norms, scales, zero points), `F` for float32 rows
//! (`DenseRows`). The fused kernel passes the flat arrays, the layer store the part names,
//! the paged kernel each part's place in a page. Bases and means are flat float32 arrays with
//! their per-head count in every case.

use numpy::PyReadonlyArray1;
use pyo3::exceptions::{PyAttributeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A flat float32 array (a basis or a mean).
pub type F32<'py> = PyReadonlyArray1<'py, f32>;

/// `QJLRows`: the sketch of the rotated residual.
#[derive(FromPyObject)]
pub struct QJLRows<B, S> {
    pub signs: B,
    pub norms: S,
    pub seed: u64,
}

/// `LogScalars`: 8-bit log codes and their group exponent bytes (docs/kernels.md section 13).
#[derive(FromPyObject)]
pub struct LogNorms<B> {
    pub codes: B,
    pub exps: B,
    pub group: usize,
}

/// The norms of `MSERows`: stored scalars, or `LogScalars` (tried first: stored scalars are
/// never an object with `codes`, `exps` and `group`).
#[derive(FromPyObject)]
pub enum Norms<B, S> {
    Log(LogNorms<B>),
    Plain(S),
}

/// `MSERows`.
#[derive(FromPyObject)]
pub struct MSERows<B, S> {
    pub codes: B,
    pub norms: Norms<B, S>,
    pub bits: u32,
    pub seed: Option<u64>,
    pub qjl: Option<QJLRows<B, S>>,
}

/// `UniformRows` (per token or per channel).
#[derive(FromPyObject)]
pub struct UniformRows<B, S> {
    pub codes: B,
    pub scales: S,
    pub zeros: S,
    pub bits: u32,
    pub group: usize,
    pub per_channel: bool,
    pub seed: Option<u64>,
}

/// `DenseRows`.
#[derive(FromPyObject)]
pub struct DenseRows<F> {
    pub values: F,
}

/// `ChannelRun`: one run of basis columns coded per channel.
#[derive(FromPyObject)]
pub struct ChannelRun<B, S> {
    pub codes: B,
    pub scales: S,
    pub zeros: S,
    pub bits: u32,
    pub start: usize,
    pub stop: usize,
}

/// `ChannelRunRows` as handed to the binding: the flat basis and its count.
#[derive(FromPyObject)]
pub struct ChannelRunRows<'py, B, S> {
    pub runs: Vec<ChannelRun<B, S>>,
    pub group: usize,
    pub basis: F32<'py>,
    pub basis_heads: usize,
}

/// One side of the cache without a mean.
pub enum BaseRows<'py, B, S, F> {
    Mse(MSERows<B, S>),
    Uniform(UniformRows<B, S>),
    Dense(DenseRows<F>),
    Runs(ChannelRunRows<'py, B, S>),
}

/// Reads row class `class` with its derived reader. A field it lacks (the reader's
/// `AttributeError`) becomes a `TypeError` naming the class, as a field of the wrong type is,
/// so every malformed row object raises the same kind of error.
pub fn read<'py, T: FromPyObject<'py>>(obj: &Bound<'py, PyAny>, class: &str) -> PyResult<T> {
    obj.extract().map_err(|e| {
        let py = obj.py();
        if !e.is_instance_of::<PyAttributeError>(py) {
            return e;
        }
        let err = PyTypeError::new_err(format!("{class}: missing field ({e})"));
        err.set_cause(py, Some(e));
        err
    })
}

/// The row classes the binding reads, for errors.
const ROW_CLASSES: &str = "MSERows, UniformRows, DenseRows or ChannelRunRows";

/// Picks the class by the one field that no other row class has and extracts it with its
/// derived reader, so a malformed object gets its own class's error (`failed to extract
/// field MSERows.codes`) rather than one per class.
impl<'py, B, S, F> FromPyObject<'py> for BaseRows<'py, B, S, F>
where
    B: FromPyObject<'py>,
    S: FromPyObject<'py>,
    F: FromPyObject<'py>,
{
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        // A dict has a `values` method: refuse it by name (the binding once took dicts).
        if obj.is_instance_of::<PyDict>() {
            return Err(PyTypeError::new_err(format!(
                "expected a row object ({ROW_CLASSES}), got a dict"
            )));
        }
        if obj.hasattr("runs")? {
            Ok(Self::Runs(read(obj, "ChannelRunRows")?))
        } else if obj.hasattr("per_channel")? {
            Ok(Self::Uniform(read(obj, "UniformRows")?))
        } else if obj.hasattr("qjl")? {
            Ok(Self::Mse(read(obj, "MSERows")?))
        } else if obj.hasattr("values")? {
            Ok(Self::Dense(read(obj, "DenseRows")?))
        } else {
            Err(PyTypeError::new_err(format!(
                "expected {ROW_CLASSES}, got {}",
                obj.get_type().name()?
            )))
        }
    }
}

/// `CentredRows` as handed to the binding: rows without a mean, the flat mean and its count
/// (a mean inside a mean does not extract).
#[derive(FromPyObject)]
pub struct CentredRows<'py, B, S, F> {
    pub rows: BaseRows<'py, B, S, F>,
    pub mean: F32<'py>,
    pub mean_heads: usize,
}

/// One side of the cache.
pub enum Rows<'py, B, S, F> {
    Centred(CentredRows<'py, B, S, F>),
    Base(BaseRows<'py, B, S, F>),
}

/// `CentredRows` is the row class with `rows`; anything else is read as rows without a mean.
impl<'py, B, S, F> FromPyObject<'py> for Rows<'py, B, S, F>
where
    B: FromPyObject<'py>,
    S: FromPyObject<'py>,
    F: FromPyObject<'py>,
{
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if obj.hasattr("rows")? {
            Ok(Self::Centred(read(obj, "CentredRows")?))
        } else {
            Ok(Self::Base(obj.extract()?))
        }
    }
}

impl<'py, B, S, F> Rows<'py, B, S, F> {
    /// The rows without their mean.
    pub fn base(&self) -> &BaseRows<'py, B, S, F> {
        match self {
            Rows::Centred(c) => &c.rows,
            Rows::Base(b) => b,
        }
    }
}

/// `SideRows` (HeadQ) as handed to the binding: the flat basis with its rank and count.
#[derive(FromPyObject)]
pub struct SideRows<'py, B, S> {
    pub codes: B,
    pub scales: S,
    pub basis: F32<'py>,
    pub bits: u32,
    pub sign: f32,
    pub rank: usize,
    pub basis_heads: usize,
}
