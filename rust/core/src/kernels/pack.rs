//! Bit packing of b-bit codes, 1 <= b <= 8, little-endian bit order within each row
//! (docs/kernels.md section 2).

use super::check_bits;
use crate::error::{KvqError, Result};
use crate::par;
use crate::simd::{self, ops, Isa, PackPath};

/// Bytes needed for one row of `count` codes of `bits` bits.
pub fn packed_len(count: usize, bits: u32) -> usize {
    (count * bits as usize).div_ceil(8)
}

/// Packs `codes` (rows of `count` codes) into rows of `packed_len(count, bits)` bytes.
///
/// Errors: `InvalidBits` for bits outside 1..=8, `ShapeMismatch` if `codes.len()` is not a
/// multiple of `count`, `CodeOutOfRange` for a code >= 2^bits (naming its row and position).
pub fn pack(codes: &[u8], count: usize, bits: u32) -> Result<Vec<u8>> {
    pack_isa(simd::active(), codes, count, bits)
}

/// [`pack`] on a given instruction set (errors if this CPU lacks it).
pub fn pack_with(isa: Isa, codes: &[u8], count: usize, bits: u32) -> Result<Vec<u8>> {
    pack_isa(isa.checked()?, codes, count, bits)
}

fn pack_isa(isa: Isa, codes: &[u8], count: usize, bits: u32) -> Result<Vec<u8>> {
    check_bits("bits", bits)?;
    check_count(count)?;
    let rows = rows_or_empty("codes", codes.len(), count)?;
    let mut out = vec![0u8; rows * packed_len(count, bits)];
    pack_into(isa, codes, count, bits, &mut out)?;
    Ok(out)
}

/// [`pack`] on `isa` (pass [`crate::simd::active`] for the default) into a caller's buffer of
/// `rows * packed_len(count, bits)` bytes; the rows go through the pack path of `isa`
/// ([`simd::pack_path_for`]).
pub fn pack_into(isa: Isa, codes: &[u8], count: usize, bits: u32, out: &mut [u8]) -> Result<()> {
    pack_rows(simd::pack_path_for(isa.checked()?), codes, count, bits, out)
}

/// [`pack_into`] on a given pack path (errors if this CPU lacks it): benches and tests.
pub fn pack_path_into(
    path: PackPath,
    codes: &[u8],
    count: usize,
    bits: u32,
    out: &mut [u8],
) -> Result<()> {
    pack_rows(path.checked()?, codes, count, bits, out)
}

fn pack_rows(path: PackPath, codes: &[u8], count: usize, bits: u32, out: &mut [u8]) -> Result<()> {
    check_bits("bits", bits)?;
    check_count(count)?;
    let rows = rows_or_empty("codes", codes.len(), count)?;
    super::check_codes("codes", codes, count.max(1), bits)?;
    let row_bytes = packed_len(count, bits);
    super::check_len("out", out.len(), rows * row_bytes, "rows x packed bytes")?;
    each_row(rows, count, (codes, count), (out, row_bytes), |src, dst| {
        ops::pack_row_on(path, src, bits, dst)
    });
    Ok(())
}

/// Unpacks rows of `packed_len(count, bits)` bytes into rows of `count` codes.
///
/// Errors: `InvalidBits`, or `ShapeMismatch` if `packed.len()` is not a multiple of the row size.
pub fn unpack(packed: &[u8], count: usize, bits: u32) -> Result<Vec<u8>> {
    unpack_isa(simd::active(), packed, count, bits)
}

/// [`unpack`] on a given instruction set (errors if this CPU lacks it).
pub fn unpack_with(isa: Isa, packed: &[u8], count: usize, bits: u32) -> Result<Vec<u8>> {
    unpack_isa(isa.checked()?, packed, count, bits)
}

fn unpack_isa(isa: Isa, packed: &[u8], count: usize, bits: u32) -> Result<Vec<u8>> {
    check_bits("bits", bits)?;
    check_count(count)?;
    let rows = rows_or_empty("packed", packed.len(), packed_len(count, bits))?;
    let mut out = vec![0u8; rows * count];
    unpack_into(isa, packed, count, bits, &mut out)?;
    Ok(out)
}

/// [`unpack`] on `isa` into a caller's buffer of `rows * count` codes (through the pack path
/// of `isa`).
pub fn unpack_into(isa: Isa, packed: &[u8], count: usize, bits: u32, out: &mut [u8]) -> Result<()> {
    unpack_rows(
        simd::pack_path_for(isa.checked()?),
        packed,
        count,
        bits,
        out,
    )
}

/// [`unpack_into`] on a given pack path (errors if this CPU lacks it): benches and tests.
pub fn unpack_path_into(
    path: PackPath,
    packed: &[u8],
    count: usize,
    bits: u32,
    out: &mut [u8],
) -> Result<()> {
    unpack_rows(path.checked()?, packed, count, bits, out)
}

