//! Binding of the layer store (`kvqrs_core::store`) and its decode step
//! (`kvqrs_core::decode_step`): one `LayerStore` object per cache layer, its parts declared
//! as `kvqrs.hf.store.StorePart` objects (read by attribute). Chunks arrive as `(dtype name,
//! shape, flat uint8 view of the bytes)` per part (so bfloat16 tensors pass too); parts leave
//! the same way; container sections carry the container's dtype codes (docs/format.md).
//! The GIL is released for every copy and for the step.

use kvqrs_core::decode_step::{
    attend, attend_full_precision as core_attend_full_precision, check_rows, FpTokens, PartRows,
    PartScalars, PartSide, Step,
};
use kvqrs_core::dtype::Dtype;
use kvqrs_core::encoders::{
    Centring, ChannelRun as EncoderRun, ChannelSide, MseSide, SideEncoder, TokenRows, TokenRunSide,
};
use kvqrs_core::format::Section;
use kvqrs_core::kernels::attention::AttentionShape;
use kvqrs_core::kernels::mse::{MseQuantizer, RowScale};
use kvqrs_core::kernels::mse_qjl::MseQjlEncoder;
use kvqrs_core::kernels::uniform::UniformQuantizer;
use kvqrs_core::rows::{Field, Resolve, ScalarParts};
use kvqrs_core::store::{ChunkPart, LayerStore, PartSpec};
use kvqrs_core::window::{all_storable, append_tokens, gather_tokens};
use numpy::ndarray::s;
use numpy::{
    PyArray1, PyArray4, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray4, PyReadonlyArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::borrow::Cow;

use crate::arrays::{dtype, slice, slice_at};
use crate::errors::{arg_error, py_result};
use crate::rows::{PyRows, PySide, Stored, F32};

/// One declared part, as `kvqrs.hf.store.StorePart` declares it (read by attribute): its
/// name, dtype name, whether float16 widens to float32, outer and inner axes, and `num / den`
/// entries per token.
#[derive(FromPyObject)]
struct PySpec {
    name: String,
    dtype: String,
    widen: bool,
    outer: Vec<usize>,
    inner: Vec<usize>,
    num: usize,
    den: usize,
}

/// `(dtype name, shape, flat uint8 bytes)`: one part of a chunk, or of the store.
type PyPart<'py> = (String, Vec<usize>, PyReadonlyArray1<'py, u8>);
/// `(name, container dtype code, shape, payload)`: one container section (docs/format.md).
type PySection<'py> = (String, u8, Vec<u64>, Bound<'py, PyBytes>);
type F32Out<'py> = Bound<'py, PyArray1<f32>>;
/// `(dtype name, shape, flat uint8 bytes)` of a part leaving the store.
type PartOut<'py> = (&'static str, Vec<usize>, Bound<'py, PyArray1<u8>>);

/// The container dtype of a section's code.
fn section_dtype(code: u8, what: &str) -> PyResult<Dtype> {
    Dtype::from_code(code).ok_or_else(|| arg_error(format!("{what}: unknown dtype code {code}")))
}

fn specs(parts: Vec<PySpec>) -> PyResult<Vec<PartSpec>> {
    parts
        .into_iter()
        .map(|p| {
            Ok(PartSpec {
                dtype: dtype(&p.dtype, &format!("parts: {}", p.name))?,
                name: p.name,
                widen: p.widen,
                outer: p.outer,
                inner: p.inner,
                num: p.num,
                den: p.den,
            })
        })
        .collect()
}

/// The rows a decode step reads: keys, values and the HeadQ side code.
struct Declared {
    keys: PartRows,
    values: PartRows,
    side: Option<PartSide>,
}

/// Growable per-part buffers of one cache layer (docs/layouts.md), and its decode step.
#[pyclass(module = "kvqrs._native", name = "LayerStore")]
pub struct PyLayerStore {
    inner: LayerStore,
    rows: Option<Declared>,
    /// The native encoders of keys and values (`set_encoders`), for `encode_append`.
    encoders: Option<(SideEncoder, SideEncoder)>,
}

