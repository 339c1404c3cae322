//! The row objects of `kvqrs.kernels.attention` read into the core's one row description
//! (`kvqrs_core::rows`): `Rows<B, S, F, T>` with `B` for a part of bytes, `S` for stored
//! scalars, `F` for float rows and `T` for a table (basis, mean), each whatever the entry
//! point passes (arrays for the fused kernel, part names for the layer store, places in a page
//! for the paged kernel). Every field is read by attribute name, as PyO3's derived readers do,
//! so a wrong object is a `TypeError` naming the class and field (`MSERows.codes`, the cause
//! chained) and never a panic; an object of no row class is a `TypeError` naming its class.

use kvqrs_core::rows::{Qjl, Rows, Run, ScalarParts, Side, TokenRun};
use numpy::PyReadonlyArray1;
use pyo3::exceptions::{PyAttributeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A flat float32 array (a basis or a mean).
pub type F32<'py> = PyReadonlyArray1<'py, f32>;

/// Stored scalars as Python hands them: `P`, or a `LogScalars` object (8-bit log codes and
/// their group exponent bytes, docs/kernels.md section 13, tried first: stored scalars are
/// never an object with `exps`).
pub struct Stored<B, P>(pub ScalarParts<B, P>);

/// One side of the cache as the binding reads it.
pub struct PyRows<B, S, F, T>(pub Rows<B, S, F, T>);

/// HeadQ's `SideRows` as the binding reads it.
pub struct PySide<B, S, T>(pub Side<B, S, T>);

/// Reads row class `class` with `f`. A field it lacks (an `AttributeError`) becomes a
/// `TypeError` naming the class, as a field of the wrong type is, so every malformed row
/// object raises the same kind of error.
pub fn read<'py, T>(
    obj: &Bound<'py, PyAny>,
    class: &str,
    f: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
) -> PyResult<T> {
    f(obj).map_err(|e| {
        let py = obj.py();
        if !e.is_instance_of::<PyAttributeError>(py) {
            return e;
        }
        let err = PyTypeError::new_err(format!("{class}: missing field ({e})"));
        err.set_cause(py, Some(e));
        err
    })
}

/// Field `name` of row class `class` read by `f`: a failure is a `TypeError` `failed to
/// extract field {class}.{name}` with the cause chained (a missing attribute propagates).
fn field<'py, T>(
    obj: &Bound<'py, PyAny>,
    (class, name): (&str, &str),
    f: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
) -> PyResult<T> {
    let value = obj.getattr(name)?;
    f(&value).map_err(|e| {
        let err = PyTypeError::new_err(format!("failed to extract field {class}.{name}"));
        err.set_cause(obj.py(), Some(e));
        err
    })
}

/// Field `name` of row class `class`, extracted as `T`.
fn get<'py, T: FromPyObject<'py>>(obj: &Bound<'py, PyAny>, class: &str, name: &str) -> PyResult<T> {
    field(obj, (class, name), |v| v.extract())
}

impl<'py, B: FromPyObject<'py>, P: FromPyObject<'py>> FromPyObject<'py> for Stored<B, P> {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if obj.hasattr("exps")? {
            let c = "LogScalars";
            Ok(Stored(ScalarParts::Log {
                codes: get(obj, c, "codes")?,
                exps: get(obj, c, "exps")?,
                group: get(obj, c, "group")?,
            }))
        } else {
            Ok(Stored(ScalarParts::Plain(obj.extract()?)))
        }
    }
}

/// The row classes without a mean, for errors.
const ROW_CLASSES: &str = "MSERows, UniformRows, DenseRows, ChannelRunRows or TokenRunRows";

fn qjl<'py, B, S>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Qjl<B, S>>>
where
    B: FromPyObject<'py>,
    S: FromPyObject<'py>,
{
    if obj.is_none() {
        return Ok(None);
    }
    let c = "QJLRows";
    Ok(Some(Qjl {
        signs: get(obj, c, "signs")?,
        norms: get(obj, c, "norms")?,
        seed: get(obj, c, "seed")?,
    }))
}

fn run<'py, B, S>(obj: &Bound<'py, PyAny>) -> PyResult<Run<B, S>>
where
    B: FromPyObject<'py>,
    S: FromPyObject<'py>,
{
    let c = "ChannelRun";
    Ok(Run {
        codes: get(obj, c, "codes")?,
        scales: get(obj, c, "scales")?,
        zeros: get(obj, c, "zeros")?,
        bits: get(obj, c, "bits")?,
        start: get(obj, c, "start")?,
        stop: get(obj, c, "stop")?,
    })
}

fn token_run<'py, B: FromPyObject<'py>>(obj: &Bound<'py, PyAny>) -> PyResult<TokenRun<B>> {
    let c = "TokenRun";
    Ok(TokenRun {
        codes: get(obj, c, "codes")?,
        bits: get(obj, c, "bits")?,
        start: get(obj, c, "start")?,
        stop: get(obj, c, "stop")?,
    })
}

