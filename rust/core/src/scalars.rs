//! Storage of per-vector scalars (norms, scales): float16 where every value fits, float32
//! otherwise (docs/kernels.md section 5). The plane's width is chosen per call
//! and carried by the variant, so the memory accounting can count 16 or 32 bits; the rounding
//! is chosen per value (a value that fits float16 is rounded to it even in a float32 plane), so
//! a stored value never depends on its neighbours: encoding tokens in chunks and joining the
//! chunks gives the same values as one call (a streaming cache equals one-shot encoding).

use std::borrow::Cow;

use half::f16;

use crate::dtype::Dtype;
use crate::error::{KvqError, Result};
use crate::kernels::log_scalars;
use crate::simd::{ops, Isa};

/// Smallest positive normal float16 (2^-14): below it float16 loses relative precision.
pub const F16_MIN_NORMAL: f32 = 6.103_515_6e-5;
/// Largest finite float16.
pub const F16_MAX: f32 = 65504.0;

/// True when `v` is stored as float16: zero or a magnitude in `[2^-14, 65504)`.
fn fits_f16(v: f32) -> bool {
    v == 0.0 || (F16_MIN_NORMAL..F16_MAX).contains(&v.abs())
}

/// `v` rounded to float16 when it fits there, else unchanged (the per-value rounding rule).
fn round_if_fits(v: f32) -> f32 {
    if fits_f16(v) {
        f16::from_f32(v).to_f32()
    } else {
        v
    }
}

/// Stored scalars of one float width, in whatever holds them (owned, borrowed, read from
/// bytes): one type, so each operation on the two widths is written once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Floats<H, F> {
    /// IEEE binary16 bit patterns.
    F16(H),
    /// float32 values, used when some value is outside the float16 normal range.
    F32(F),
}

/// A plane of stored scalars, one per vector.
pub type ScalarPlane = Floats<Vec<u16>, Vec<f32>>;

/// Borrowed float scalars, e.g. straight from a NumPy buffer.
pub type FloatView<'a> = Floats<&'a [u16], &'a [f32]>;

/// Stored scalars read from a part's little-endian bytes (a layer store's buffer, a page of
/// the paged cache): borrowed in place where the bytes are aligned to the scalar size (the
/// store's allocations are), else copied.
pub type ScalarRead<'a> = Floats<Cow<'a, [u16]>, Cow<'a, [f32]>>;

impl ScalarPlane {
    /// Chooses the storage for finite `values` (by magnitude) and rounds them into it: each
    /// value inside float16's normal range (or zero) is rounded to float16; the plane is float16
    /// when all are, else float32 holding the others unrounded.
    pub fn store(values: &[f32]) -> Self {
        if values.iter().all(|&v| fits_f16(v)) {
            Floats::F16(values.iter().map(|&v| f16::from_f32(v).to_bits()).collect())
        } else {
            Floats::F32(values.iter().map(|&v| round_if_fits(v)).collect())
        }
    }
}

impl<'a> ScalarRead<'a> {
    /// `bytes` as stored scalars of `dtype`; None unless `dtype` is float16 or float32.
    pub fn from_le(bytes: &'a [u8], dtype: Dtype) -> Option<Self> {
        match dtype {
            Dtype::F16 => Some(Floats::F16(plain(bytes))),
            Dtype::F32 => Some(Floats::F32(plain(bytes))),
            _ => None,
        }
    }

    /// The same scalars owning their values.
    pub fn into_owned(self) -> ScalarRead<'static> {
        match self {
            Floats::F16(v) => Floats::F16(Cow::Owned(v.into_owned())),
            Floats::F32(v) => Floats::F32(Cow::Owned(v.into_owned())),
        }
    }
}

