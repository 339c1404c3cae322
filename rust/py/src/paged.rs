//! Binding of the paged decode attention kernel: the cache arrives as one flat uint8 array (the
//! layer's pages, borrowed), both sides' layouts in a page as one `PageRows`, read once from
//! their typed row objects (`rows.rs`: `MSERows`, per-token `UniformRows` or, as keys,
//! `TokenRunRows`, alone or in `CentredRows`) with `(offset, row_bytes[, dtype])` tuples in
//! place of arrays and bases and means flat float32 by value (built and checked by
//! `kvqrs.vllm.layout`); the GIL is released for the kernel.

use kvqrs_core::dtype::Dtype;
use kvqrs_core::kernels::paged::{
    paged_decode_attention as core_paged, paged_reconstruct as core_reconstruct, PagedCache,
    PagedQueries, PagedRows, PagedSequences, Part, ScalarPart,
};
use kvqrs_core::paged_write::{PageGeometry, SlotPart, SlotWriter};
use kvqrs_core::rows::{Field, Resolve, ScalarParts};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::arrays::{dtype, slice, slice_at};
use crate::errors::{arg_error, py_result};
use crate::rows::{PyRows, Stored, F32};
use crate::store::{side_encoder, EncoderSpec};

/// A part of a slot as `(offset, row_bytes)` in a page.
type PyPart = (usize, usize);
/// Stored scalars as `(offset, row_bytes, dtype name)` in a page.
type PyScalarPart = (usize, usize, String);
type PagedScalars = Stored<PyPart, PyScalarPart>;
/// One side's rows with each part's place in a page in place of arrays.
type PagedPyRows<'py> = PyRows<PyPart, PagedScalars, PyPart, F32<'py>>;

/// Reads each part's place in a page and copies each table (basis, mean); the paged kernel
/// checks that the rows are a per-token format, that every part fits and every table is whole.
struct Places;

impl<'a, 'py: 'a> Resolve<'a, PyPart, PagedScalars, PyPart, F32<'py>> for Places {
    type Bytes = Part;
    type Scalars = ScalarPart;
    type Floats = Part;
    type Table = Vec<f32>;
    type Error = PyErr;
    fn bytes(&mut self, &(offset, row_bytes): &'a PyPart, _: Field<'_>) -> PyResult<Part> {
        Ok(Part { offset, row_bytes })
    }
    fn scalars(&mut self, s: &'a PagedScalars, at: Field<'_>) -> PyResult<ScalarPart> {
        let (offset, row_bytes, name) = match &s.0 {
            ScalarParts::Plain(p) => p,
            ScalarParts::Log { .. } => {
                return Err(arg_error(format!(
                "{at}: the paged kernel reads float16/float32 stored scalars, not log-coded ones"
            )))
            }
        };
        let dtype = match Dtype::from_name(name) {
            Some(d @ (Dtype::F16 | Dtype::F32)) => d,
            _ => {
                return Err(arg_error(format!(
                    "{at}: expected stored scalars of dtype 'float16' or 'float32', got {name:?}"
                )))
            }
        };
        Ok(ScalarPart {
            part: Part {
                offset: *offset,
                row_bytes: *row_bytes,
            },
            dtype,
        })
    }
    fn floats(&mut self, &(offset, row_bytes): &'a PyPart, _: Field<'_>) -> PyResult<Part> {
        Ok(Part { offset, row_bytes })
    }
    fn table(&mut self, a: &'a F32<'py>, at: Field<'_>) -> PyResult<Vec<f32>> {
        Ok(slice_at(a, at)?.to_vec())
    }
}

/// The places of one side's parts.
fn rows(r: &PagedPyRows<'_>, side: &str) -> PyResult<PagedRows> {
    r.0.map(side, &mut Places)
}

/// Both sides' rows as the paged kernel reads them: each part's place in a page and the
/// tables by value, read from the row objects once (per layer and block size) rather than on
/// every call.
#[pyclass(name = "PageRows", module = "kvqrs._native", frozen)]
pub struct PyPageRows {
    keys: PagedRows,
    values: PagedRows,
}

#[pymethods]
impl PyPageRows {
    #[new]
    fn new(keys: PagedPyRows<'_>, values: PagedPyRows<'_>) -> PyResult<Self> {
        Ok(Self {
            keys: rows(&keys, "keys")?,
            values: rows(&values, "values")?,
        })
    }
}