fn unpack_rows(
    path: PackPath,
    packed: &[u8],
    count: usize,
    bits: u32,
    out: &mut [u8],
) -> Result<()> {
    check_bits("bits", bits)?;
    check_count(count)?;
    let row_bytes = packed_len(count, bits);
    let rows = rows_or_empty("packed", packed.len(), row_bytes)?;
    super::check_len("out", out.len(), rows * count, "rows x count")?;
    each_row(
        rows,
        count,
        (packed, row_bytes),
        (out, count),
        |src, dst| ops::unpack_row_on(path, src, bits, dst),
    );
    Ok(())
}

/// `f(src row, dst row)` for the `rows` rows (of `count` codes) of `src` and `dst`, split over
/// rayon tasks for large batches.
fn each_row(
    rows: usize,
    count: usize,
    (src, src_w): (&[u8], usize),
    (dst, dst_w): (&mut [u8], usize),
    f: impl Fn(&[u8], &mut [u8]) + Sync + Send,
) {
    if count == 0 {
        return;
    }
    let _ = par::rows1(
        rows,
        count / 4,
        (src, src_w),
        (dst, dst_w),
        || (),
        |_, _, s, d| {
            for (a, b) in s.chunks_exact(src_w).zip(d.chunks_exact_mut(dst_w)) {
                f(a, b);
            }
            Ok(())
        },
    );
}

/// Zero codes per row is allowed (empty rows); otherwise the usual row-length limit.
fn check_count(count: usize) -> Result<()> {
    if count == 0 {
        Ok(())
    } else {
        super::check_row_len("count", count)
    }
}

/// Row count of a buffer of rows of `width`; a zero width is only valid for an empty buffer.
fn rows_or_empty(arg: &'static str, len: usize, width: usize) -> Result<usize> {
    if width == 0 {
        return if len == 0 {
            Ok(0)
        } else {
            Err(KvqError::ShapeMismatch {
                arg,
                expected: "an empty buffer for zero codes per row".into(),
                actual: format!("{len} bytes"),
            })
        };
    }
    super::rows_of(arg, len, width)
}

/// Packs one row through a 16-bit window: code i lands at bit offset i*bits.
/// Unpacks `out.len()` codes of one packed row starting at code `start` (bit offset
/// `start * bits`): the read paths take a slice of tokens or channels without unpacking the
/// whole row. The caller guarantees that the row holds codes `start .. start + out.len()`.
pub fn unpack_range(packed: &[u8], bits: u32, start: usize, out: &mut [u8]) {
    crate::simd::scalar::unpack_range(packed, bits, start, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn packs_little_endian() {
        // Codes 1, 2, 3 at 2 bits: 0b11_10_01 = 0x39.
        assert_eq!(pack(&[1, 2, 3], 3, 2).unwrap(), vec![0x39]);
        // 3-bit codes straddle bytes: 5 | 6 << 3 | 7 << 6 = 0x1F5.
        assert_eq!(pack(&[5, 6, 7], 3, 3).unwrap(), vec![0xF5, 0x01]);
    }

    #[test]
    fn rejects_out_of_range_code() {
        let err = pack(&[0, 4], 2, 2).unwrap_err();
        assert!(matches!(
            err,
            KvqError::CodeOutOfRange {
                row: 0,
                col: 1,
                value: 4,
                ..
            }
        ));
    }

    proptest! {
        #[test]
        fn unpack_inverts_pack(bits in 1u32..=8, rows in 0usize..4, count in 1usize..70, seed in any::<u64>()) {
            let mask = (1u64 << bits) - 1;
            let codes: Vec<u8> = (0..rows * count)
                .map(|i| ((seed.wrapping_mul(6364136223846793005).wrapping_add((i as u64).wrapping_mul(1442695040888963407)) >> 17) & mask) as u8)
                .collect();
            let packed = pack(&codes, count, bits).unwrap();
            prop_assert_eq!(packed.len(), rows * packed_len(count, bits));
            prop_assert_eq!(unpack(&packed, count, bits).unwrap(), codes);
        }

        #[test]
        fn unpack_range_reads_any_slice(bits in 1u32..=8, count in 1usize..90, a in any::<usize>(), b in any::<usize>(), seed in any::<u64>()) {
            let mask = (1u64 << bits) - 1;
            let codes: Vec<u8> = (0..count)
                .map(|i| ((seed.wrapping_mul(6364136223846793005).wrapping_add((i as u64).wrapping_mul(1442695040888963407)) >> 17) & mask) as u8)
                .collect();
            let packed = pack(&codes, count, bits).unwrap();
            let start = a % count;
            let len = b % (count - start + 1);
            let mut out = vec![0u8; len];
            unpack_range(&packed, bits, start, &mut out);
            prop_assert_eq!(&out[..], &codes[start..start + len]);
        }
    }
}