impl<H: AsRef<[u16]>, F: AsRef<[f32]>> Floats<H, F> {
    /// A borrowed view, as the read paths take it.
    pub fn view(&self) -> ScalarView<'_> {
        ScalarView::Float(self.slices())
    }

    /// The values borrowed, whatever holds them.
    fn slices(&self) -> FloatView<'_> {
        match self {
            Floats::F16(v) => Floats::F16(v.as_ref()),
            Floats::F32(v) => Floats::F32(v.as_ref()),
        }
    }

    /// Number of stored scalars.
    pub fn len(&self) -> usize {
        match self.slices() {
            Floats::F16(v) => v.len(),
            Floats::F32(v) => v.len(),
        }
    }

    /// True when no scalar is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bits used per stored scalar (16 or 32).
    pub fn bits(&self) -> u32 {
        match self {
            Floats::F16(_) => 16,
            Floats::F32(_) => 32,
        }
    }

    /// Stored value `i` as float32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self.slices() {
            Floats::F16(v) => f16::from_bits(v[i]).to_f32(),
            Floats::F32(v) => v[i],
        }
    }

    /// All values as float32.
    pub fn to_f32(&self) -> Vec<f32> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }

    /// Stored values `start .. start + out.len()` as float32, a block at a time (the SIMD
    /// float16 conversion of `isa`; exact, so every path agrees with [`Floats::get`]).
    #[inline]
    pub fn read(&self, isa: Isa, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self.slices() {
            Floats::F16(v) => ops::f16_to_f32(isa, &v[start..end], out),
            Floats::F32(v) => out.copy_from_slice(&v[start..end]),
        }
    }

    /// Scalars `start .. start + len`.
    fn slice(&self, start: usize, len: usize) -> FloatView<'_> {
        match self.slices() {
            Floats::F16(v) => Floats::F16(&v[start..start + len]),
            Floats::F32(v) => Floats::F32(&v[start..start + len]),
        }
    }

    /// The float arm of [`ScalarView::validate_rows`].
    pub fn validate_rows(
        &self,
        arg: &'static str,
        (blocks, room, used): (usize, usize, usize),
        signed: bool,
    ) -> Result<()> {
        if used > room || Some(self.len()) != blocks.checked_mul(room) {
            return Err(KvqError::ShapeMismatch {
                arg,
                expected: format!("{blocks} x {room} stored scalars ({used} held per block)"),
                actual: format!("{}", self.len()),
            });
        }
        for b in 0..blocks {
            let held = self.slice(b * room, used);
            if held.all_valid(signed) {
                continue;
            }
            for i in 0..used {
                let v = held.get(i);
                if !v.is_finite() || (!signed && v < 0.0) {
                    return Err(KvqError::InvalidScalar {
                        arg,
                        row: b * used + i,
                        value: v,
                    });
                }
            }
        }
        Ok(())
    }

    /// Whether every scalar is finite (and not below zero unless `signed`), read from the bit
    /// patterns in one branch-free pass the compiler vectorises: the fast path of a check that
    /// runs on every attention call, the per-row loop above only naming the first bad row.
    fn all_valid(&self, signed: bool) -> bool {
        // A negative non-zero value has its sign bit set and some other bit set: as an
        // unsigned pattern it exceeds the sign bit alone (negative zero is allowed, as `<`).
        match self.slices() {
            Floats::F16(v) => {
                let neg = if signed { u16::MAX } else { 0x8000 };
                !v.iter()
                    .fold(false, |bad, &b| bad | ((b & 0x7C00) == 0x7C00) | (b > neg))
            }
            Floats::F32(v) => {
                let neg = if signed { u32::MAX } else { 0x8000_0000 };
                !v.iter().fold(false, |bad, &x| {
                    let b = x.to_bits();
                    bad | ((b & 0x7F80_0000) == 0x7F80_0000) | (b > neg)
                })
            }
        }
    }
}

impl<H: AsRef<[u16]>, F: AsRef<[f32]>> crate::rows::AsScalars for Floats<H, F> {
    fn scalars(&self) -> ScalarView<'_> {
        self.view()
    }
}

/// Borrowed stored scalars (float16 bit patterns, float32, or 8-bit log codes), e.g. straight
/// from a NumPy buffer: what the read paths use to avoid copying a plane per call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScalarView<'a> {
    /// float16 or float32 values, each readable alone.
    Float(FloatView<'a>),
    /// 8-bit log codes with one exponent byte per group (docs/kernels.md section 13).
    Log(LogView<'a>),
}

/// Log-coded scalars laid out as rows of `row` values (a head's tokens, `row` = the layout's
/// stride), each row's codes in groups of `group` with `ceil(row / group)` exponent bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogView<'a> {
    /// rows x row codes.
    pub codes: &'a [u8],
    /// rows x ceil(row / group) exponent bytes.
    pub exps: &'a [u8],
    /// Values per exponent.
    pub group: usize,
    /// Values per row (0 until the reader sets it with [`ScalarView::in_rows`]).
    pub row: usize,
}

