//! Binding of the fused decode attention kernel. Keys, values and the HeadQ side code arrive as
//! the typed row objects of `kvqrs.kernels.attention` (`MSERows`, `UniformRows`, `DenseRows`,
//! `ChannelRunRows` and its `ChannelRun`s, `CentredRows` around any of them, the flattened
//! `SideRows`), read by attribute name; the Python wrapper has checked every
//! array against the row format's declared layout and flattened it. Everything is borrowed and
//! the GIL is released for the kernel.

use kvqrs_core::kernels::attention::{
    decode_attention as core_attention, ChannelRun, CodedRows, Layout, QjlRows, SideRows,
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

/// `ChannelRun`: one run of basis columns coded per channel.
#[derive(FromPyObject)]
pub struct PyRun<'py> {
    codes: Bytes<'py>,
    scales: Scalars<'py>,
    zeros: Scalars<'py>,
    bits: u32,
    start: usize,
    stop: usize,
}

/// `ChannelRunRows` (flattened basis, with its count).
#[derive(FromPyObject)]
pub struct PyRuns<'py> {
    runs: Vec<PyRun<'py>>,
    group: usize,
    basis: PyReadonlyArray1<'py, f32>,
    basis_heads: usize,
}

/// One side of the cache without a mean, recognised by its fields.
#[derive(FromPyObject)]
pub enum PyBase<'py> {
    Mse(PyMse<'py>),
    Uniform(PyUniform<'py>),
    Dense(PyDense<'py>),
    Runs(PyRuns<'py>),
}

/// `CentredRows` (flattened mean, with its count) around other rows.
#[derive(FromPyObject)]
pub struct PyCentred<'py> {
    rows: PyBase<'py>,
    mean: PyReadonlyArray1<'py, f32>,
    mean_heads: usize,
}

/// One side of the cache.
#[derive(FromPyObject)]
pub enum PyRows<'py> {
    Centred(PyCentred<'py>),
    Base(PyBase<'py>),
}

impl PyRows<'_> {
    fn base(&self) -> &PyBase<'_> {
        match self {
            PyRows::Centred(c) => &c.rows,
            PyRows::Base(b) => b,
        }
    }

    /// The borrowed runs of `ChannelRunRows` (empty for other rows).
    fn runs(&self, side: &str) -> PyResult<Vec<ChannelRun<'_>>> {
        let PyBase::Runs(r) = self.base() else {
            return Ok(Vec::new());
        };
        let name = |part: &str| format!("{side}.runs.{part}");
        r.runs
            .iter()
            .map(|run| {
                Ok(ChannelRun {
                    codes: slice(&run.codes, &name("codes"))?,
                    scales: run.scales.view(&name("scales"))?,
                    zeros: run.zeros.view(&name("zeros"))?,
                    bits: run.bits,
                    start: run.start,
                    stop: run.stop,
                })
            })
            .collect()
    }

    /// `inner` around the mean of `CentredRows`, or `inner` itself.
    fn wrap<'a>(&'a self, side: &str, inner: &'a CodedRows<'a>) -> PyResult<CodedRows<'a>> {
        Ok(match self {
            PyRows::Centred(c) => CodedRows::Centred {
                rows: inner,
                mean: slice(&c.mean, &format!("{side}.mean"))?,
                mean_heads: c.mean_heads,
            },
            PyRows::Base(_) => *inner,
        })
    }
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

impl PyBase<'_> {
    /// The borrowed core rows (`side` names the arguments in errors: `keys` or `values`;
    /// `runs` are those of [`PyRows::runs`]).
    fn rows<'a>(&'a self, side: &str, runs: &'a [ChannelRun<'a>]) -> PyResult<CodedRows<'a>> {
        let name = |part: &str| format!("{side}.{part}");
        Ok(match self {
            PyBase::Mse(m) => CodedRows::Mse {
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
            PyBase::Uniform(u) if u.per_channel => CodedRows::UniformChannels {
                codes: slice(&u.codes, &name("codes"))?,
                scales: u.scales.view(&name("scales"))?,
                zeros: u.zeros.view(&name("zeros"))?,
                bits: u.bits,
                group: u.group,
            },
            PyBase::Uniform(u) => CodedRows::UniformTokens {
                codes: slice(&u.codes, &name("codes"))?,
                scales: u.scales.view(&name("scales"))?,
                zeros: u.zeros.view(&name("zeros"))?,
                bits: u.bits,
                group: u.group,
                seed: u.seed,
            },
            PyBase::Dense(x) => CodedRows::Dense(slice(&x.values, &name("values"))?),
            PyBase::Runs(r) => CodedRows::ChannelRuns {
                runs,
                group: r.group,
                basis: slice(&r.basis, &name("basis"))?,
                basis_heads: r.basis_heads,
            },
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
    let (kruns, vruns) = (keys.runs("keys")?, values.runs("values")?);
    let kin = keys.base().rows("keys", &kruns)?;
    let vin = values.base().rows("values", &vruns)?;
    let (kr, vr) = (keys.wrap("keys", &kin)?, values.wrap("values", &vin)?);
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
