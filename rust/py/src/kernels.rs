//! `*_py` wrappers of the core kernels: borrow and validate with the GIL held, run the core
//! with the GIL released, return new NumPy arrays (flat; the Python layer restores shapes).

use half::f16;
use half::slice::HalfFloatSliceExt;
use kvqrs_core::kernels::absmax;
use kvqrs_core::kernels::hadamard::Rotation;
use kvqrs_core::kernels::headq::HeadqCoder;
use kvqrs_core::kernels::lloyd_max::codebook;
use kvqrs_core::kernels::log_scalars;
use kvqrs_core::kernels::mse::{MseQuantizer, RowScale};
use kvqrs_core::kernels::mse_qjl::MseQjlEncoder;
use kvqrs_core::kernels::pack;
use kvqrs_core::kernels::qjl::QjlSketcher;
use kvqrs_core::kernels::uniform::UniformQuantizer;
use kvqrs_core::rng;
use kvqrs_core::simd::{self, Isa, PackPath};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::{plane_to_py, slice, Scalars};
use crate::errors::{arg_error, py_result};

type F32Out<'py> = Bound<'py, PyArray1<f32>>;
type U8Out<'py> = Bound<'py, PyArray1<u8>>;
type CodebookOut<'py> = (Bound<'py, PyArray1<f64>>, Bound<'py, PyArray1<f64>>, f64);

fn bits_u32(bits: i64) -> u32 {
    // Out-of-range values become an invalid width that the core rejects with the real value.
    u32::try_from(bits).unwrap_or(u32::MAX)
}

#[pyfunction]
pub fn pack_bits<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    count: usize,
    bits: i64,
) -> PyResult<U8Out<'py>> {
    let c = slice(&codes, "codes")?;
    let out = py_result(py.allow_threads(|| pack::pack(c, count, bits_u32(bits))))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
pub fn unpack_bits<'py>(
    py: Python<'py>,
    packed: PyReadonlyArray1<'py, u8>,
    count: usize,
    bits: i64,
) -> PyResult<U8Out<'py>> {
    let p = slice(&packed, "packed")?;
    let out = py_result(py.allow_threads(|| pack::unpack(p, count, bits_u32(bits))))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
#[pyo3(signature = (x, head_dim, seed=None))]
pub fn hadamard<'py>(
    py: Python<'py>,
    x: PyReadonlyArray1<'py, f32>,
    head_dim: usize,
    seed: Option<u64>,
) -> PyResult<F32Out<'py>> {
    let xs = slice(&x, "x")?;
    let out = py_result(py.allow_threads(|| Rotation::new(head_dim, seed)?.forward(xs)))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
#[pyo3(signature = (y, head_dim, seed=None))]
pub fn inverse_hadamard<'py>(
    py: Python<'py>,
    y: PyReadonlyArray1<'py, f32>,
    head_dim: usize,
    seed: Option<u64>,
) -> PyResult<F32Out<'py>> {
    let ys = slice(&y, "y")?;
    let out = py_result(py.allow_threads(|| Rotation::new(head_dim, seed)?.inverse(ys)))?;
    Ok(PyArray1::from_vec(py, out))
}

/// Returns (centroids float64, boundaries float64, distortion per coordinate).
#[pyfunction]
pub fn lloyd_max_codebook<'py>(
    py: Python<'py>,
    dim: usize,
    bits: i64,
) -> PyResult<CodebookOut<'py>> {
    let cb = py_result(py.allow_threads(|| codebook(dim, bits_u32(bits))))?;
    Ok((
        PyArray1::from_slice(py, &cb.centroids),
        PyArray1::from_slice(py, &cb.boundaries),
        cb.distortion,
    ))
}

/// `row_len` is the caller's row length, used only to name the position of a NaN or Inf.
#[pyfunction]
pub fn lloyd_max_encode<'py>(
    py: Python<'py>,
    x: PyReadonlyArray1<'py, f32>,
    dim: usize,
    bits: i64,
    row_len: usize,
) -> PyResult<U8Out<'py>> {
    let xs = slice(&x, "x")?;
    let out = py_result(py.allow_threads(|| {
        let cb = codebook(dim, bits_u32(bits))?;
        kvqrs_core::kernels::check_finite("x", xs, row_len.max(1))?;
        let mut codes = vec![0u8; xs.len()];
        cb.encode_into(xs, &mut codes);
        Ok(codes)
    }))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