/// The borrowed cache bytes with their geometry.
fn paged_cache<'a>(
    cache: &'a PyReadonlyArray1<'_, u8>,
    (blocks, kv_heads, block_size): (usize, usize, usize),
    (page_bytes, block_stride, head_stride): (usize, usize, usize),
) -> PyResult<PagedCache<'a>> {
    Ok(PagedCache {
        data: slice(cache, "cache")?,
        blocks,
        kv_heads,
        block_size,
        page_bytes,
        block_stride,
        head_stride,
    })
}

/// Returns float32 tokens x q_heads x head_dim, flat.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (cache, blocks, kv_heads, block_size, page_bytes, block_stride, head_stride, rows, q, q_heads, head_dim, scale, seq, lengths, block_table, table_width))]
pub fn paged_decode_attention<'py>(
    py: Python<'py>,
    cache: PyReadonlyArray1<'py, u8>,
    blocks: usize,
    kv_heads: usize,
    block_size: usize,
    page_bytes: usize,
    block_stride: usize,
    head_stride: usize,
    rows: PyRef<'py, PyPageRows>,
    q: PyReadonlyArray1<'py, f32>,
    q_heads: usize,
    head_dim: usize,
    scale: f32,
    seq: PyReadonlyArray1<'py, i32>,
    lengths: PyReadonlyArray1<'py, i32>,
    block_table: PyReadonlyArray1<'py, i32>,
    table_width: usize,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let (kr, vr) = (&rows.keys, &rows.values);
    let c = paged_cache(
        &cache,
        (blocks, kv_heads, block_size),
        (page_bytes, block_stride, head_stride),
    )?;
    let qs = PagedQueries {
        q: slice(&q, "q")?,
        q_heads,
        head_dim,
        scale,
        seq: slice(&seq, "seq")?,
        lengths: slice(&lengths, "lengths")?,
        block_table: slice(&block_table, "block_table")?,
        table_width,
    };
    let out = py_result(py.allow_threads(|| core_paged(&c, kr, vr, &qs)))?;
    Ok(PyArray1::from_vec(py, out))
}

/// Decoded keys and values, flat float32 arrays.
type KeysValues<'py> = (Bound<'py, PyArray1<f32>>, Bound<'py, PyArray1<f32>>);

/// Returns keys and values float32, each per sequence kv_heads x length x head_dim, flat.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (cache, blocks, kv_heads, block_size, page_bytes, block_stride, head_stride, rows, head_dim, seq, lengths, block_table, table_width))]
pub fn paged_reconstruct<'py>(
    py: Python<'py>,
    cache: PyReadonlyArray1<'py, u8>,
    blocks: usize,
    kv_heads: usize,
    block_size: usize,
    page_bytes: usize,
    block_stride: usize,
    head_stride: usize,
    rows: PyRef<'py, PyPageRows>,
    head_dim: usize,
    seq: PyReadonlyArray1<'py, i32>,
    lengths: PyReadonlyArray1<'py, i32>,
    block_table: PyReadonlyArray1<'py, i32>,
    table_width: usize,
) -> PyResult<KeysValues<'py>> {
    let (kr, vr) = (&rows.keys, &rows.values);
    let c = paged_cache(
        &cache,
        (blocks, kv_heads, block_size),
        (page_bytes, block_stride, head_stride),
    )?;
    let seqs = PagedSequences {
        seq: slice(&seq, "seq")?,
        lengths: slice(&lengths, "lengths")?,
        block_table: slice(&block_table, "block_table")?,
        table_width,
    };
    let (k, v) = py_result(py.allow_threads(|| core_reconstruct(&c, kr, vr, &seqs, head_dim)))?;
    Ok((PyArray1::from_vec(py, k), PyArray1::from_vec(py, v)))
}

/// `(side: 0 keys / 1 values, part name, offset, row_bytes, dtype name)`: one part of a slot.
type PySlotPart = (usize, String, usize, usize, String);

/// A layer's slot writer (`kvqrs_core::paged_write`): its native key and value encoders
/// (`kvqrs.hf.store.NativeEncoder`) and its slot's parts, declared once.
#[pyclass(name = "SlotWriter", module = "kvqrs._native")]
pub struct PySlotWriter {
    inner: SlotWriter,
}

