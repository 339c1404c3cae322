//! Binding of the layer store (`kvqrs_core::store`) and its decode step
//! (`kvqrs_core::decode_step`): one `LayerStore` object per cache layer. Chunks arrive as
//! `(dtype code, shape, flat uint8 view of the bytes)` per part (so bfloat16 tensors pass
//! too); parts leave the same way. The GIL is released for every copy and for the step.

use kvqrs_core::decode_step::{attend, RowSpec, RunSpec, SideSpec, Step};
use kvqrs_core::encoders::SideEncoder;
use kvqrs_core::format::{Dtype, Section};
use kvqrs_core::kernels::attention::Layout;
use kvqrs_core::kernels::mse::MseQuantizer;
use kvqrs_core::kernels::mse_qjl::MseQjlEncoder;
use kvqrs_core::store::{ChunkPart, LayerStore, PartSpec};
use kvqrs_core::window::{all_finite, append_tokens};
use numpy::ndarray::s;
use numpy::{PyArray1, PyArray4, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::arrays::slice;
use crate::errors::{arg_error, py_result};

/// `(name, dtype code, widen, outer axes, inner axes, num, den)`: one declared part.
type PySpec = (String, u8, bool, Vec<usize>, Vec<usize>, usize, usize);
/// `(dtype code, shape, flat uint8 bytes)`: one part of a chunk, or of the store.
type PyPart<'py> = (u8, Vec<usize>, PyReadonlyArray1<'py, u8>);
type PySection<'py> = (String, u8, Vec<u64>, Bound<'py, PyBytes>);
type F32Out<'py> = Bound<'py, PyArray1<f32>>;

fn dtype(code: u8, what: &str) -> PyResult<Dtype> {
    Dtype::from_code(code).ok_or_else(|| arg_error(format!("{what}: unknown dtype code {code}")))
}

fn specs(parts: Vec<PySpec>) -> PyResult<Vec<PartSpec>> {
    parts
        .into_iter()
        .map(|(name, code, widen, outer, inner, num, den)| {
            Ok(PartSpec {
                dtype: dtype(code, &format!("parts: {name}"))?,
                name,
                widen,
                outer,
                inner,
                num,
                den,
            })
        })
        .collect()
}

/// The rows a decode step reads: keys, values and the HeadQ side code.
struct Rows {
    keys: RowSpec,
    values: RowSpec,
    side: Option<SideSpec>,
}

/// Growable per-part buffers of one cache layer (docs/layouts.md), and its decode step.
#[pyclass(module = "kvqrs._native", name = "LayerStore")]
pub struct PyLayerStore {
    inner: LayerStore,
    rows: Option<Rows>,
    /// The native encoders of keys and values (`set_encoders`), for `encode_append`.
    encoders: Option<(SideEncoder, SideEncoder)>,
}

fn get<'py, T: FromPyObject<'py>>(d: &Bound<'py, PyDict>, key: &str, what: &str) -> PyResult<T> {
    d.get_item(key)?
        .ok_or_else(|| arg_error(format!("{what}: missing field {key:?}")))?
        .extract()
        .map_err(|e| arg_error(format!("{what}.{key}: {e}")))
}

/// A flat float32 field (a basis or a mean) as an owned copy (the store keeps it).
fn floats(d: &Bound<'_, PyDict>, key: &str, what: &str) -> PyResult<Vec<f32>> {
    let a: PyReadonlyArray1<'_, f32> = get(d, key, what)?;
    Ok(slice(&a, &format!("{what}.{key}"))?.to_vec())
}

/// A side's encoder from its dict: `{"kind": "mse", "head_dim", "bits", "seed" (None: no
/// rotation)}` or `{"kind": "mse_qjl", "head_dim", "bits", "seed", "qjl_seed"}`.
fn side_encoder(d: &Bound<'_, PyDict>, what: &str) -> PyResult<SideEncoder> {
    let kind: String = get(d, "kind", what)?;
    let (head_dim, bits): (usize, u32) = (get(d, "head_dim", what)?, get(d, "bits", what)?);
    Ok(match kind.as_str() {
        "mse" => SideEncoder::Mse(py_result(MseQuantizer::new(
            head_dim,
            bits,
            get(d, "seed", what)?,
        ))?),
        "mse_qjl" => SideEncoder::MseQjl(py_result(MseQjlEncoder::new(
            head_dim,
            bits,
            get(d, "seed", what)?,
            get(d, "qjl_seed", what)?,
        ))?),
        other => {
            return Err(arg_error(format!(
                "{what}.kind: expected 'mse' or 'mse_qjl', got {other:?}"
            )))
        }
    })
}