/// Stored scalars by part name: a float16 / float32 part, or `LogScalars` of two parts.
type NamedScalars = Stored<String, String>;
/// One side of the cache with part names in place of arrays.
type NamedRows<'py> = PyRows<String, NamedScalars, String, F32<'py>>;
type NamedSide<'py> = PySide<String, NamedScalars, F32<'py>>;

/// Resolves part names to the store's part indices (a name the store lacks is an error naming
/// the field) and copies bases and means (the store keeps them).
struct ByName<'s> {
    store: &'s LayerStore,
}

impl ByName<'_> {
    fn index(&self, name: &str, at: impl std::fmt::Display) -> PyResult<usize> {
        self.store
            .index(name)
            .ok_or_else(|| arg_error(format!("{at}: no part named {name:?} in the store")))
    }
}

impl<'a, 'py: 'a> Resolve<'a, String, NamedScalars, String, F32<'py>> for ByName<'_> {
    type Bytes = usize;
    type Scalars = PartScalars;
    type Floats = usize;
    type Table = Vec<f32>;
    type Error = PyErr;
    fn bytes(&mut self, name: &'a String, at: Field<'_>) -> PyResult<usize> {
        self.index(name, at)
    }
    fn scalars(&mut self, s: &'a NamedScalars, at: Field<'_>) -> PyResult<PartScalars> {
        Ok(match &s.0 {
            ScalarParts::Plain(name) => ScalarParts::Plain(self.index(name, at)?),
            ScalarParts::Log { codes, exps, group } => ScalarParts::Log {
                codes: self.index(codes, at)?,
                exps: self.index(exps, format_args!("{at}.exps"))?,
                group: *group,
            },
        })
    }
    fn floats(&mut self, name: &'a String, at: Field<'_>) -> PyResult<usize> {
        self.index(name, at)
    }
    fn table(&mut self, a: &'a F32<'py>, at: Field<'_>) -> PyResult<Vec<f32>> {
        Ok(slice_at(a, at)?.to_vec())
    }
}

/// One side's encoder as `kvqrs.hf.store.NativeEncoder` declares it (read by attribute):
/// `kind` names the composition (`"mse"`, `"mse_qjl"`, `"tokens"`, `"channels"`,
/// `"token_runs"`), the other fields its settings (see that class).
#[derive(FromPyObject)]
pub(crate) struct EncoderSpec {
    kind: String,
    head_dim: usize,
    bits: u32,
    seed: Option<u64>,
    qjl_seed: Option<u64>,
    scale: String,
    norm_group: Option<usize>,
    mean: Option<Vec<f32>>,
    basis: Option<Vec<f32>>,
    deviations: Option<Vec<f32>>,
    runs: Vec<(u32, usize, usize, String)>,
    group: usize,
}

/// Runs `(bits, lo, hi, suffix)` as the encoders take them.
fn runs(runs: Vec<(u32, usize, usize, String)>) -> Vec<EncoderRun> {
    runs.into_iter()
        .map(|(bits, lo, hi, suffix)| EncoderRun {
            bits,
            lo,
            hi,
            suffix,
        })
        .collect()
}

