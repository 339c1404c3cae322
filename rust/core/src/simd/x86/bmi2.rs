use std::arch::x86_64::{_pdep_u64, _pext_u64};

use crate::simd::shift::{pack_groups, unpack_groups};

/// The mask of the low `bits` bits of each of eight bytes.
fn code_mask(bits: u32) -> u64 {
    0x0101_0101_0101_0101u64 * ((1u64 << bits) - 1)
}

/// Packs with BMI2: `pext` gathers the low `bits` bits of eight code bytes into `8 * bits`
/// contiguous bits, which is the little-endian bit stream of the format.
#[target_feature(enable = "bmi2")]
pub(crate) fn pack_row(codes: &[u8], bits: u32, out: &mut [u8]) {
    let mask = code_mask(bits);
    pack_groups(codes, bits, out, |w| _pext_u64(w, mask));
}

/// Unpacks with BMI2 `pdep`, the inverse of [`pack_row`].
#[target_feature(enable = "bmi2")]
pub(crate) fn unpack_row(packed: &[u8], bits: u32, out: &mut [u8]) {
    let mask = code_mask(bits);
    unpack_groups(packed, bits, out, |w| _pdep_u64(w, mask));
}
