//! Binding of the fused decode attention kernel. Keys, values and the HeadQ side code arrive as
//! the typed row objects of `kvqrs.kernels.attention` (`MSERows`, `UniformRows`, `DenseRows`,
//! `ChannelRunRows` and its `ChannelRun`s, `TokenRunRows` and its `TokenRun`s, `CentredRows`
//! around any of them, `SideRows`; see `rows.rs`) with their arrays in place, read into the
//! core's row description over arrays; the Python wrapper has checked every array against the
//! row format's declared layout and flattened it. Everything is borrowed and the GIL is released for the kernel.

use kvqrs_core::kernels::attention::{decode_attention as core_attention, AttentionShape};
use kvqrs_core::rows::{Field, Resolve, ScalarParts};
use kvqrs_core::scalars::{LogView, ScalarView};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::arrays::{slice, slice_at, Scalars};
use crate::errors::py_result;
use crate::rows::{PyRows, PySide, Stored, F32};

type Bytes<'py> = PyReadonlyArray1<'py, u8>;
/// Stored scalars with their arrays: float16 / float32, or log codes and exponent bytes.
type ArrayScalars<'py> = Stored<Bytes<'py>, Scalars<'py>>;
/// One side of the cache with its arrays.
type ArrayRows<'py> = PyRows<Bytes<'py>, ArrayScalars<'py>, F32<'py>, F32<'py>>;
type ArraySide<'py> = PySide<Bytes<'py>, ArrayScalars<'py>, F32<'py>>;

/// Borrows every array of a description as the kernel reads it (no copy); a strided array is
/// an error naming its field (`keys.qjl.signs`, `values.norms.exps`).
struct Borrow;

impl<'a, 'py: 'a> Resolve<'a, Bytes<'py>, ArrayScalars<'py>, F32<'py>, F32<'py>> for Borrow {
    type Bytes = &'a [u8];
    type Scalars = ScalarView<'a>;
    type Floats = &'a [f32];
    type Table = &'a [f32];
    type Error = PyErr;
    fn bytes(&mut self, a: &'a Bytes<'py>, at: Field<'_>) -> PyResult<&'a [u8]> {
        slice_at(a, at)
    }
    fn scalars(&mut self, s: &'a ArrayScalars<'py>, at: Field<'_>) -> PyResult<ScalarView<'a>> {
        Ok(match &s.0 {
            ScalarParts::Plain(p) => p.view(at)?,
            ScalarParts::Log { codes, exps, group } => ScalarView::Log(LogView {
                codes: slice_at(codes, at)?,
                exps: slice_at(exps, format_args!("{at}.exps"))?,
                group: *group,
                row: 0,
            }),
        })
    }
    fn floats(&mut self, a: &'a F32<'py>, at: Field<'_>) -> PyResult<&'a [f32]> {
        slice_at(a, at)
    }
    fn table(&mut self, a: &'a F32<'py>, at: Field<'_>) -> PyResult<&'a [f32]> {
        slice_at(a, at)
    }
}

type F32Out<'py> = Bound<'py, PyArray1<f32>>;
type AttentionOut<'py> = (F32Out<'py>, F32Out<'py>, F32Out<'py>);

/// Returns (out float32 flat heads x rows x d, lse float32 heads x rows, probs float32 flat or
/// empty).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (q, keys, values, side, heads, rows, tokens, head_dim, scale, probs))]
pub fn decode_attention<'py>(
    py: Python<'py>,
    q: PyReadonlyArray1<'py, f32>,
    keys: ArrayRows<'py>,
    values: ArrayRows<'py>,
    side: Option<Bound<'py, PyAny>>,
    heads: usize,
    rows: usize,
    tokens: usize,
    head_dim: usize,
    scale: f32,
    probs: bool,
) -> PyResult<AttentionOut<'py>> {
    let qs = slice(&q, "q")?;
    let kr = keys.0.map("keys", &mut Borrow)?;
    let vr = values.0.map("values", &mut Borrow)?;
    let side: Option<ArraySide<'py>> = side.map(|s| s.extract()).transpose()?;
    let sr = match &side {
        Some(s) => Some(s.0.map(&mut Borrow)?),
        None => None,
    };
    let layout = AttentionShape::new(heads, rows, tokens, head_dim, scale);
    let res =
        py_result(py.allow_threads(|| core_attention(qs, &layout, &kr, sr.as_ref(), &vr, probs)))?;
    Ok((
        PyArray1::from_vec(py, res.out),
        PyArray1::from_vec(py, res.lse),
        PyArray1::from_vec(py, res.probs),
    ))
}