pub fn lloyd_max_decode<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    dim: usize,
    bits: i64,
) -> PyResult<F32Out<'py>> {
    let cs = slice(&codes, "codes")?;
    let out = py_result(py.allow_threads(|| {
        let b = bits_u32(bits);
        let cb = codebook(dim, b)?;
        kvqrs_core::kernels::check_codes("codes", cs, dim, b)?;
        let mut out = vec![0.0f32; cs.len()];
        cb.decode_into(cs, &mut out);
        Ok(out)
    }))?;
    Ok(PyArray1::from_vec(py, out))
}

/// The quantizer of an encode call: `scale` is `"norm"`, `"least_squares"` or `"preserve_norm"`.
fn mse_quantizer(
    head_dim: usize,
    bits: i64,
    seed: Option<u64>,
    scale: &str,
) -> PyResult<MseQuantizer> {
    let mode = RowScale::from_name(scale).ok_or_else(|| {
        arg_error(format!(
            "scale: expected 'norm', 'least_squares' or 'preserve_norm', got {scale:?}"
        ))
    })?;
    Ok(py_result(MseQuantizer::new(head_dim, bits_u32(bits), seed))?.with_scale(mode))
}

/// Returns (codes uint8 flat, norms float16|float32); `scale`: what each row stores,
/// `"norm"`, `"least_squares"` or `"preserve_norm"`.
#[pyfunction]
#[pyo3(signature = (x, head_dim, bits, seed=None, scale="norm"))]
pub fn mse_encode<'py>(
    py: Python<'py>,
    x: PyReadonlyArray1<'py, f32>,
    head_dim: usize,
    bits: i64,
    seed: Option<u64>,
    scale: &str,
) -> PyResult<(U8Out<'py>, Bound<'py, PyAny>)> {
    let xs = slice(&x, "x")?;
    let q = mse_quantizer(head_dim, bits, seed, scale)?;
    let c = py_result(py.allow_threads(|| q.encode(xs)))?;
    Ok((PyArray1::from_vec(py, c.codes), plane_to_py(py, c.norms)))
}

#[pyfunction]
#[pyo3(signature = (codes, norms, head_dim, bits, seed=None))]
pub fn mse_decode<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    norms: Scalars<'py>,
    head_dim: usize,
    bits: i64,
    seed: Option<u64>,
) -> PyResult<F32Out<'py>> {
    let (c, n) = (slice(&codes, "codes")?, norms.view("norms")?);
    let out =
        py_result(py.allow_threads(|| {
            MseQuantizer::new(head_dim, bits_u32(bits), seed)?.decode_parts(c, n)
        }))?;
    Ok(PyArray1::from_vec(py, out))
}

/// Returns (packed codes uint8 flat, `packed_len(code_dim, bits)` bytes per row, norms
/// float16|float32): `mse_encode` then `pack_bits`, fused row by row.
#[pyfunction]
#[pyo3(signature = (x, head_dim, bits, seed=None, scale="norm"))]
pub fn mse_encode_packed<'py>(
    py: Python<'py>,
    x: PyReadonlyArray1<'py, f32>,
    head_dim: usize,
    bits: i64,
    seed: Option<u64>,
    scale: &str,
) -> PyResult<(U8Out<'py>, Bound<'py, PyAny>)> {
    let xs = slice(&x, "x")?;
    let q = mse_quantizer(head_dim, bits, seed, scale)?;
    let (packed, norms) = py_result(py.allow_threads(|| q.encode_packed(xs)))?;
    Ok((PyArray1::from_vec(py, packed), plane_to_py(py, norms)))
}

/// Returns (packed codes uint8 flat, `packed_len(code_dim, bits - 1)` bytes per row, norms
/// float16|float32, sketch signs uint8 flat, `ceil(code_dim / 8)` bytes per row, residual
/// norms float16|float32): the `(bits - 1)`-bit `mse_encode_packed` of rows of head_dim values
/// and the QJL sketch (`m = code_dim`, seed `qjl_seed`) of their rotated residual
/// `hadamard(x) - norm * centroids[codes]`, in one call. Equivalent to those kernels in
/// sequence, byte for byte.
#[pyfunction]
pub fn mse_qjl_encode_packed<'py>(
    py: Python<'py>,
    x: PyReadonlyArray1<'py, f32>,
    head_dim: usize,
    bits: i64,
    seed: u64,
    qjl_seed: u64,
) -> PyResult<(U8Out<'py>, Bound<'py, PyAny>, U8Out<'py>, Bound<'py, PyAny>)> {
    let xs = slice(&x, "x")?;
    let codes = py_result(py.allow_threads(|| {
        MseQjlEncoder::new(head_dim, bits_u32(bits), seed, qjl_seed)?.encode(xs)
    }))?;
    Ok((
        PyArray1::from_vec(py, codes.packed),
        plane_to_py(py, codes.norms),
        PyArray1::from_vec(py, codes.sketch.signs),
        plane_to_py(py, codes.sketch.norms),
    ))
}

