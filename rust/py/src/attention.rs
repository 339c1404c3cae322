//! Binding of the fused decode attention kernel: keys, values and the HeadQ side code arrive as
//! dicts of flat, C-contiguous arrays (the Python wrapper `kvqrs.kernels.attention` builds them
//! and checks their shapes); everything is borrowed, the GIL is released for the kernel.

use kvqrs_core::kernels::attention::{
    decode_attention as core_attention, CodedRows, Layout, QjlRows, SideRows,
};
use kvqrs_core::scalars::ScalarView;
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::{slice, Scalars};
use crate::errors::{arg_error, py_result};

/// The arrays of one side, held (and so kept borrowed) for the duration of the call.
struct Held<'py> {
    kind: String,
    codes: Option<PyReadonlyArray1<'py, u8>>,
    norms: Option<Scalars<'py>>,
    scales: Option<Scalars<'py>>,
    zeros: Option<Scalars<'py>>,
    dense: Option<PyReadonlyArray1<'py, f32>>,
    qjl_signs: Option<PyReadonlyArray1<'py, u8>>,
    qjl_norms: Option<Scalars<'py>>,
    qjl_seed: Option<u64>,
    bits: u32,
    seed: Option<u64>,
    group: usize,
    side: &'static str,
}

fn item<'py, T: FromPyObject<'py>>(
    d: &Bound<'py, PyDict>,
    side: &str,
    key: &str,
) -> PyResult<Option<T>> {
    match d.get_item(key)? {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v
            .extract::<T>()
            .map(Some)
            .map_err(|e| arg_error(format!("{side}.{key}: {e}"))),
    }
}

fn need<T>(v: Option<T>, side: &str, key: &str, kind: &str) -> PyResult<T> {
    v.ok_or_else(|| arg_error(format!("{side}.{key}: required for {kind} rows")))
}

fn bits_u32(bits: i64) -> u32 {
    u32::try_from(bits).unwrap_or(u32::MAX)
}

fn plane<'b>(
    v: &'b Option<Scalars<'_>>,
    side: &str,
    key: &str,
    kind: &str,
) -> PyResult<ScalarView<'b>> {
    need(v.as_ref(), side, key, kind)?.view(key)
}

impl<'py> Held<'py> {
    fn new(d: &Bound<'py, PyDict>, side: &'static str) -> PyResult<Self> {
        let kind: String = need(item(d, side, "kind")?, side, "kind", "all")?;
        Ok(Self {
            codes: item(d, side, "codes")?,
            norms: item(d, side, "norms")?,
            scales: item(d, side, "scales")?,
            zeros: item(d, side, "zeros")?,
            dense: item(d, side, "values")?,
            qjl_signs: item(d, side, "qjl_signs")?,
            qjl_norms: item(d, side, "qjl_norms")?,
            qjl_seed: item(d, side, "qjl_seed")?,
            bits: bits_u32(item::<i64>(d, side, "bits")?.unwrap_or(0)),
            seed: item(d, side, "seed")?,
            group: item(d, side, "group")?.unwrap_or(0),
            kind,
            side,
        })
    }

    fn rows(&self) -> PyResult<CodedRows<'_>> {
        let s = self.side;
        let k = self.kind.as_str();
        let codes =
            || -> PyResult<&[u8]> { slice(need(self.codes.as_ref(), s, "codes", k)?, "codes") };
        let plane = |v, key| plane(v, s, key, k);
        Ok(match k {
            "mse" => {
                let qjl = match (&self.qjl_signs, &self.qjl_norms, self.qjl_seed) {
                    (None, None, None) => None,
                    (Some(sg), Some(_), Some(seed)) => Some(QjlRows {
                        signs: slice(sg, "qjl_signs")?,
                        norms: plane(&self.qjl_norms, "qjl_norms")?,
                        seed,
                    }),
                    _ => return Err(arg_error(format!("{s}.qjl_signs: a QJL residual needs qjl_signs, qjl_norms and qjl_seed together"))),
                };
                CodedRows::Mse { codes: codes()?, norms: plane(&self.norms, "norms")?, bits: self.bits, seed: self.seed, qjl }
            }
            "uniform_tokens" => CodedRows::UniformTokens {
                codes: codes()?,
                scales: plane(&self.scales, "scales")?,
                zeros: plane(&self.zeros, "zeros")?,
                bits: self.bits,
                group: self.group,
                seed: self.seed,
            },
            "uniform_channels" => CodedRows::UniformChannels {
                codes: codes()?,
                scales: plane(&self.scales, "scales")?,
                zeros: plane(&self.zeros, "zeros")?,
                bits: self.bits,
                group: self.group,
            },
            "dense" => CodedRows::Dense(slice(need(self.dense.as_ref(), s, "values", k)?, "values")?),
            other => {
                return Err(arg_error(format!(
                    "{s}.kind: expected 'mse', 'uniform_tokens', 'uniform_channels' or 'dense', got {other:?}"
                )))
            }
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
    keys: &Bound<'py, PyDict>,
    values: &Bound<'py, PyDict>,
    side: Option<&Bound<'py, PyDict>>,
    heads: usize,
    rows: usize,
    tokens: usize,
    head_dim: usize,
    scale: f32,
    probs: bool,
) -> PyResult<AttentionOut<'py>> {
    let qs = slice(&q, "q")?;
    let kh = Held::new(keys, "keys")?;
    let vh = Held::new(values, "values")?;
    let sh = match side {
        None => None,
        Some(d) => Some((
            need(
                item::<PyReadonlyArray1<'py, u8>>(d, "side", "codes")?,
                "side",
                "codes",
                "side",
            )?,
            need(
                item::<Scalars<'py>>(d, "side", "scales")?,
                "side",
                "scales",
                "side",
            )?,
            need(
                item::<PyReadonlyArray1<'py, f32>>(d, "side", "basis")?,
                "side",
                "basis",
                "side",
            )?,
            need(
                item::<usize>(d, "side", "basis_heads")?,
                "side",
                "basis_heads",
                "side",
            )?,
            need(item::<usize>(d, "side", "rank")?, "side", "rank", "side")?,
            bits_u32(need(
                item::<i64>(d, "side", "bits")?,
                "side",
                "bits",
                "side",
            )?),
            need(item::<f32>(d, "side", "sign")?, "side", "sign", "side")?,
        )),
    };
    let kr = kh.rows()?;
    let vr = vh.rows()?;
    let sr = match &sh {
        None => None,
        Some((codes, scales, basis, basis_heads, rank, bits, sign)) => Some(SideRows {
            codes: slice(codes, "side.codes")?,
            scales: scales.view("side.scales")?,
            basis: slice(basis, "side.basis")?,
            basis_heads: *basis_heads,
            rank: *rank,
            bits: *bits,
            sign: *sign,
        }),
    };
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
