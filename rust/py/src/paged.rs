//! Binding of the paged decode attention kernel: the cache arrives as one flat uint8 array (the
//! layer's pages, borrowed), each side's slot layout as a dict of `(offset, row_bytes[, dtype])`
//! tuples (built and checked by `kvqrs.vllm.layout`); the GIL is released for the kernel.

use kvqrs_core::kernels::paged::{
    paged_decode_attention as core_paged, PagedCache, PagedQjl, PagedQueries, PagedRows, Part,
    Scalar, ScalarPart,
};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::slice;
use crate::errors::{arg_error, py_result};

fn get<'py, T: FromPyObject<'py>>(d: &Bound<'py, PyDict>, side: &str, key: &str) -> PyResult<T> {
    match d.get_item(key)? {
        None => Err(arg_error(format!("{side}.{key}: required"))),
        Some(v) => v
            .extract::<T>()
            .map_err(|e| arg_error(format!("{side}.{key}: {e}"))),
    }
}

fn part(d: &Bound<'_, PyDict>, side: &str, key: &str) -> PyResult<Part> {
    let (offset, row_bytes): (usize, usize) = get(d, side, key)?;
    Ok(Part { offset, row_bytes })
}

fn kind(name: &str, side: &str, key: &str) -> PyResult<Scalar> {
    match name {
        "float16" => Ok(Scalar::F16),
        "float32" => Ok(Scalar::F32),
        other => Err(arg_error(format!(
            "{side}.{key}: expected stored scalars of dtype 'float16' or 'float32', got {other:?}"
        ))),
    }
}

fn scalar_part(d: &Bound<'_, PyDict>, side: &str, key: &str) -> PyResult<ScalarPart> {
    let (offset, row_bytes, dtype): (usize, usize, String) = get(d, side, key)?;
    Ok(ScalarPart {
        part: Part { offset, row_bytes },
        kind: kind(&dtype, side, key)?,
    })
}

fn rows(d: &Bound<'_, PyDict>, side: &str) -> PyResult<PagedRows> {
    let k: String = get(d, side, "kind")?;
    let bits: u32 = get(d, side, "bits")?;
    let seed: Option<u64> = get(d, side, "seed")?;
    match k.as_str() {
        "mse" => {
            let qjl = match d.get_item("qjl_seed")? {
                Some(s) if !s.is_none() => Some(PagedQjl {
                    signs: part(d, side, "qjl_signs")?,
                    norms: scalar_part(d, side, "qjl_norms")?,
                    seed: s
                        .extract()
                        .map_err(|e| arg_error(format!("{side}.qjl_seed: {e}")))?,
                }),
                _ => None,
            };
            Ok(PagedRows::Mse {
                codes: part(d, side, "codes")?,
                norms: scalar_part(d, side, "norms")?,
                bits,
                seed,
                qjl,
            })
        }
        "uniform_tokens" => {
            let scales = scalar_part(d, side, "scales")?;
            let zeros = scalar_part(d, side, "zeros")?;
            if scales.kind != zeros.kind {
                return Err(arg_error(format!(
                    "{side}.zeros: expected the scales' dtype"
                )));
            }
            Ok(PagedRows::UniformTokens {
                codes: part(d, side, "codes")?,
                scales: scales.part,
                zeros: zeros.part,
                kind: scales.kind,
                bits,
                group: get(d, side, "group")?,
                seed,
            })
        }
        other => Err(arg_error(format!(
            "{side}.kind: expected 'mse' or 'uniform_tokens' (per-token layouts), got {other:?}"
        ))),
    }
}

/// Returns float32 tokens x q_heads x head_dim, flat.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (cache, blocks, kv_heads, block_size, page_bytes, block_stride, head_stride, keys, values, q, q_heads, head_dim, scale, seq, lengths, block_table, table_width))]
pub fn paged_decode_attention<'py>(
    py: Python<'py>,
    cache: PyReadonlyArray1<'py, u8>,
    blocks: usize,
    kv_heads: usize,
    block_size: usize,
    page_bytes: usize,
    block_stride: usize,
    head_stride: usize,
    keys: &Bound<'py, PyDict>,
    values: &Bound<'py, PyDict>,
    q: PyReadonlyArray1<'py, f32>,
    q_heads: usize,
    head_dim: usize,
    scale: f32,
    seq: PyReadonlyArray1<'py, i32>,
    lengths: PyReadonlyArray1<'py, i32>,
    block_table: PyReadonlyArray1<'py, i32>,
    table_width: usize,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let (kr, vr) = (rows(keys, "keys")?, rows(values, "values")?);
    let c = PagedCache {
        data: slice(&cache, "cache")?,
        blocks,
        kv_heads,
        block_size,
        page_bytes,
        block_stride,
        head_stride,
    };
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
    let out = py_result(py.allow_threads(|| core_paged(&c, &kr, &vr, &qs)))?;
    Ok(PyArray1::from_vec(py, out))
}