/// Tokens `start .. start + tokens` of a `(batch, heads, window, d)` array of any strides, as
/// C-order rows (the one copy a flush makes: the caller's window is a strided view).
fn window_tokens(
    a: &Bound<'_, PyArray4<f32>>,
    start: usize,
    tokens: usize,
    what: &str,
) -> PyResult<Vec<f32>> {
    let r = a
        .try_readonly()
        .map_err(|e| arg_error(format!("{what}: cannot read the array ({e})")))?;
    let view = r.as_array();
    let end = start.checked_add(tokens).filter(|&e| e <= view.shape()[2]);
    let Some(end) = end else {
        return Err(arg_error(format!(
            "{what}: expected a window holding tokens {start} .. {start} + {tokens}, got shape {:?}",
            view.shape()
        )));
    };
    Ok(view
        .slice(s![.., .., start..end, ..])
        .iter()
        .copied()
        .collect())
}

/// A float32 array's values in C order (a copy, so that the borrow ends here), or None when
/// the array is borrowed mutably elsewhere.
fn c_order(a: &Bound<'_, PyArray4<f32>>) -> Option<Vec<f32>> {
    let r = a.try_readonly().ok()?;
    Some(match r.as_slice() {
        Ok(s) => s.to_vec(),
        Err(_) => r.as_array().iter().copied().collect(),
    })
}

/// Appends a decode step's new keys `k` and values `v` (float32 batch x kv_heads x n x
/// head_dim, any strides) to a layer's window buffers `dst_k`, `dst_v` (flat float32 views of
/// C-contiguous batch x kv_heads x `cap` x head_dim buffers) at token `at`. Returns False,
/// nothing copied, when some new value is not finite (the caller names it) or when the arrays
/// cannot be borrowed as needed (buffers that alias each other, or that another borrow
/// holds): the caller then joins the tokens to its window instead. Raises when the tokens do
/// not fit the buffers or a buffer is strided.
#[pyfunction]
pub fn window_append(
    py: Python<'_>,
    dst_k: &Bound<'_, PyArray1<f32>>,
    dst_v: &Bound<'_, PyArray1<f32>>,
    cap: usize,
    at: usize,
    k: &Bound<'_, PyArray4<f32>>,
    v: &Bound<'_, PyArray4<f32>>,
) -> PyResult<bool> {
    let (ks, vs) = (k.shape().to_vec(), v.shape().to_vec());
    let (Some(kx), Some(vx)) = (c_order(k), c_order(v)) else {
        return Ok(false);
    };
    let (Ok(mut wk), Ok(mut wv)) = (dst_k.try_readwrite(), dst_v.try_readwrite()) else {
        return Ok(false);
    };
    let strided =
        || arg_error("dst_k, dst_v: expected C-contiguous buffers, got a strided view".into());
    let dk = wk.as_slice_mut().map_err(|_| strided())?;
    let dv = wv.as_slice_mut().map_err(|_| strided())?;
    py_result(py.allow_threads(|| {
        if !(all_finite(&kx) && all_finite(&vx)) {
            return Ok(false);
        }
        append_tokens(dk, (cap, at), &kx, (ks[0] * ks[1], ks[2], ks[3]))?;
        append_tokens(dv, (cap, at), &vx, (vs[0] * vs[1], vs[2], vs[3]))?;
        Ok(true)
    }))
}

impl PyLayerStore {
    fn part_index(&self, d: &Bound<'_, PyDict>, key: &str, what: &str) -> PyResult<usize> {
        let name: String = get(d, key, what)?;
        self.inner
            .index(&name)
            .ok_or_else(|| arg_error(format!("{what}.{key}: no part named {name:?} in the store")))
    }

