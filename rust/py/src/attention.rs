//! Binding of the fused decode attention kernel. Keys, values and the HeadQ side code arrive as
//! the typed row objects of `kvqrs.kernels.attention` (`MSERows`, `UniformRows`, `DenseRows`,
//! the flattened `SideRows`), read by attribute name; the Python wrapper has checked every
//! array against the row format's declared layout and flattened it. Everything is borrowed and
//! the GIL is released for the kernel.

use kvqrs_core::kernels::attention::{
    decode_attention as core_attention, CodedRows, Layout, QjlRows, SideRows,
};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::arrays::{slice, Scalars};
use crate::errors::py_result;

type Bytes<'py> = PyReadonlyArray1<'py, u8>;

/// `QJLRows`: the sketch of the rotated residual.
#[derive(FromPyObject)]
pub struct PyQjl<'py> {
    signs: Bytes<'py>,
    norms: Scalars<'py>,
    seed: u64,
}

/// `MSERows`.
#[derive(FromPyObject)]
pub struct PyMse<'py> {
    codes: Bytes<'py>,
    norms: Scalars<'py>,
    bits: u32,
    seed: Option<u64>,
    qjl: Option<PyQjl<'py>>,
}

/// `UniformRows` (per token or per channel).
#[derive(FromPyObject)]
pub struct PyUniform<'py> {
    codes: Bytes<'py>,
    scales: Scalars<'py>,
    zeros: Scalars<'py>,
    bits: u32,
    group: usize,
    per_channel: bool,
    seed: Option<u64>,
}

/// `DenseRows`.
#[derive(FromPyObject)]
pub struct PyDense<'py> {
    values: PyReadonlyArray1<'py, f32>,
}

/// One side of the cache, recognised by its fields.
#[derive(FromPyObject)]
pub enum PyRows<'py> {
    Mse(PyMse<'py>),
    Uniform(PyUniform<'py>),
    Dense(PyDense<'py>),
}

/// The flattened `SideRows` (HeadQ).
#[derive(FromPyObject)]
pub struct PySide<'py> {
    codes: Bytes<'py>,
    scales: Scalars<'py>,
    basis: PyReadonlyArray1<'py, f32>,
    bits: u32,
    sign: f32,
    rank: usize,
    basis_heads: usize,
}

impl PyRows<'_> {
    /// The borrowed core rows (`side` names the arguments in errors: `keys` or `values`).
    fn rows(&self, side: &str) -> PyResult<CodedRows<'_>> {
        let name = |part: &str| format!("{side}.{part}");
        Ok(match self {
            PyRows::Mse(m) => CodedRows::Mse {
                codes: slice(&m.codes, &name("codes"))?,
                norms: m.norms.view(&name("norms"))?,
                bits: m.bits,
                seed: m.seed,
                qjl: match &m.qjl {
                    None => None,
                    Some(q) => Some(QjlRows {
                        signs: slice(&q.signs, &name("qjl.signs"))?,
                        norms: q.norms.view(&name("qjl.norms"))?,
                        seed: q.seed,
                    }),
                },
            },
            PyRows::Uniform(u) if u.per_channel => CodedRows::UniformChannels {
                codes: slice(&u.codes, &name("codes"))?,
                scales: u.scales.view(&name("scales"))?,
                zeros: u.zeros.view(&name("zeros"))?,
                bits: u.bits,
                group: u.group,
            },
            PyRows::Uniform(u) => CodedRows::UniformTokens {
                codes: slice(&u.codes, &name("codes"))?,
                scales: u.scales.view(&name("scales"))?,
                zeros: u.zeros.view(&name("zeros"))?,
                bits: u.bits,
                group: u.group,
                seed: u.seed,
            },
            PyRows::Dense(x) => CodedRows::Dense(slice(&x.values, &name("values"))?),
        })
    }
}

impl PySide<'_> {
    fn rows(&self) -> PyResult<SideRows<'_>> {
        Ok(SideRows {
            codes: slice(&self.codes, "side.codes")?,
            scales: self.scales.view("side.scales")?,
            basis: slice(&self.basis, "side.basis")?,
            basis_heads: self.basis_heads,
            rank: self.rank,
            bits: self.bits,
            sign: self.sign,
        })
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
    keys: PyRows<'py>,
    values: PyRows<'py>,
    side: Option<PySide<'py>>,
    heads: usize,
    rows: usize,
    tokens: usize,
    head_dim: usize,
    scale: f32,
    probs: bool,
) -> PyResult<AttentionOut<'py>> {
    let qs = slice(&q, "q")?;
    let (kr, vr) = (keys.rows("keys")?, values.rows("values")?);
    let sr = side.as_ref().map(PySide::rows).transpose()?;
    let layout = Layout {
        heads,
        rows,
        tokens,
        head_dim,
        scale,
    };
    let res =
        py_result(py.allow_threads(|| core_attention(qs, &layout, &kr, sr.as_ref(), &vr, probs)))?;
    Ok((
        PyArray1::from_vec(py, res.out),
        PyArray1::from_vec(py, res.lse),
        PyArray1::from_vec(py, res.probs),
    ))
}