/// `unpack_bits` then `mse_decode`, fused row by row.
#[pyfunction]
#[pyo3(signature = (packed, norms, head_dim, bits, seed=None))]
pub fn mse_decode_packed<'py>(
    py: Python<'py>,
    packed: PyReadonlyArray1<'py, u8>,
    norms: Scalars<'py>,
    head_dim: usize,
    bits: i64,
    seed: Option<u64>,
) -> PyResult<F32Out<'py>> {
    let (c, n) = (slice(&packed, "packed")?, norms.view("norms")?);
    let out =
        py_result(py.allow_threads(|| {
            MseQuantizer::new(head_dim, bits_u32(bits), seed)?.decode_packed(c, n)
        }))?;
    Ok(PyArray1::from_vec(py, out))
}

/// Returns (packed sign bits uint8 flat, norms float16|float32).
#[pyfunction]
pub fn qjl_sketch<'py>(
    py: Python<'py>,
    r: PyReadonlyArray1<'py, f32>,
    dim: usize,
    m: usize,
    seed: u64,
) -> PyResult<(U8Out<'py>, Bound<'py, PyAny>)> {
    let rs = slice(&r, "r")?;
    let sk = py_result(py.allow_threads(|| QjlSketcher::cached(dim, m, seed)?.sketch(rs)))?;
    Ok((PyArray1::from_vec(py, sk.signs), plane_to_py(py, sk.norms)))
}

#[pyfunction]
pub fn qjl_inner_product<'py>(
    py: Python<'py>,
    y: PyReadonlyArray1<'py, f32>,
    signs: PyReadonlyArray1<'py, u8>,
    norms: Scalars<'py>,
    dim: usize,
    m: usize,
    seed: u64,
) -> PyResult<F32Out<'py>> {
    let ys = slice(&y, "y")?;
    let (s, n) = (slice(&signs, "signs")?, norms.view("norms")?);
    let out = py_result(
        py.allow_threads(|| QjlSketcher::cached(dim, m, seed)?.inner_product_parts(ys, s, n)),
    )?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
pub fn qjl_vector_estimate<'py>(
    py: Python<'py>,
    signs: PyReadonlyArray1<'py, u8>,
    norms: Scalars<'py>,
    dim: usize,
    m: usize,
    seed: u64,
) -> PyResult<F32Out<'py>> {
    let (s, n) = (slice(&signs, "signs")?, norms.view("norms")?);
    let out = py_result(
        py.allow_threads(|| QjlSketcher::cached(dim, m, seed)?.vector_estimate_parts(s, n)),
    )?;
    Ok(PyArray1::from_vec(py, out))
}

/// Returns (codes uint8 flat, scales float16|float32).
#[pyfunction]
pub fn headq_encode<'py>(
    py: Python<'py>,
    e: PyReadonlyArray1<'py, f32>,
    basis: PyReadonlyArray1<'py, f32>,
    head_dim: usize,
    rank: usize,
    bits: i64,
) -> PyResult<(U8Out<'py>, Bound<'py, PyAny>)> {
    let es = slice(&e, "residual")?;
    let us = slice(&basis, "basis")?;
    let c = py_result(
        py.allow_threads(|| HeadqCoder::new(us, head_dim, rank, bits_u32(bits))?.encode(es)),
    )?;
    Ok((PyArray1::from_vec(py, c.codes), plane_to_py(py, c.scales)))
}

