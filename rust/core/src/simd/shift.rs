//! Bit packing without BMI2: eight codes, one per byte of a u64, merged into `8 * bits`
//! contiguous bits by three shift-and-mask steps (pairs of bytes, then pairs of 16-bit lanes,
//! then the two 32-bit halves), and split again by the inverse steps. This is the path for
//! CPUs that run `pext`/`pdep` in microcode (AMD before Zen 3). Portable Rust; the bytes are
//! those of `scalar::pack_row` (the format's little-endian bit stream).

use super::scalar;

/// The mask of bits `lo..hi` in every `lane`-bit lane of a u64 (`hi - lo < 64`).
const fn lane_mask(lane: u32, lo: u32, hi: u32) -> u64 {
    let one = ((1u64 << (hi - lo)) - 1) << lo;
    let mut m = 0;
    let mut at = 0;
    while at < 64 {
        m |= one << at;
        at += lane;
    }
    m
}

/// The masks of one step on `lane`-bit lanes whose halves hold `w` code bits each: the low
/// field, the high field where packing puts it (bits `w..2w`) and where unpacking puts it
/// (bits `lane/2 ..lane/2 + w`).
#[derive(Clone, Copy)]
struct Step {
    lo: u64,
    packed_hi: u64,
    split_hi: u64,
    shift: u32,
}

impl Step {
    const fn new(bits: u32, lane: u32) -> Step {
        let h = lane / 2;
        let w = bits * h / 8;
        Step {
            lo: lane_mask(lane, 0, w),
            packed_hi: lane_mask(lane, w, 2 * w),
            split_hi: lane_mask(lane, h, h + w),
            shift: h - w,
        }
    }

    /// Moves the high half's field down next to the low one's (bits above a field are masked,
    /// so stray bits of a code byte never reach the output).
    #[inline(always)]
    fn merge(self, x: u64) -> u64 {
        (x & self.lo) | ((x >> self.shift) & self.packed_hi)
    }

    /// The inverse of [`Step::merge`]: bits `w..2w` back to the high half.
    #[inline(always)]
    fn split(self, x: u64) -> u64 {
        (x & self.lo) | ((x << self.shift) & self.split_hi)
    }
}

/// The three steps for `B`-bit codes: 16-, 32- and 64-bit lanes.
struct Steps<const B: u32>;

impl<const B: u32> Steps<B> {
    const ALL: [Step; 3] = [Step::new(B, 16), Step::new(B, 32), Step::new(B, 64)];

    #[inline(always)]
    fn pack8(x: u64) -> u64 {
        let [a, b, c] = Self::ALL;
        c.merge(b.merge(a.merge(x)))
    }

    #[inline(always)]
    fn unpack8(x: u64) -> u64 {
        let [a, b, c] = Self::ALL;
        a.split(b.split(c.split(x)))
    }
}

/// Packs one row of codes (`scalar::pack_row`).
pub(crate) fn pack_row(codes: &[u8], bits: u32, out: &mut [u8]) {
    match bits {
        1 => pack_row_b::<1>(codes, out),
        2 => pack_row_b::<2>(codes, out),
        3 => pack_row_b::<3>(codes, out),
        4 => pack_row_b::<4>(codes, out),
        5 => pack_row_b::<5>(codes, out),
        6 => pack_row_b::<6>(codes, out),
        7 => pack_row_b::<7>(codes, out),
        _ => out[..codes.len()].copy_from_slice(codes),
    }
}

/// Unpacks the first `out.len()` codes of a packed row (`scalar::unpack_row`).
pub(crate) fn unpack_row(packed: &[u8], bits: u32, out: &mut [u8]) {
    match bits {
        1 => unpack_row_b::<1>(packed, out),
        2 => unpack_row_b::<2>(packed, out),
        3 => unpack_row_b::<3>(packed, out),
        4 => unpack_row_b::<4>(packed, out),
        5 => unpack_row_b::<5>(packed, out),
        6 => unpack_row_b::<6>(packed, out),
        7 => unpack_row_b::<7>(packed, out),
        _ => out.copy_from_slice(&packed[..out.len()]),
    }
}

/// Groups of 8 codes whose `B` output bytes can be written as one 8-byte word: the bytes past
/// `B` are zero and the next group (or the scalar tail) overwrites them.
fn wide_groups(groups: usize, b: usize, len: usize) -> usize {
    if len < 8 {
        0
    } else {
        groups.min((len - 8) / b + 1)
    }
}

fn pack_row_b<const B: u32>(codes: &[u8], out: &mut [u8]) {
    pack_groups(codes, B, out, Steps::<B>::pack8);
}

fn unpack_row_b<const B: u32>(packed: &[u8], out: &mut [u8]) {
    unpack_groups(packed, B, out, Steps::<B>::unpack8);
}

/// Packs a row eight codes at a time, `word` turning a u64 of eight code bytes into their
/// `8 * bits` stream bits (shifts here, `pext` on the BMI2 path); the tail goes to the scalar
/// packer.
#[inline(always)]
pub(super) fn pack_groups(codes: &[u8], bits: u32, out: &mut [u8], word: impl Fn(u64) -> u64) {
    let b = bits as usize;
    let groups = codes.len() / 8;
    let wide = wide_groups(groups, b, out.len());
    let bytes = |g: &[u8]| word(u64::from_le_bytes(g.try_into().unwrap_or([0; 8]))).to_le_bytes();
    let (head, rest) = codes.split_at(groups * 8);
    let (wide_codes, last_codes) = head.split_at(wide * 8);
    for (k, g) in wide_codes.chunks_exact(8).enumerate() {
        out[k * b..k * b + 8].copy_from_slice(&bytes(g));
    }
    for (k, g) in last_codes.chunks_exact(8).enumerate() {
        let at = (wide + k) * b;
        out[at..at + b].copy_from_slice(&bytes(g)[..b]);
    }
    scalar::pack_row(rest, bits, &mut out[groups * b..]);
}

/// The inverse of [`pack_groups`]: `word` spreads `8 * bits` stream bits over eight bytes.
#[inline(always)]
pub(super) fn unpack_groups(packed: &[u8], bits: u32, out: &mut [u8], word: impl Fn(u64) -> u64) {
    let b = bits as usize;
    let groups = out.len() / 8;
    let wide = wide_groups(groups, b, packed.len());
    let codes = |w: [u8; 8]| word(u64::from_le_bytes(w)).to_le_bytes();
    let (head, rest) = out.split_at_mut(groups * 8);
    let (wide_out, last_out) = head.split_at_mut(wide * 8);
    for (k, o) in wide_out.chunks_exact_mut(8).enumerate() {
        o.copy_from_slice(&codes(
            packed[k * b..k * b + 8].try_into().unwrap_or([0; 8]),
        ));
    }
    for (k, o) in last_out.chunks_exact_mut(8).enumerate() {
        let at = (wide + k) * b;
        let mut w = [0u8; 8];
        w[..b].copy_from_slice(&packed[at..at + b]);
        o.copy_from_slice(&codes(w));
    }
    scalar::unpack_row(&packed[groups * b..], bits, rest);
}