    fn row_spec(&self, d: &Bound<'_, PyDict>, what: &str) -> PyResult<RowSpec> {
        let kind: String = get(d, "kind", what)?;
        let idx = |key: &str| self.part_index(d, key, what);
        Ok(match kind.as_str() {
            "mse" => RowSpec::Mse {
                codes: idx("codes")?,
                norms: idx("norms")?,
                bits: get(d, "bits", what)?,
                seed: get(d, "seed", what)?,
                qjl: if d.contains("qjl_signs")? {
                    Some((idx("qjl_signs")?, idx("qjl_norms")?, get(d, "qjl_seed", what)?))
                } else {
                    None
                },
            },
            "uniform_tokens" => RowSpec::UniformTokens {
                codes: idx("codes")?,
                scales: idx("scales")?,
                zeros: idx("zeros")?,
                bits: get(d, "bits", what)?,
                group: get(d, "group", what)?,
                seed: get(d, "seed", what)?,
            },
            "uniform_channels" => RowSpec::UniformChannels {
                codes: idx("codes")?,
                scales: idx("scales")?,
                zeros: idx("zeros")?,
                bits: get(d, "bits", what)?,
                group: get(d, "group", what)?,
            },
            "dense" => RowSpec::Dense {
                values: idx("values")?,
            },
            "channel_runs" => {
                let runs: Vec<Bound<'_, PyDict>> = get(d, "runs", what)?;
                RowSpec::ChannelRuns {
                    runs: (runs.iter().enumerate())
                        .map(|(i, r)| self.run_spec(r, &format!("{what}.runs[{i}]")))
                        .collect::<PyResult<_>>()?,
                    group: get(d, "group", what)?,
                    basis: floats(d, "basis", what)?,
                    basis_heads: get(d, "basis_heads", what)?,
                }
            }
            "centred" => {
                let inner: Bound<'_, PyDict> = get(d, "rows", what)?;
                let rows = self.row_spec(&inner, &format!("{what}.rows"))?;
                if matches!(rows, RowSpec::Centred { .. }) {
                    return Err(arg_error(format!(
                        "{what}.rows: expected rows around one mean, got centred rows in centred rows"
                    )));
                }
                RowSpec::Centred {
                    rows: Box::new(rows),
                    mean: floats(d, "mean", what)?,
                    mean_heads: get(d, "mean_heads", what)?,
                }
            }
            other => {
                return Err(arg_error(format!(
                    "{what}.kind: expected mse, uniform_tokens, uniform_channels, dense, channel_runs or centred, got {other:?}"
                )))
            }
        })
    }

    /// One run of `channel_runs` rows: its parts by name, bits and basis columns.
    fn run_spec(&self, d: &Bound<'_, PyDict>, what: &str) -> PyResult<RunSpec> {
        Ok(RunSpec {
            codes: self.part_index(d, "codes", what)?,
            scales: self.part_index(d, "scales", what)?,
            zeros: self.part_index(d, "zeros", what)?,
            bits: get(d, "bits", what)?,
            start: get(d, "start", what)?,
            stop: get(d, "stop", what)?,
        })
    }
}

#[pymethods]
impl PyLayerStore {
    /// An empty store of the declared parts.
    #[new]
    fn new(parts: Vec<PySpec>) -> PyResult<Self> {
        Ok(Self {
            inner: py_result(LayerStore::new(specs(parts)?))?,
            rows: None,
            encoders: None,
        })
    }

    /// Tokens held.
    #[getter]
    fn tokens(&self) -> usize {
        self.inner.tokens()
    }

    /// Batch rows.
    #[getter]
    fn batch(&self) -> usize {
        self.inner.batch()
    }

    /// Part names in declaration order.
    fn names(&self) -> Vec<String> {
        self.inner.specs().map(|s| s.name.clone()).collect()
    }

    /// Bytes held by the tokens (not counting reserved room).
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// Bytes reserved (held plus room for appends).
    fn capacity_nbytes(&self) -> usize {
        self.inner.capacity_nbytes()
    }