#[pyfunction]
pub fn headq_decode<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    scales: Scalars<'py>,
    basis: PyReadonlyArray1<'py, f32>,
    head_dim: usize,
    rank: usize,
    bits: i64,
) -> PyResult<F32Out<'py>> {
    let us = slice(&basis, "basis")?;
    let (c, s) = (slice(&codes, "codes")?, scales.view("scales")?);
    let out = py_result(py.allow_threads(|| {
        HeadqCoder::new(us, head_dim, rank, bits_u32(bits))?.decode_parts(c, s)
    }))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn headq_score_correction<'py>(
    py: Python<'py>,
    q: PyReadonlyArray1<'py, f32>,
    codes: PyReadonlyArray1<'py, u8>,
    scales: Scalars<'py>,
    basis: PyReadonlyArray1<'py, f32>,
    head_dim: usize,
    rank: usize,
    bits: i64,
) -> PyResult<F32Out<'py>> {
    let qs = slice(&q, "q")?;
    let us = slice(&basis, "basis")?;
    let (c, s) = (slice(&codes, "codes")?, scales.view("scales")?);
    let out = py_result(py.allow_threads(|| {
        HeadqCoder::new(us, head_dim, rank, bits_u32(bits))?.score_correction_parts(qs, c, s)
    }))?;
    Ok(PyArray1::from_vec(py, out))
}

/// The instruction-set path the kernels use now (`scalar`, `avx2`, `avx512`, `neon`).
#[pyfunction]
pub fn simd_level() -> &'static str {
    simd::active().name()
}

/// The paths this CPU supports, scalar first, fastest last.
#[pyfunction]
pub fn simd_available() -> Vec<&'static str> {
    Isa::available().into_iter().map(Isa::name).collect()
}

/// Forces a path for the whole process (`None` restores the default: the fastest, or scalar
/// under `KVQRS_FORCE_SCALAR=1`). Raises for an unknown or unsupported name.
#[pyfunction]
#[pyo3(signature = (name=None))]
pub fn set_isa(name: Option<&str>) -> PyResult<()> {
    let isa = match name {
        None => None,
        Some(n) => Some(Isa::from_name(n).ok_or_else(|| {
            arg_error(format!(
                "name: expected one of scalar, avx2, avx512, neon or None, got {n:?}"
            ))
        })?),
    };
    py_result(simd::set_active(isa))
}

/// Forces the bit-packing path (`scalar`, `bmi2`, `shift`) for the whole process (`None`
/// restores the default). Raises for an unknown name or a path this CPU cannot run.
#[pyfunction]
#[pyo3(signature = (name=None))]
pub fn set_pack_path(name: Option<&str>) -> PyResult<()> {
    let path = match name {
        None => None,
        Some(n) => Some(PackPath::from_name(n).ok_or_else(|| {
            arg_error(format!(
                "name: expected one of scalar, bmi2, shift or None, got {n:?}"
            ))
        })?),
    };
    py_result(simd::set_pack_path(path))
}

/// The dispatch state now, as a dict: `vendor` (str), `family`, `model` (int), `brand` (str),
/// `features` ({name: bool} for avx2, bmi2, avx512f/bw/vl, f16c, fma), `isa` (the active
/// path), `isas` and `pack_paths` (supported, list[str]), and `primitives`: {"pack" |
/// "unpack" | "float kernels": {"path": str, "reason": str}}.
#[pyfunction]
pub fn simd_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let info = simd::info();
    let d = PyDict::new(py);
    d.set_item("vendor", &info.cpu.vendor)?;
    d.set_item("family", info.cpu.family)?;
    d.set_item("model", info.cpu.model)?;
    d.set_item("brand", &info.cpu.brand)?;
    let features = PyDict::new(py);
    for &(name, on) in &info.cpu.features {
        features.set_item(name, on)?;
    }
    d.set_item("features", features)?;
    d.set_item("isa", info.isa.name())?;
    let isas: Vec<&str> = info.isas.iter().map(|i| i.name()).collect();
    d.set_item("isas", isas)?;
    let paths: Vec<&str> = info.pack_paths.iter().map(|p| p.name()).collect();
    d.set_item("pack_paths", paths)?;
    let primitives = PyDict::new(py);
    for p in &info.primitives {
        let entry = PyDict::new(py);
        entry.set_item("path", p.path)?;
        entry.set_item("reason", &p.reason)?;
        primitives.set_item(p.name, entry)?;
    }
    d.set_item("primitives", primitives)?;
    Ok(d)
}

/// [`simd_info`] on one line (`vendor fam .. model .. | isa .. | pack/unpack .. (reason) | ...`).
#[pyfunction]
pub fn simd_summary() -> String {
    simd::summary()
}

#[pyfunction]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    rng::philox4x32_10(counter, key)
}