/// Field `runs` of row class `class`, each item read by `each`.
fn runs<'py, R>(
    obj: &Bound<'py, PyAny>,
    class: &str,
    each: impl Fn(&Bound<'py, PyAny>) -> PyResult<R>,
) -> PyResult<Vec<R>> {
    field(obj, (class, "runs"), |v| {
        let items: Vec<Bound<'py, PyAny>> = v.extract()?;
        items.iter().map(&each).collect()
    })
}

/// Rows without a mean: the class is picked by the one field that no other row class has, so
/// a malformed object gets its own class's error (`failed to extract field MSERows.codes`)
/// rather than one per class.
fn base<'py, B, S, F, T>(obj: &Bound<'py, PyAny>) -> PyResult<Rows<B, S, F, T>>
where
    B: FromPyObject<'py>,
    S: FromPyObject<'py>,
    F: FromPyObject<'py>,
    T: FromPyObject<'py>,
{
    // A dict has a `values` method: refuse it by name (the binding once took dicts).
    if obj.is_instance_of::<PyDict>() {
        return Err(PyTypeError::new_err(format!(
            "expected a row object ({ROW_CLASSES}), got a dict"
        )));
    }
    // Runs with one scale per token (`scales`) are token runs, else per-channel runs.
    if obj.hasattr("runs")? && obj.hasattr("scales")? {
        read(obj, "TokenRunRows", |o| {
            let c = "TokenRunRows";
            Ok(Rows::TokenRuns {
                runs: runs(o, c, token_run)?,
                scales: get(o, c, "scales")?,
                basis: get(o, c, "basis")?,
                basis_heads: get(o, c, "basis_heads")?,
            })
        })
    } else if obj.hasattr("runs")? {
        read(obj, "ChannelRunRows", |o| {
            let c = "ChannelRunRows";
            Ok(Rows::ChannelRuns {
                runs: runs(o, c, run)?,
                group: get(o, c, "group")?,
                basis: get(o, c, "basis")?,
                basis_heads: get(o, c, "basis_heads")?,
            })
        })
    } else if obj.hasattr("per_channel")? {
        read(obj, "UniformRows", |o| {
            let c = "UniformRows";
            let (codes, scales, zeros) = (
                get(o, c, "codes")?,
                get(o, c, "scales")?,
                get(o, c, "zeros")?,
            );
            let (bits, group) = (get(o, c, "bits")?, get(o, c, "group")?);
            let per_channel: bool = get(o, c, "per_channel")?;
            let seed = get(o, c, "seed")?;
            Ok(if per_channel {
                Rows::UniformChannels {
                    codes,
                    scales,
                    zeros,
                    bits,
                    group,
                }
            } else {
                Rows::UniformTokens {
                    codes,
                    scales,
                    zeros,
                    bits,
                    group,
                    seed,
                }
            })
        })
    } else if obj.hasattr("qjl")? {
        read(obj, "MSERows", |o| {
            let c = "MSERows";
            Ok(Rows::Mse {
                codes: get(o, c, "codes")?,
                norms: get(o, c, "norms")?,
                bits: get(o, c, "bits")?,
                seed: get(o, c, "seed")?,
                qjl: field(o, (c, "qjl"), qjl)?,
            })
        })
    } else if obj.hasattr("values")? {
        read(obj, "DenseRows", |o| {
            Ok(Rows::Dense(get(o, "DenseRows", "values")?))
        })
    } else {
        Err(PyTypeError::new_err(format!(
            "expected {ROW_CLASSES}, got {}",
            obj.get_type().name()?
        )))
    }
}

/// `CentredRows` is the row class with `rows` (rows without a mean, the flat mean and its
/// count: a mean inside a mean does not extract); anything else is read as rows without a
/// mean.
impl<'py, B, S, F, T> FromPyObject<'py> for PyRows<B, S, F, T>
where
    B: FromPyObject<'py>,
    S: FromPyObject<'py>,
    F: FromPyObject<'py>,
    T: FromPyObject<'py>,
{
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if !obj.hasattr("rows")? {
            return Ok(PyRows(base(obj)?));
        }
        read(obj, "CentredRows", |o| {
            let c = "CentredRows";
            Ok(PyRows(Rows::Centred {
                rows: Box::new(field(o, (c, "rows"), base)?),
                mean: get(o, c, "mean")?,
                mean_heads: get(o, c, "mean_heads")?,
            }))
        })
    }
}

impl<'py, B, S, T> FromPyObject<'py> for PySide<B, S, T>
where
    B: FromPyObject<'py>,
    S: FromPyObject<'py>,
    T: FromPyObject<'py>,
{
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        read(obj, "SideRows", |o| {
            let c = "SideRows";
            Ok(PySide(Side {
                codes: get(o, c, "codes")?,
                scales: get(o, c, "scales")?,
                basis: get(o, c, "basis")?,
                bits: get(o, c, "bits")?,
                sign: get(o, c, "sign")?,
                rank: get(o, c, "rank")?,
                basis_heads: get(o, c, "basis_heads")?,
            }))
        })
    }
}