    /// Appends a chunk of `tokens` tokens, one `(dtype code, shape, bytes)` per part.
    fn append(&mut self, py: Python<'_>, chunk: Vec<PyPart<'_>>, tokens: usize) -> PyResult<()> {
        let mut dtypes = Vec::with_capacity(chunk.len());
        for (code, _, _) in &chunk {
            dtypes.push(dtype(*code, "chunk")?);
        }
        let mut bytes = Vec::with_capacity(chunk.len());
        for (_, _, b) in &chunk {
            bytes.push(slice(b, "chunk")?);
        }
        let parts: Vec<ChunkPart> = chunk
            .iter()
            .zip(dtypes)
            .zip(bytes)
            .map(|(((_, shape, _), dtype), bytes)| ChunkPart {
                dtype,
                shape,
                bytes,
            })
            .collect();
        let inner = &mut self.inner;
        py_result(py.allow_threads(|| inner.append(&parts, tokens)))
    }

    /// Keeps tokens `lo .. hi`.
    fn keep(&mut self, lo: usize, hi: usize) -> PyResult<()> {
        py_result(self.inner.keep(lo, hi))
    }

    /// Drops every token.
    fn clear(&mut self) {
        self.inner.clear();
    }

    /// Keeps batch rows `index` in that order (rows may repeat).
    fn select(&mut self, py: Python<'_>, index: Vec<usize>) -> PyResult<()> {
        let inner = &mut self.inner;
        py_result(py.allow_threads(|| inner.select(&index)))
    }