pub(crate) fn side_encoder(e: EncoderSpec, what: &str) -> PyResult<SideEncoder> {
    let mean = match e.mean {
        Some(m) => Some(py_result(Centring::new(m, e.head_dim))?),
        None => None,
    };
    Ok(match e.kind.as_str() {
        "mse" => {
            let scale = RowScale::from_name(&e.scale)
                .ok_or_else(|| arg_error(format!("{what}: unknown scale {:?}", e.scale)))?;
            SideEncoder::Mse(MseSide {
                mse: py_result(MseQuantizer::new(e.head_dim, e.bits, e.seed))?.with_scale(scale),
                mean,
                norm_group: e.norm_group,
            })
        }
        "mse_qjl" => {
            let (Some(seed), Some(qjl_seed)) = (e.seed, e.qjl_seed) else {
                return Err(arg_error(format!(
                    "{what}: an MSE + QJL encoder needs a rotation seed and a sketch seed"
                )));
            };
            SideEncoder::MseQjl(py_result(MseQjlEncoder::new(
                e.head_dim, e.bits, seed, qjl_seed,
            ))?)
        }
        "tokens" => SideEncoder::Tokens(py_result(UniformQuantizer::new(
            e.head_dim, e.group, e.bits,
        ))?),
        "channels" => {
            let transform = match (mean, e.basis) {
                (Some(m), Some(b)) => Some((m, b)),
                (None, None) => None,
                _ => {
                    return Err(arg_error(format!(
                        "{what}: a transform needs both a mean and a basis"
                    )))
                }
            };
            SideEncoder::Channels(py_result(ChannelSide::new(
                e.head_dim,
                transform,
                runs(e.runs),
                e.group,
            ))?)
        }
        "token_runs" => {
            let (Some(m), Some(b), Some(dev)) = (mean, e.basis, e.deviations) else {
                return Err(arg_error(format!(
                    "{what}: per-token runs need a mean, a basis and deviations"
                )));
            };
            SideEncoder::TokenRuns(py_result(TokenRunSide::new(
                e.head_dim,
                (m, b),
                dev,
                runs(e.runs),
            ))?)
        }
        other => return Err(arg_error(format!("{what}: unknown encoder kind {other:?}"))),
    })
}

/// Tokens `start .. start + tokens` of a `(batch, heads, window, d)` array of any strides, as
/// C-order rows (the one copy a flush makes: the caller's window is a strided view).
/// A window's tokens as the encoders read them: the C-contiguous buffer in place (rows of
/// `cap` tokens), else a copy of tokens `start .. start + tokens` of every row.
enum TokenWindow<'py> {
    InPlace(PyReadonlyArray4<'py, f32>, usize, usize, usize),
    Copied(Vec<f32>, usize, usize),
}

impl<'py> TokenWindow<'py> {
    fn read(
        a: &Bound<'py, PyArray4<f32>>,
        start: usize,
        tokens: usize,
        what: &str,
    ) -> PyResult<Self> {
        let r = a
            .try_readonly()
            .map_err(|e| arg_error(format!("{what}: cannot read the array ({e})")))?;
        let shape = r.shape().to_vec();
        let end = start.checked_add(tokens).filter(|&e| e <= shape[2]);
        let Some(end) = end else {
            return Err(arg_error(format!(
                "{what}: expected a window holding tokens {start} .. {start} + {tokens}, got shape {shape:?}"
            )));
        };
        if r.is_c_contiguous() {
            return Ok(Self::InPlace(r, shape[2], start, shape[3]));
        }
        let view = r.as_array();
        let rows = view
            .slice(s![.., .., start..end, ..])
            .iter()
            .copied()
            .collect();
        Ok(Self::Copied(rows, tokens, shape[3]))
    }

    fn rows(&self) -> TokenRows<'_> {
        match self {
            // C-contiguous (checked by `read`), so the slice exists.
            Self::InPlace(r, cap, lo, d) => TokenRows {
                src: r.as_slice().unwrap_or(&[]),
                cap: *cap,
                lo: *lo,
                d: *d,
            },
            Self::Copied(v, tokens, d) => TokenRows {
                src: v,
                cap: *tokens,
                lo: 0,
                d: *d,
            },
        }
    }
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