impl LogView<'_> {
    fn groups(&self) -> usize {
        self.row.div_ceil(self.group.max(1))
    }

    /// Value `i` of a validated view (rows and groups of at least one value).
    #[inline]
    fn get(&self, i: usize) -> f32 {
        let (r, j) = (i / self.row, i % self.row);
        log_scalars::level(self.codes[i], self.exps[r * self.groups() + j / self.group])
    }

    /// Values `start .. start + out.len()` of a validated view, a run of one group's codes at a
    /// time (two divisions per call, none per value).
    fn read(&self, start: usize, out: &mut [f32]) {
        // A view of no rows validates with rows of 0 values: reading nothing must not divide.
        if out.is_empty() {
            return;
        }
        let groups = self.groups();
        let (mut r, mut j, mut i) = (start / self.row, start % self.row, start);
        let mut rest = out;
        while !rest.is_empty() {
            let e = self.exps[r * groups + j / self.group];
            let run = (self.group - j % self.group)
                .min(self.row - j)
                .min(rest.len());
            let (now, later) = rest.split_at_mut(run);
            for (o, &c) in now.iter_mut().zip(&self.codes[i..i + run]) {
                *o = log_scalars::level(c, e);
            }
            (rest, i, j) = (later, i + run, j + run);
            if j == self.row {
                (r, j) = (r + 1, 0);
            }
        }
    }

    /// Checks `blocks` rows of `room` values, `used` held: the buffer sizes (errors name
    /// `arg`) and the held groups' exponent bytes (errors name `exps_arg` and the group counted
    /// over the held groups, as a compact array's flat index).
    pub fn validate(
        &self,
        (arg, exps_arg): (&'static str, &'static str),
        (blocks, room, used): (usize, usize, usize),
    ) -> Result<()> {
        let groups = self.groups();
        let ok = self.group > 0
            && self.row == room
            && used <= room
            && Some(self.codes.len()) == blocks.checked_mul(room)
            && Some(self.exps.len()) == blocks.checked_mul(groups);
        if !ok {
            return Err(KvqError::ShapeMismatch {
                arg,
                expected: format!(
                    "{blocks} x {room} log codes and {blocks} x ceil({room} / group) exponent bytes ({used} held per block)"
                ),
                actual: format!(
                    "{} codes, {} exponent bytes, group {}, rows of {}",
                    self.codes.len(),
                    self.exps.len(),
                    self.group,
                    self.row
                ),
            });
        }
        let held = used.div_ceil(self.group);
        for b in 0..blocks {
            log_scalars::check_exps_from(exps_arg, &self.exps[b * groups..][..held], b * held)?;
        }
        Ok(())
    }
}

impl ScalarView<'_> {
    /// Number of stored scalars.
    pub fn len(&self) -> usize {
        match self {
            ScalarView::Float(f) => f.len(),
            ScalarView::Log(l) => l.codes.len(),
        }
    }

    /// The view read as rows of `row` values (what a log-coded view needs to find each
    /// value's group exponent; other views are flat and returned unchanged).
    pub fn in_rows(self, row: usize) -> Self {
        match self {
            ScalarView::Log(l) => ScalarView::Log(LogView { row, ..l }),
            other => other,
        }
    }

    /// True when no scalar is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stored value `i` as float32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            ScalarView::Float(f) => f.get(i),
            ScalarView::Log(l) => l.get(i),
        }
    }

    /// Stored values `start .. start + out.len()` as float32, a block at a time (exact, so
    /// every path agrees with [`ScalarView::get`]).
    #[inline]
    pub fn read(&self, isa: Isa, start: usize, out: &mut [f32]) {
        match self {
            ScalarView::Float(f) => f.read(isa, start, out),
            ScalarView::Log(l) => l.read(start, out),
        }
    }

    /// Checks `rows` finite non-negative values (norms, scales).
    pub fn validate(&self, arg: &'static str, rows: usize) -> Result<()> {
        self.validate_rows(arg, (1, rows, rows), false)
    }

    /// Checks `rows` finite values (negative ones allowed, e.g. zero points).
    pub fn validate_signed(&self, arg: &'static str, rows: usize) -> Result<()> {
        self.validate_rows(arg, (1, rows, rows), true)
    }

    /// Checks a buffer of `blocks` blocks of `room` scalars whose first `used` of each are
    /// held (a layer store keeps room to append after each head's rows): finite, and not
    /// below zero unless `signed`. Errors name the row counted over the held scalars; a
    /// log-coded view's exponent bytes are named `arg` too ([`LogView::validate`] names them
    /// apart).
    pub fn validate_rows(
        &self,
        arg: &'static str,
        sizes: (usize, usize, usize),
        signed: bool,
    ) -> Result<()> {
        match self {
            ScalarView::Float(f) => f.validate_rows(arg, sizes, signed),
            // Every code is a valid non-negative level; only the exponents can be out of range.
            ScalarView::Log(l) => l.validate((arg, arg), sizes),
        }
    }
}

