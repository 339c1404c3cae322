//! `kvqrs._native`: the private PyO3 module over kvqrs-core. The public API is the Python
//! package `kvqrs`; nothing here is meant to be called directly.

mod arrays;
mod attention;
mod errors;
mod format;
mod kernels;
mod paged;
mod rows;
mod store;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("KvqrsError", m.py().get_type::<errors::KvqrsError>())?;
    m.add(
        "MAX_CODEBOOK_DIM",
        kvqrs_core::kernels::lloyd_max::MAX_CODEBOOK_DIM,
    )?;
    m.add("MAX_STATE", kvqrs_core::window::MAX_STATE)?;
    // The one dtype table: each dtype's NumPy name, container code and bytes per element.
    let dtypes = pyo3::types::PyDict::new(m.py());
    for d in kvqrs_core::dtype::Dtype::ALL {
        dtypes.set_item(d.name(), (d as u8, d.itemsize()))?;
    }
    m.add("DTYPES", dtypes)?;
    m.add_function(wrap_pyfunction!(kernels::pack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::unpack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::hadamard, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::inverse_hadamard, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::lloyd_max_codebook, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::lloyd_max_encode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::lloyd_max_decode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::mse_encode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::mse_decode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::mse_encode_packed, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::mse_decode_packed, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::mse_qjl_encode_packed, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::qjl_sketch, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::qjl_inner_product, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::qjl_vector_estimate, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::headq_encode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::headq_decode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::headq_score_correction, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::simd_available, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::set_isa, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::set_pack_path, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::simd_info, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::simd_summary, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::philox4x32_10, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::rotation_signs, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gaussians, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::random_orthonormal_basis, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::qjl_matrix, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::uniform_encode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::uniform_decode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::absmax_encode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::absmax_decode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::log_encode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::log_decode, m)?)?;
    m.add_function(wrap_pyfunction!(format::container_write, m)?)?;
    m.add_function(wrap_pyfunction!(format::container_read, m)?)?;
    m.add_function(wrap_pyfunction!(attention::decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(paged::paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(paged::paged_reconstruct, m)?)?;
    m.add_class::<store::PyLayerStore>()?;
    m.add_class::<paged::PySlotWriter>()?;
    m.add_class::<paged::PyPageRows>()?;
    m.add_function(wrap_pyfunction!(store::window_append, m)?)?;
    m.add_function(wrap_pyfunction!(store::attend_full_precision, m)?)?;
    m.add_function(wrap_pyfunction!(store::storable, m)?)?;
    Ok(())
}