/// Whether every value of a float32 array (any shape and strides) is finite and at most
/// `MAX_STATE` in magnitude: the check a layer makes of tokens it takes as they are, in one
/// pass with no temporary (the caller names a bad value).
#[pyfunction]
pub fn storable(py: Python<'_>, x: PyReadonlyArrayDyn<'_, f32>) -> bool {
    match x.as_slice() {
        Ok(s) => py.allow_threads(|| all_storable(s)),
        Err(_) => x.as_array().iter().all(|v| all_storable(&[*v])),
    }
}

/// Float32 arrays, one flat and C-contiguous each, as the decode step's arguments borrow them.
type F32In<'a, 'py> = &'a PyReadonlyArray1<'py, f32>;

/// A decode step's [`Step`] over the arguments of `LayerStore.attend` and
/// `attend_full_precision`: `shape` is (heads, rows, head_dim, scale, query tokens), `sinks`
/// joined rows and their count, `window` rows read in place (room, start, tokens).
fn fp_step<'a>(
    q: F32In<'a, '_>,
    (heads, rows, head_dim, scale, tokens): (usize, usize, usize, f32, usize),
    (sink_keys, sink_values, sinks): (F32In<'a, '_>, F32In<'a, '_>, usize),
    (window_keys, window_values, room, start, window): (
        F32In<'a, '_>,
        F32In<'a, '_>,
        usize,
        usize,
        usize,
    ),
    (mask, batch): (Option<F32In<'a, '_>>, usize),
) -> PyResult<Step<'a>> {
    Ok(Step {
        q: slice(q, "q")?,
        layout: AttentionShape::new(heads, rows, 0, head_dim, scale),
        tokens,
        sinks: FpTokens::joined(
            slice(sink_keys, "sink_keys")?,
            slice(sink_values, "sink_values")?,
            sinks,
        ),
        window: FpTokens {
            keys: slice(window_keys, "window_keys")?,
            values: slice(window_values, "window_values")?,
            room,
            start,
            len: window,
        },
        mask: mask.map(|a| slice(a, "mask")).transpose()?,
        batch,
    })
}

/// A decode step's attention over full-precision tokens alone, for a cache layer that has
/// coded nothing yet (GIL released): `LayerStore.attend`'s arguments and arithmetic without
/// a store. Returns (out, lse) float32, flat; a query row whose every token is masked gets
/// zeros and a log-sum-exp of -inf. Raises on shapes that do not fit, no full-precision
/// token, non-finite queries or logits.
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (q, heads, rows, head_dim, scale, tokens, sink_keys, sink_values, sinks, window_keys, window_values, room, start, window, mask, batch))]
pub fn attend_full_precision<'py>(
    py: Python<'py>,
    q: PyReadonlyArray1<'py, f32>,
    heads: usize,
    rows: usize,
    head_dim: usize,
    scale: f32,
    tokens: usize,
    sink_keys: PyReadonlyArray1<'py, f32>,
    sink_values: PyReadonlyArray1<'py, f32>,
    sinks: usize,
    window_keys: PyReadonlyArray1<'py, f32>,
    window_values: PyReadonlyArray1<'py, f32>,
    room: usize,
    start: usize,
    window: usize,
    mask: Option<PyReadonlyArray1<'py, f32>>,
    batch: usize,
) -> PyResult<(F32Out<'py>, F32Out<'py>)> {
    let step = fp_step(
        &q,
        (heads, rows, head_dim, scale, tokens),
        (&sink_keys, &sink_values, sinks),
        (&window_keys, &window_values, room, start, window),
        (mask.as_ref(), batch),
    )?;
    let res = py_result(py.allow_threads(|| core_attend_full_precision(&step)))?;
    Ok((
        PyArray1::from_vec(py, res.out),
        PyArray1::from_vec(py, res.lse),
    ))
}