#[pyfunction]
pub fn rotation_signs<'py>(py: Python<'py>, seed: u64, dim: usize) -> PyResult<F32Out<'py>> {
    py_result(kvqrs_core::kernels::check_row_len("dim", dim))?;
    Ok(PyArray1::from_vec(py, rng::rotation_signs(seed, dim)))
}

#[pyfunction]
pub fn gaussians<'py>(
    py: Python<'py>,
    seed: u64,
    stream: u32,
    count: usize,
) -> PyResult<F32Out<'py>> {
    py_result(kvqrs_core::kernels::check_matrix("count", count, 1))?;
    Ok(PyArray1::from_vec(
        py,
        py.allow_threads(|| rng::gaussians(seed, stream, count)),
    ))
}

#[pyfunction]
pub fn random_orthonormal_basis<'py>(
    py: Python<'py>,
    seed: u64,
    head_dim: usize,
    rank: usize,
) -> PyResult<F32Out<'py>> {
    let out = py_result(py.allow_threads(|| rng::random_orthonormal_basis(seed, head_dim, rank)))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
pub fn qjl_matrix<'py>(py: Python<'py>, seed: u64, m: usize, dim: usize) -> PyResult<F32Out<'py>> {
    let s = py_result(QjlSketcher::cached(dim, m, seed))?;
    Ok(PyArray1::from_slice(py, s.matrix()))
}

/// Returns (codes uint8 flat, scales float16|float32, zeros float16|float32).
#[pyfunction]
pub fn uniform_encode<'py>(
    py: Python<'py>,
    x: PyReadonlyArray1<'py, f32>,
    n: usize,
    group: usize,
    bits: i64,
) -> PyResult<(U8Out<'py>, Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let xs = slice(&x, "x")?;
    let c = py_result(
        py.allow_threads(|| UniformQuantizer::new(n, group, bits_u32(bits))?.encode(xs)),
    )?;
    Ok((
        PyArray1::from_vec(py, c.codes),
        plane_to_py(py, c.scales),
        plane_to_py(py, c.zeros),
    ))
}

#[pyfunction]
pub fn uniform_decode<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    scales: Scalars<'py>,
    zeros: Scalars<'py>,
    n: usize,
    group: usize,
    bits: i64,
) -> PyResult<F32Out<'py>> {
    let c = slice(&codes, "codes")?;
    let (s, z) = (scales.view("scales")?, zeros.view("zeros")?);
    let out =
        py_result(py.allow_threads(|| {
            UniformQuantizer::new(n, group, bits_u32(bits))?.decode_parts(c, s, z)
        }))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
pub fn absmax_encode<'py>(
    py: Python<'py>,
    x: PyReadonlyArray1<'py, f32>,
    widths: PyReadonlyArray1<'py, u8>,
) -> PyResult<(U8Out<'py>, Bound<'py, PyArray1<f16>>)> {
    let (xs, w) = (slice(&x, "x")?, slice(&widths, "widths")?);
    let c = py_result(py.allow_threads(|| absmax::encode(xs, w)))?;
    let scales: Vec<f16> = c.scales.into_iter().map(f16::from_bits).collect();
    Ok((
        PyArray1::from_vec(py, c.codes),
        PyArray1::from_vec(py, scales),
    ))
}

#[pyfunction]
pub fn absmax_decode<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    scales: PyReadonlyArray1<'py, f16>,
    widths: PyReadonlyArray1<'py, u8>,
) -> PyResult<F32Out<'py>> {
    let (c, w) = (slice(&codes, "codes")?, slice(&widths, "widths")?);
    let s: &[u16] = slice(&scales, "scales")?.reinterpret_cast();
    let out = py_result(py.allow_threads(|| absmax::decode(c, s, w)))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
pub fn log_encode<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, f32>,
    n: usize,
    group: usize,
) -> PyResult<(U8Out<'py>, U8Out<'py>)> {
    let v = slice(&values, "values")?;
    let (codes, exps) = py_result(py.allow_threads(|| log_scalars::encode(v, n, group)))?;
    Ok((PyArray1::from_vec(py, codes), PyArray1::from_vec(py, exps)))
}

#[pyfunction]
pub fn log_decode<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    exps: PyReadonlyArray1<'py, u8>,
    n: usize,
    group: usize,
) -> PyResult<F32Out<'py>> {
    let (c, e) = (slice(&codes, "codes")?, slice(&exps, "exps")?);
    let out = py_result(py.allow_threads(|| log_scalars::decode(c, e, n, group)))?;
    Ok(PyArray1::from_vec(py, out))
}