/// Numbers every bit pattern of which is a value: bytes can be read as them in place.
pub(crate) trait Plain: Copy {
    fn from_le(b: &[u8]) -> Self;
}

impl Plain for u16 {
    fn from_le(b: &[u8]) -> Self {
        u16::from_le_bytes([b[0], b[1]])
    }
}

impl Plain for f32 {
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// Little-endian `bytes` as `T` values: borrowed when aligned, else copied.
pub(crate) fn plain<T: Plain>(bytes: &[u8]) -> Cow<'_, [T]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: every bit pattern of a `Plain` type is a valid value, and `align_to` returns
        // only the aligned middle; it is used only when nothing is left over on either side.
        let (pre, mid, post) = unsafe { bytes.align_to::<T>() };
        if pre.is_empty() && post.is_empty() {
            return Cow::Borrowed(mid);
        }
    }
    let size = std::mem::size_of::<T>();
    Cow::Owned(bytes.chunks_exact(size).map(T::from_le).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bit-pattern fast path agrees with the per-value rule on every float16 pattern and
    /// on float32 edge cases.
    #[test]
    fn fast_validity_check_agrees_with_the_per_value_rule() {
        let rule = |v: f32, signed: bool| v.is_finite() && (signed || v >= 0.0);
        for signed in [false, true] {
            for b in 0..=u16::MAX {
                let one = [b];
                let view = FloatView::F16(&one);
                assert_eq!(
                    view.all_valid(signed),
                    rule(view.get(0), signed),
                    "{b:#06x}"
                );
            }
            let edge = [
                0.0,
                -0.0,
                1.0,
                -1.0,
                f32::MIN_POSITIVE,
                -f32::MIN_POSITIVE,
                f32::MAX,
                f32::MIN,
                1e-45,
                -1e-45,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                -f32::NAN,
            ];
            for &x in &edge {
                let one = [x];
                assert_eq!(
                    FloatView::F32(&one).all_valid(signed),
                    rule(x, signed),
                    "{x}"
                );
            }
            let mut many = vec![1.5f32; 1000];
            assert!(FloatView::F32(&many).all_valid(signed));
            many[777] = -2.0;
            assert_eq!(FloatView::F32(&many).all_valid(signed), signed);
            assert_eq!(
                ScalarView::Float(FloatView::F32(&many))
                    .validate_rows("x", (1, 1000, 1000), signed)
                    .is_ok(),
                signed
            );
        }
    }

    /// A strided buffer is checked on its held scalars only, and a bad one is named by its
    /// row over the held scalars.
    #[test]
    fn strided_checks_read_the_held_scalars_only() {
        // 3 blocks of room 5, 3 held: the room (here NaN) is not read.
        let mut v = vec![f32::NAN; 15];
        for b in 0..3 {
            v[b * 5..b * 5 + 3].copy_from_slice(&[1.0, 2.0, 3.0]);
        }
        let view = ScalarView::Float(FloatView::F32(&v));
        assert!(view.validate_rows("x", (3, 5, 3), false).is_ok());
        v[2 * 5 + 1] = -1.0;
        match ScalarView::Float(FloatView::F32(&v)).validate_rows("x", (3, 5, 3), false) {
            Err(KvqError::InvalidScalar { row, .. }) => assert_eq!(row, 2 * 3 + 1),
            other => panic!("{other:?}"),
        }
        assert!(ScalarView::Float(FloatView::F32(&v))
            .validate_rows("x", (3, 5, 3), true)
            .is_ok());
        // Room below the held count, or a buffer of another length: a shape error.
        for sizes in [(3, 5, 6), (3, 4, 3), (4, 5, 3)] {
            assert!(matches!(
                ScalarView::Float(FloatView::F32(&v)).validate_rows("x", sizes, true),
                Err(KvqError::ShapeMismatch { .. })
            ));
        }
    }

    /// A log-coded view over rows with room (3 rows of room 13, 9 held, groups of 4) reads
    /// the held values as the kernel decodes each compact row, from any start and length, and
    /// its check reads the held groups' exponents only.
    #[test]
    fn log_view_reads_rows_with_room() {
        let (rows, room, used, group): (usize, usize, usize, usize) = (3, 13, 9, 4);
        let values: Vec<f32> = (0..rows * used)
            .map(|i| 0.01 + (i as f32 * 1.7).sin().abs() * 40.0)
            .collect();
        let (codes, exps) = log_scalars::encode(&values, used, group).unwrap();
        let want = log_scalars::decode(&codes, &exps, used, group).unwrap();
        let (gu, gr) = (used.div_ceil(group), room.div_ceil(group));
        let (mut c, mut e) = (vec![7u8; rows * room], vec![0u8; rows * gr]);
        for r in 0..rows {
            c[r * room..r * room + used].copy_from_slice(&codes[r * used..(r + 1) * used]);
            e[r * gr..r * gr + gu].copy_from_slice(&exps[r * gu..(r + 1) * gu]);
        }
        let view = |e: &[u8]| {
            let codes = c.clone();
            let exps = e.to_vec();
            move |row: usize| {
                let v = ScalarView::Log(LogView {
                    codes: &codes,
                    exps: &exps,
                    group,
                    row: 0,
                })
                .in_rows(row);
                v.validate_rows("x", (rows, room, used), false).is_ok()
            }
        };
        assert!(view(&e)(room));
        // Rows of another length than the room: a shape error.
        assert!(!view(&e)(used));
        let v = ScalarView::Log(LogView {
            codes: &c,
            exps: &e,
            group,
            row: 0,
        })
        .in_rows(room);
        for r in 0..rows {
            for start in 0..used {
                for len in 0..=used - start {
                    let mut out = vec![f32::NAN; len];
                    v.read(Isa::Scalar, r * room + start, &mut out);
                    assert_eq!(out, want[r * used + start..r * used + start + len]);
                }
            }
        }
        // A bad exponent in a held group is an error naming the exponent part and the group
        // counted over the held groups; in the room it is not read.
        let mut bad = e.clone();
        bad[gr + 1] = 255;
        assert!(!view(&bad)(room));
        let named = LogView {
            codes: &c,
            exps: &bad,
            group,
            row: room,
        }
        .validate(("x", "x_exps"), (rows, room, used));
        assert_eq!(
            named.unwrap_err().to_string(),
            format!(
                "x_exps: expected log-code exponent bytes in 16..=254, got 255 at group {}",
                gu + 1
            )
        );
        let mut in_room = e.clone();
        in_room[gr + 3] = 0;
        assert!(view(&in_room)(room));
    }

    /// A view of blocks with no room validates and reads nothing without dividing by its
    /// rows of zero values.
    #[test]
    fn log_view_of_empty_rows_reads_nothing() {
        let v = ScalarView::Log(LogView {
            codes: &[],
            exps: &[],
            group: 4,
            row: 0,
        })
        .in_rows(0);
        assert!(v.validate_rows("x", (3, 0, 0), false).is_ok());
        v.read(Isa::Scalar, 0, &mut []);
    }

    #[test]
    fn chooses_f16_when_values_fit() {
        let p = ScalarPlane::store(&[0.0, 1.5, 60000.0]);
        assert_eq!(p.bits(), 16);
        assert_eq!(p.to_f32(), vec![0.0, 1.5, 60000.0]);
    }

    #[test]
    fn falls_back_to_f32_beyond_f16_range() {
        assert_eq!(ScalarPlane::store(&[1.0, 1e5]).bits(), 32);
        assert_eq!(ScalarPlane::store(&[1.0, 1e-6]).bits(), 32);
        assert_eq!(ScalarPlane::store(&[1e5]).to_f32(), vec![1e5]);
        assert_eq!(ScalarPlane::store(&[-2.5, 3.0]).bits(), 16);
        assert_eq!(ScalarPlane::store(&[-1e5]).bits(), 32);
    }

    #[test]
    fn rounds_each_value_alone() {
        // 1.0001 fits float16 and is rounded to 1.0 even in a float32 plane.
        let p = ScalarPlane::store(&[1.0001, 1e-6, 1e5]);
        assert_eq!(p.bits(), 32);
        assert_eq!(p.to_f32(), vec![1.0, 1e-6, 1e5]);
        // Chunked storage joins to the same values as one call.
        let (a, b) = (
            ScalarPlane::store(&[1.0001]),
            ScalarPlane::store(&[1e-6, 1e5]),
        );
        let joined: Vec<f32> = a.to_f32().into_iter().chain(b.to_f32()).collect();
        assert_eq!(joined, p.to_f32());
    }
}