/// Appends a decode step's new keys `k` and values `v` (float32 batch x kv_heads x n x
/// head_dim, any strides) to a layer's window buffers `dst_k`, `dst_v` (flat float32 views of
/// C-contiguous batch x kv_heads x `cap` x head_dim buffers) at token `at`. Returns False,
/// nothing copied, when some new value is not finite or beyond `MAX_STATE` (the caller names
/// it) or when the arrays cannot be borrowed as needed (buffers that alias each other, or that another borrow
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
    // A long prompt's tokens are read in place (no copy of their size); new tokens that
    // alias the buffers cannot be borrowed beside them, and are copied first.
    let (rk, rv) = (k.try_readonly(), v.try_readonly());
    let in_place =
        |r: &Result<PyReadonlyArray4<'_, f32>, _>| r.as_ref().is_ok_and(|a| a.is_c_contiguous());
    let (kx, vx): (Cow<[f32]>, Cow<[f32]>) = if in_place(&rk) && in_place(&rv) {
        match (&rk, &rv) {
            (Ok(a), Ok(b)) => (
                Cow::Borrowed(a.as_slice().unwrap_or(&[])),
                Cow::Borrowed(b.as_slice().unwrap_or(&[])),
            ),
            _ => return Ok(false),
        }
    } else {
        drop((rk, rv));
        let (Some(a), Some(b)) = (c_order(k), c_order(v)) else {
            return Ok(false);
        };
        (Cow::Owned(a), Cow::Owned(b))
    };
    let (Ok(mut wk), Ok(mut wv)) = (dst_k.try_readwrite(), dst_v.try_readwrite()) else {
        return Ok(false);
    };
    let strided =
        || arg_error("dst_k, dst_v: expected C-contiguous buffers, got a strided view".into());
    let dk = wk.as_slice_mut().map_err(|_| strided())?;
    let dv = wv.as_slice_mut().map_err(|_| strided())?;
    py_result(py.allow_threads(|| {
        if !(all_storable(&kx) && all_storable(&vx)) {
            return Ok(false);
        }
        append_tokens(dk, (cap, at), &kx, (ks[0] * ks[1], ks[2], ks[3]))?;
        append_tokens(dv, (cap, at), &vx, (vs[0] * vs[1], vs[2], vs[3]))?;
        Ok(true)
    }))
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

    /// Appends a chunk of `tokens` tokens, one `(dtype name, shape, bytes)` per part.
    fn append(&mut self, py: Python<'_>, chunk: Vec<PyPart<'_>>, tokens: usize) -> PyResult<()> {
        let mut dtypes = Vec::with_capacity(chunk.len());
        for (name, _, _) in &chunk {
            dtypes.push(dtype(name, "chunk")?);
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

    /// Part `name` as `(dtype name, shape, flat uint8 bytes)` for the tokens held.
    fn part<'py>(&self, py: Python<'py>, name: &str) -> PyResult<PartOut<'py>> {
        let i = self
            .inner
            .index(name)
            .ok_or_else(|| arg_error(format!("name: no part {name:?} in the store")))?;
        let inner = &self.inner;
        let (dtype, shape, bytes) = py.allow_threads(|| inner.part(i));
        Ok((dtype.name(), shape, PyArray1::from_vec(py, bytes)))
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
                    dtype: section_dtype(code, &format!("sections: {name}"))?,
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

    /// Declares the rows a decode step reads: `keys` and `values` are the typed row objects
    /// of `kvqrs.kernels.attention` as the binding reads them (`rows.rs`) with part names in
    /// place of arrays; `side` HeadQ's, likewise.
    #[pyo3(signature = (keys, values, side=None))]
    fn set_rows(
        &mut self,
        keys: NamedRows<'_>,
        values: NamedRows<'_>,
        side: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut names = ByName { store: &self.inner };
        let k = keys.0.map("keys", &mut names)?;
        let v = values.0.map("values", &mut names)?;
        let s = match side {
            None => None,
            Some(obj) => Some(obj.extract::<NamedSide<'_>>()?.0.map(&mut names)?),
        };
        if let Some(what) = v.key_only() {
            return Err(arg_error(format!("values: {what} are a key layout")));
        }
        py_result(check_rows(&self.inner, &k, s.as_ref(), &v))?;
        self.rows = Some(Declared {
            keys: k,
            values: v,
            side: s,
        });
        Ok(())
    }

    /// Declares the native encoders of keys and values for `encode_append`
    /// (`NativeEncoder` objects).
    fn set_encoders(&mut self, keys: EncoderSpec, values: EncoderSpec) -> PyResult<()> {
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
        let (kr, vr) = (
            TokenWindow::read(k, k_start, tokens, "k")?,
            TokenWindow::read(v, v_start, tokens, "v")?,
        );
        let (inner, encoders) = (&mut self.inner, &self.encoders);
        let (ke, ve) = encoders
            .as_ref()
            .ok_or_else(|| arg_error("encoders: call set_encoders first".into()))?;
        let (kt, vt) = (kr.rows(), vr.rows());
        py_result(py.allow_threads(|| inner.encode_append_rows((ke, kt), (ve, vt), tokens)))
    }

    /// Whether `set_rows` has declared the rows.
    #[getter]
    fn has_rows(&self) -> bool {
        self.rows.is_some()
    }

    /// One decode step: attention of `q` (heads x rows x head_dim float32, flat) over the
    /// coded tokens and the full-precision ones, merged by log-sum-exp: the attention sinks
    /// (`sink_keys`, `sink_values`: heads x sinks x head_dim float32), then the window, read in
    /// place from a buffer (`window_keys`, `window_values`: heads x room x head_dim float32,
    /// tokens `start .. start + window` of each head). Returns (out, lse) float32, flat.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (q, heads, rows, head_dim, scale, tokens, sink_keys, sink_values, sinks, window_keys, window_values, room, start, window, mask, batch))]
    fn attend<'py>(
        &self,
        py: Python<'py>,
        q: PyReadonlyArray1<'py, f32>,
        heads: usize,
        rows: usize,
        head_dim: usize,
        scale: f32,
        tokens: usize,
        sink_keys: PyReadonlyArray1<'py, f32>,
        sink_values: PyReadonlyArray1<'py, f32>,
        sinks: usize,
        window_keys: PyReadonlyArray1<'py, f32>,
        window_values: PyReadonlyArray1<'py, f32>,
        room: usize,
        start: usize,
        window: usize,
        mask: Option<PyReadonlyArray1<'py, f32>>,
        batch: usize,
    ) -> PyResult<(F32Out<'py>, F32Out<'py>)> {
        let spec = self
            .rows
            .as_ref()
            .ok_or_else(|| arg_error("rows: call set_rows before a decode step".into()))?;
        let step = fp_step(
            &q,
            (heads, rows, head_dim, scale, tokens),
            (&sink_keys, &sink_values, sinks),
            (&window_keys, &window_values, room, start, window),
            (mask.as_ref(), batch),
        )?;
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

    /// A whole decode step of one layer in one call (GIL released): the step's new keys and
    /// values (`new_keys`, `new_values`: float32 batch x kv_heads x n x head_dim, any strides)
    /// written into the window buffers at token `hi` (as `window_append`); the window's
    /// `flush` oldest tokens, from token `lo`, encoded into the store (as `encode_append`);
    /// then `attend` over the codes, the sinks and the window tokens `lo + flush .. hi + n`.
    /// Returns None, nothing changed, when some new value is not finite or beyond
    /// `MAX_STATE` (the caller names it), or when the encode refuses the flushed tokens (a
    /// per-token absmax scale beyond float16: the store unchanged, the buffers written only
    /// past token `hi`; the caller encodes them in Python, which names the error). Raises when
    /// the shapes do not fit.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (q, heads, rows, head_dim, scale, tokens, sink_keys, sink_values, sinks, window_keys, window_values, room, lo, hi, new_keys, new_values, flush, mask, batch))]
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        q: PyReadonlyArray1<'py, f32>,
        heads: usize,
        rows: usize,
        head_dim: usize,
        scale: f32,
        tokens: usize,
        sink_keys: PyReadonlyArray1<'py, f32>,
        sink_values: PyReadonlyArray1<'py, f32>,
        sinks: usize,
        window_keys: &Bound<'py, PyArray1<f32>>,
        window_values: &Bound<'py, PyArray1<f32>>,
        room: usize,
        lo: usize,
        hi: usize,
        new_keys: &Bound<'py, PyArray4<f32>>,
        new_values: &Bound<'py, PyArray4<f32>>,
        flush: usize,
        mask: Option<PyReadonlyArray1<'py, f32>>,
        batch: usize,
    ) -> PyResult<Option<(F32Out<'py>, F32Out<'py>)>> {
        let spec = self
            .rows
            .as_ref()
            .ok_or_else(|| arg_error("rows: call set_rows before a decode step".into()))?;
        let encoders = match (flush, &self.encoders) {
            (0, _) => None,
            (_, Some(e)) => Some(e),
            (_, None) => return Err(arg_error("encoders: call set_encoders first".into())),
        };
        let shape = new_keys.shape().to_vec();
        if new_values.shape() != shape.as_slice() {
            return Err(arg_error(format!(
                "new_values: expected the shape of new_keys {shape:?}, got {:?}",
                new_values.shape()
            )));
        }
        let busy = |what: &str| arg_error(format!("{what}: the array is borrowed elsewhere"));
        let kx = c_order(new_keys).ok_or_else(|| busy("new_keys"))?;
        let vx = c_order(new_values).ok_or_else(|| busy("new_values"))?;
        let mut wk = window_keys
            .try_readwrite()
            .map_err(|_| busy("window_keys"))?;
        let mut wv = window_values
            .try_readwrite()
            .map_err(|_| busy("window_values"))?;
        let strided =
            || arg_error("window_keys, window_values: expected C-contiguous buffers".into());
        let dk = wk.as_slice_mut().map_err(|_| strided())?;
        let dv = wv.as_slice_mut().map_err(|_| strided())?;
        let m = match &mask {
            Some(a) => Some(slice(a, "mask")?),
            None => None,
        };
        let (sk, sv) = (
            slice(&sink_keys, "sink_keys")?,
            slice(&sink_values, "sink_values")?,
        );
        let q = slice(&q, "q")?;
        let inner = &mut self.inner;
        let (kv_rows, n, d) = (shape[0] * shape[1], shape[2], shape[3]);
        let res = py_result(py.allow_threads(|| {
            if !(all_storable(&kx) && all_storable(&vx)) {
                return Ok(None);
            }
            append_tokens(dk, (room, hi), &kx, (kv_rows, n, d))?;
            append_tokens(dv, (room, hi), &vx, (kv_rows, n, d))?;
            if let Some((ke, ve)) = encoders {
                let fk = gather_tokens(dk, (room, lo, flush), (kv_rows, d))?;
                let fv = gather_tokens(dv, (room, lo, flush), (kv_rows, d))?;
                if inner.encode_append((ke, &fk), (ve, &fv), flush).is_err() {
                    return Ok(None);
                }
            }
            let start = lo + flush;
            let step = Step {
                q,
                layout: AttentionShape::new(heads, rows, 0, head_dim, scale),
                tokens,
                sinks: FpTokens::joined(sk, sv, sinks),
                window: FpTokens {
                    keys: dk,
                    values: dv,
                    room,
                    start,
                    len: (hi + n).saturating_sub(start),
                },
                mask: m,
                batch,
            };
            attend(inner, &spec.keys, spec.side.as_ref(), &spec.values, &step).map(Some)
        }))?;
        Ok(res.map(|r| (PyArray1::from_vec(py, r.out), PyArray1::from_vec(py, r.lse))))
    }
}