#[pymethods]
impl PySlotWriter {
    #[new]
    fn new(
        keys: EncoderSpec,
        values: EncoderSpec,
        parts: Vec<PySlotPart>,
        head_dim: usize,
    ) -> PyResult<Self> {
        let (ke, ve) = (side_encoder(keys, "keys")?, side_encoder(values, "values")?);
        let parts = parts
            .into_iter()
            .map(|(side, name, offset, row_bytes, dtype_name)| {
                let dtype = dtype(&dtype_name, &format!("parts: {name}"))?;
                Ok(SlotPart {
                    side,
                    name,
                    offset,
                    row_bytes,
                    dtype,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self {
            inner: py_result(SlotWriter::new(ke, ve, parts, head_dim))?,
        })
    }

    /// Encodes `keys` and `values` (tokens x kv_heads x head_dim float32, flat) and writes
    /// token `i` into slot `slots[i]` of the pages in `cache` (flat uint8, from the first page
    /// to the end of the last, written in place; negative slots are padding), GIL released.
    /// Raises, nothing written, for shapes that do not match, a slot beyond the cache,
    /// non-finite values or a part that does not fit its slot.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        cache: &Bound<'_, PyArray1<u8>>,
        blocks: usize,
        kv_heads: usize,
        block_size: usize,
        block_stride: usize,
        head_stride: usize,
        keys: PyReadonlyArray1<'_, f32>,
        values: PyReadonlyArray1<'_, f32>,
        slots: PyReadonlyArray1<'_, i64>,
    ) -> PyResult<()> {
        let mut rw = cache
            .try_readwrite()
            .map_err(|e| arg_error(format!("cache: cannot write the array ({e})")))?;
        let data = rw
            .as_slice_mut()
            .map_err(|_| arg_error("cache: expected a contiguous byte view".into()))?;
        let geom = PageGeometry {
            blocks,
            kv_heads,
            block_size,
            block_stride,
            head_stride,
        };
        let (k, v, s) = (
            slice(&keys, "keys")?,
            slice(&values, "values")?,
            slice(&slots, "slots")?,
        );
        let inner = &self.inner;
        py_result(py.allow_threads(|| inner.write(data, &geom, k, v, s)))
    }

    /// A whole step of the layer in one call (GIL released): `write` of the step's new keys
    /// and values into their slots, then `paged_decode_attention` of `q` over the pages (the
    /// new tokens included). Raises, nothing written, when the write refuses its input; the
    /// attention's errors after the write leave the new tokens written.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (cache, blocks, kv_heads, block_size, block_stride, head_stride, new_keys, new_values, slots, rows, q, q_heads, head_dim, scale, seq, lengths, block_table, table_width))]
    fn step<'py>(
        &self,
        py: Python<'py>,
        cache: &Bound<'py, PyArray1<u8>>,
        blocks: usize,
        kv_heads: usize,
        block_size: usize,
        block_stride: usize,
        head_stride: usize,
        new_keys: PyReadonlyArray1<'py, f32>,
        new_values: PyReadonlyArray1<'py, f32>,
        slots: PyReadonlyArray1<'py, i64>,
        rows: PyRef<'py, PyPageRows>,
        q: PyReadonlyArray1<'py, f32>,
        q_heads: usize,
        head_dim: usize,
        scale: f32,
        seq: PyReadonlyArray1<'py, i32>,
        lengths: PyReadonlyArray1<'py, i32>,
        block_table: PyReadonlyArray1<'py, i32>,
        table_width: usize,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        if head_dim != self.inner.head_dim() {
            return Err(arg_error(format!(
                "head_dim: expected the writer's {}, got {head_dim}",
                self.inner.head_dim()
            )));
        }
        let (kr, vr) = (&rows.keys, &rows.values);
        let mut rw = cache
            .try_readwrite()
            .map_err(|e| arg_error(format!("cache: cannot write the array ({e})")))?;
        let data = rw
            .as_slice_mut()
            .map_err(|_| arg_error("cache: expected a contiguous byte view".into()))?;
        let geom = PageGeometry {
            blocks,
            kv_heads,
            block_size,
            block_stride,
            head_stride,
        };
        let (nk, nv, s) = (
            slice(&new_keys, "new_keys")?,
            slice(&new_values, "new_values")?,
            slice(&slots, "slots")?,
        );
        let qs = PagedQueries {
            q: slice(&q, "q")?,
            q_heads,
            head_dim,
            scale,
            seq: slice(&seq, "seq")?,
            lengths: slice(&lengths, "lengths")?,
            block_table: slice(&block_table, "block_table")?,
            table_width,
        };
        let inner = &self.inner;
        let out = py_result(py.allow_threads(|| {
            inner.write(data, &geom, nk, nv, s)?;
            let c = PagedCache {
                data,
                blocks,
                kv_heads,
                block_size,
                page_bytes: block_size * inner.slot_bytes(),
                block_stride,
                head_stride,
            };
            core_paged(&c, kr, vr, &qs)
        }))?;
        Ok(PyArray1::from_vec(py, out))
    }

    /// Bytes of one slot.
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes()
    }
}
