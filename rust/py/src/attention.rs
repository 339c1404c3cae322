//! Binding of the fused decode attention kernel. Keys, values and the HeadQ side code arrive as
//! the typed row objects of `kvqrs.kernels.attention` (`MSERows`, `UniformRows`, `DenseRows`,
//! `ChannelRunRows` and its `ChannelRun`s, `CentredRows` around any of them, `SideRows`; see
//! `rows.rs`) with their arrays in place; the Python wrapper has checked every
//! array against the row format's declared layout and flattened it. Everything is borrowed and
//! the GIL is released for the kernel.

use kvqrs_core::kernels::attention::{
    decode_attention as core_attention, AttentionShape, ChannelRun, CodedRows, QjlRows,
    SideRows as CoreSide,
};
use kvqrs_core::scalars::{LogView, ScalarView};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::arrays::{slice, Scalars};
use crate::errors::py_result;
use crate::rows::{read, BaseRows, Norms, Rows, SideRows, F32};

type Bytes<'py> = PyReadonlyArray1<'py, u8>;
/// One side of the cache with its arrays.
type ArrayRows<'py> = Rows<'py, Bytes<'py>, Scalars<'py>, F32<'py>>;
type ArrayBase<'py> = BaseRows<'py, Bytes<'py>, Scalars<'py>, F32<'py>>;
type ArraySide<'py> = SideRows<'py, Bytes<'py>, Scalars<'py>>;
type Groups<'a> = (&'a [u8], ScalarView<'a>, ScalarView<'a>);

/// The borrowed runs of `ChannelRunRows` (empty for other rows).
fn runs<'a>(rows: &'a ArrayRows<'_>, side: &str) -> PyResult<Vec<ChannelRun<'a>>> {
    let BaseRows::Runs(r) = rows.base() else {
        return Ok(Vec::new());
    };
    let name = |part: &str| format!("{side}.runs.{part}");
    r.runs
        .iter()
        .map(|run| {
            let (codes, scales, zeros) = groups(&run.codes, &run.scales, &run.zeros, name)?;
            Ok(ChannelRun {
                codes,
                scales,
                zeros,
                bits: run.bits,
                start: run.start,
                stop: run.stop,
            })
        })
        .collect()
}

/// The borrowed codes, scales and zero points of uniform groups (`name` names each in errors).
fn groups<'a>(
    codes: &'a Bytes<'_>,
    scales: &'a Scalars<'_>,
    zeros: &'a Scalars<'_>,
    name: impl Fn(&str) -> String,
) -> PyResult<Groups<'a>> {
    Ok((
        slice(codes, &name("codes"))?,
        scales.view(&name("scales"))?,
        zeros.view(&name("zeros"))?,
    ))
}

/// The borrowed norms of `MSERows` (`name` names them in errors, `exps_name` the exponent
/// bytes of log-coded ones); log-coded norms get their row length from the kernel's layout.
fn norms<'a>(
    n: &'a Norms<Bytes<'_>, Scalars<'_>>,
    name: &str,
    exps_name: &str,
) -> PyResult<ScalarView<'a>> {
    Ok(match n {
        Norms::Plain(s) => s.view(name)?,
        Norms::Log(l) => ScalarView::Log(LogView {
            codes: slice(&l.codes, name)?,
            exps: slice(&l.exps, exps_name)?,
            group: l.group,
            row: 0,
        }),
    })
}

/// `inner` around the mean of `CentredRows`, or `inner` itself.
fn wrap<'a>(
    rows: &'a ArrayRows<'_>,
    side: &str,
    inner: &'a CodedRows<'a>,
) -> PyResult<CodedRows<'a>> {
    Ok(match rows {
        Rows::Centred(c) => CodedRows::Centred {
            rows: inner,
            mean: slice(&c.mean, &format!("{side}.mean"))?,
            mean_heads: c.mean_heads,
        },
        Rows::Base(_) => *inner,
    })
}

/// The borrowed core rows (`side` names the arguments in errors: `keys` or `values`; `runs`
/// are those of [`runs`]).
fn base_rows<'a>(
    base: &'a ArrayBase<'_>,
    side: &str,
    runs: &'a [ChannelRun<'a>],
) -> PyResult<CodedRows<'a>> {
    let name = |part: &str| format!("{side}.{part}");
    Ok(match base {
        BaseRows::Mse(m) => CodedRows::Mse {
            codes: slice(&m.codes, &name("codes"))?,
            norms: norms(&m.norms, &name("norms"), &name("norm_exps"))?,
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
        BaseRows::Uniform(u) => {
            let (codes, scales, zeros) = groups(&u.codes, &u.scales, &u.zeros, name)?;
            let (bits, group) = (u.bits, u.group);
            if u.per_channel {
                CodedRows::UniformChannels {
                    codes,
                    scales,
                    zeros,
                    bits,
                    group,
                }
            } else {
                CodedRows::UniformTokens {
                    codes,
                    scales,
                    zeros,
                    bits,
                    group,
                    seed: u.seed,
                }
            }
        }
        BaseRows::Dense(x) => CodedRows::Dense(slice(&x.values, &name("values"))?),
        BaseRows::Runs(r) => CodedRows::ChannelRuns {
            runs,
            group: r.group,
            basis: slice(&r.basis, &name("basis"))?,
            basis_heads: r.basis_heads,
        },
    })
}

fn side_rows<'a>(s: &'a ArraySide<'_>) -> PyResult<CoreSide<'a>> {
    Ok(CoreSide {
        codes: slice(&s.codes, "side.codes")?,
        scales: s.scales.view("side.scales")?,
        basis: slice(&s.basis, "side.basis")?,
        basis_heads: s.basis_heads,
        rank: s.rank,
        bits: s.bits,
        sign: s.sign,
    })
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
    let (kruns, vruns) = (runs(&keys, "keys")?, runs(&values, "values")?);
    let kin = base_rows(keys.base(), "keys", &kruns)?;
    let vin = base_rows(values.base(), "values", &vruns)?;
    let (kr, vr) = (wrap(&keys, "keys", &kin)?, wrap(&values, "values", &vin)?);
    let side: Option<ArraySide<'py>> = side.map(|s| read(&s, "SideRows")).transpose()?;
    let sr = side.as_ref().map(side_rows).transpose()?;
    let layout = AttentionShape::new(heads, rows, tokens, head_dim, scale);
    let res =
        py_result(py.allow_threads(|| core_attention(qs, &layout, &kr, sr.as_ref(), &vr, probs)))?;
    Ok((
        PyArray1::from_vec(py, res.out),
        PyArray1::from_vec(py, res.lse),
        PyArray1::from_vec(py, res.probs),
    ))
}