    /// Part `name` as `(dtype code, shape, flat uint8 bytes)` for the tokens held.
    fn part<'py>(
        &self,
        py: Python<'py>,
        name: &str,
    ) -> PyResult<(u8, Vec<usize>, Bound<'py, PyArray1<u8>>)> {
        let i = self
            .inner
            .index(name)
            .ok_or_else(|| arg_error(format!("name: no part {name:?} in the store")))?;
        let inner = &self.inner;
        let (dtype, shape, bytes) = py.allow_threads(|| inner.part(i));
        Ok((dtype as u8, shape, PyArray1::from_vec(py, bytes)))
    }

    /// The parts as container sections `(prefix + name, dtype code, shape, bytes)`.
    fn sections<'py>(&self, py: Python<'py>, prefix: &str) -> Vec<PySection<'py>> {
        let inner = &self.inner;
        py.allow_threads(|| inner.sections(prefix))
            .into_iter()
            .map(|s| (s.name, s.dtype as u8, s.shape, PyBytes::new(py, &s.payload)))
            .collect()
    }

    /// A store of `parts` holding `tokens` tokens from the sections `prefix + name`.
    #[staticmethod]
    fn from_sections(
        parts: Vec<PySpec>,
        sections: Vec<PySection<'_>>,
        prefix: &str,
        tokens: usize,
    ) -> PyResult<Self> {
        let secs = sections
            .into_iter()
            .map(|(name, code, shape, payload)| {
                Ok(Section {
                    dtype: dtype(code, &format!("sections: {name}"))?,
                    name,
                    shape,
                    payload: payload.as_bytes().to_vec(),
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self {
            inner: py_result(LayerStore::from_sections(
                specs(parts)?,
                &secs,
                prefix,
                tokens,
            ))?,
            rows: None,
            encoders: None,
        })
    }

    /// Declares the rows a decode step reads: `keys` and `values` are the `spec()` dicts of
    /// the row objects with part names in place of arrays (`channel_runs` with a flat float32
    /// `basis` and its `basis_heads`, `centred` with a flat float32 `mean` and its
    /// `mean_heads`); `side` HeadQ's, with its basis.
    #[pyo3(signature = (keys, values, side=None))]
    fn set_rows(
        &mut self,
        keys: &Bound<'_, PyDict>,
        values: &Bound<'_, PyDict>,
        side: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let k = self.row_spec(keys, "keys")?;
        let v = self.row_spec(values, "values")?;
        if matches!(v, RowSpec::UniformChannels { .. }) {
            return Err(arg_error(
                "values: per-channel uniform groups are a key layout".into(),
            ));
        }
        let s = match side {
            None => None,
            Some(d) => Some(SideSpec {
                codes: self.part_index(d, "codes", "side")?,
                scales: self.part_index(d, "scales", "side")?,
                basis: floats(d, "basis", "side")?,
                basis_heads: get(d, "basis_heads", "side")?,
                rank: get(d, "rank", "side")?,
                bits: get(d, "bits", "side")?,
                sign: get(d, "sign", "side")?,
            }),
        };
        self.rows = Some(Rows {
            keys: k,
            values: v,
            side: s,
        });
        Ok(())
    }

    /// Declares the native encoders of keys and values for `encode_append` (dicts as
    /// `side_encoder` reads them).
    fn set_encoders(
        &mut self,
        keys: &Bound<'_, PyDict>,
        values: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        self.encoders = Some((side_encoder(keys, "keys")?, side_encoder(values, "values")?));
        Ok(())
    }

    /// Whether `set_encoders` has declared the encoders.
    #[getter]
    fn has_encoders(&self) -> bool {
        self.encoders.is_some()
    }

    /// Encodes `tokens` tokens of keys `k` and values `v` (float32 batch x kv_heads x window
    /// x head_dim, any strides: a cache passes its full-precision window buffer as it holds
    /// it), from token `k_start` of `k` and `v_start` of `v`, with the declared encoders and
    /// appends their codes. Raises (nothing stored) without encoders, for a window that does
    /// not hold those tokens, on non-finite rows, a norm beyond float32, or parts that do not
    /// match the store's.
    #[pyo3(signature = (k, v, tokens, k_start=0, v_start=0))]
    fn encode_append(
        &mut self,
        py: Python<'_>,
        k: &Bound<'_, PyArray4<f32>>,
        v: &Bound<'_, PyArray4<f32>>,
        tokens: usize,
        k_start: usize,
        v_start: usize,
    ) -> PyResult<()> {
        let (ks, vs) = (
            window_tokens(k, k_start, tokens, "k")?,
            window_tokens(v, v_start, tokens, "v")?,
        );
        let (inner, encoders) = (&mut self.inner, &self.encoders);
        let (ke, ve) = encoders
            .as_ref()
            .ok_or_else(|| arg_error("encoders: call set_encoders first".into()))?;
        py_result(py.allow_threads(|| inner.encode_append((ke, &ks), (ve, &vs), tokens)))
    }

    /// Whether `set_rows` has declared the rows.
    #[getter]
    fn has_rows(&self) -> bool {
        self.rows.is_some()
    }

    /// One decode step: attention of `q` (heads x rows x head_dim float32, flat) over the
    /// coded tokens and the full-precision ones (`fp_keys`, `fp_values`: heads x window x
    /// head_dim float32), merged by log-sum-exp. Returns (out, lse) float32, flat.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (q, heads, rows, head_dim, scale, tokens, fp_keys, fp_values, window, mask, batch))]
    fn attend<'py>(
        &self,
        py: Python<'py>,
        q: PyReadonlyArray1<'py, f32>,
        heads: usize,
        rows: usize,
        head_dim: usize,
        scale: f32,
        tokens: usize,
        fp_keys: PyReadonlyArray1<'py, f32>,
        fp_values: PyReadonlyArray1<'py, f32>,
        window: usize,
        mask: Option<PyReadonlyArray1<'py, f32>>,
        batch: usize,
    ) -> PyResult<(F32Out<'py>, F32Out<'py>)> {
        let spec = self
            .rows
            .as_ref()
            .ok_or_else(|| arg_error("rows: call set_rows before a decode step".into()))?;
        let m = match &mask {
            Some(a) => Some(slice(a, "mask")?),
            None => None,
        };
        let step = Step {
            q: slice(&q, "q")?,
            layout: Layout {
                heads,
                rows,
                tokens: 0,
                head_dim,
                scale,
            },
            tokens,
            fp_keys: slice(&fp_keys, "fp_keys")?,
            fp_values: slice(&fp_values, "fp_values")?,
            window,
            mask: m,
            batch,
        };
        let inner = &self.inner;
        let res =
            py_result(py.allow_threads(|| {
                attend(inner, &spec.keys, spec.side.as_ref(), &spec.values, &step)
            }))?;
        Ok((
            PyArray1::from_vec(py, res.out),
            PyArray1::from_vec(py, res.lse),
        ))
    }
}
