//! The layer store: growable per-part buffers of one cache layer's compressed tokens.
//!
//! A compressed tensor of `(batch, ..., T, d)` is a set of named parts (docs/layouts.md); each
//! part stores its tokens along one axis (its token axis), with `units(T) = ceil(T * num / den)`
//! entries along that axis: one per token (`1/1`), packed bits of a channel's tokens
//! (`bits/8`), one per group of `g` tokens (`1/g`). Tokens can be joined or cut only where
//! every part holds whole entries (`T * num % den == 0`, the part's alignment).
//!
//! Each part keeps its outer rows (every index before the token axis) apart, each with room
//! for `units(room)` entries along the token axis (one token room for every part), so appending
//! tokens copies only the new bytes: when the room runs out it doubles for every part
//! (amortised O(1) per appended token), and the decode step reads every part in place, its
//! rows `room` tokens apart ([`LayerStore::buffer`]). Cutting the newest
//! tokens (a crop) is O(1); dropping the oldest (a sliding window) moves the kept bytes;
//! selecting, reordering or repeating batch rows copies the selected rows.
//!
//! Stored scalars (norms, scales) are float16 unless some value needed float32
//! (docs/kernels.md, stored scalars): a part declared `widen` turns to float32 when a float32
//! chunk arrives (every float16 value converts exactly), as joining the chunks would.

use half::{bf16, f16};

use crate::dtype::Dtype;
use crate::error::{KvqError, Result};
use crate::format::Section;

/// One part as declared by its layout.
#[derive(Debug, Clone, PartialEq)]
pub struct PartSpec {
    /// The part's name (`codes`, `norms`, ...).
    pub name: String,
    /// Element type of the entries (float16 for a widenable scalar part that starts narrow).
    pub dtype: Dtype,
    /// A float16 part that turns to float32 when a float32 chunk arrives (stored scalars).
    pub widen: bool,
    /// Axes before the token axis; the first is the batch.
    pub outer: Vec<usize>,
    /// Axes after the token axis.
    pub inner: Vec<usize>,
    /// Entries along the token axis per token: `num / den` (`units(T) = ceil(T num / den)`).
    pub num: usize,
    /// See `num`.
    pub den: usize,
}

impl PartSpec {
    /// Entries along the token axis for `tokens` tokens.
    pub fn units(&self, tokens: usize) -> usize {
        (tokens * self.num).div_ceil(self.den)
    }

    /// Whether the part can be cut or joined after `tokens` tokens.
    pub fn aligned(&self, tokens: usize) -> bool {
        (tokens * self.num).is_multiple_of(self.den)
    }

    fn rows(&self) -> usize {
        self.outer.iter().product()
    }

    fn inner_len(&self) -> usize {
        self.inner.iter().product()
    }

    /// The part's shape for `tokens` tokens.
    pub fn shape(&self, tokens: usize) -> Vec<usize> {
        let mut s = self.outer.clone();
        s.push(self.units(tokens));
        s.extend_from_slice(&self.inner);
        s
    }
}

/// One growable part: `rows` outer rows of `cap` entries of `inner_len` elements each.
#[derive(Debug, Clone)]
struct Buffer {
    spec: PartSpec,
    dtype: Dtype,
    cap: usize,
    data: Vec<u8>,
}

impl Buffer {
    fn entry_bytes(&self) -> usize {
        self.spec.inner_len() * self.dtype.itemsize()
    }

    fn row_stride(&self) -> usize {
        self.cap * self.entry_bytes()
    }

    /// Moves the rows into room for `cap` entries each (keeping `units` entries).
    fn relayout(&mut self, units: usize, cap: usize) {
        let eb = self.entry_bytes();
        let (old, new) = (self.cap * eb, cap * eb);
        let mut data = vec![0u8; self.spec.rows() * new];
        for r in 0..self.spec.rows() {
            data[r * new..r * new + units * eb]
                .copy_from_slice(&self.data[r * old..r * old + units * eb]);
        }
        self.data = data;
        self.cap = cap;
    }

    /// Turns a float16 buffer into float32 (exact).
    fn widen(&mut self, units: usize) {
        let rows = self.spec.rows();
        let n = self.spec.inner_len();
        let mut data = vec![0u8; rows * self.cap * n * 4];
        for r in 0..rows {
            let src = &self.data[r * self.cap * n * 2..][..units * n * 2];
            let dst = &mut data[r * self.cap * n * 4..][..units * n * 4];
            widen_f16(src, dst);
        }
        self.data = data;
        self.dtype = Dtype::F32;
    }

    /// The entries `lo .. hi` of every row, contiguous (C order).
    fn gather(&self, lo: usize, hi: usize) -> Vec<u8> {
        let eb = self.entry_bytes();
        let stride = self.row_stride();
        let mut out = Vec::with_capacity(self.spec.rows() * (hi - lo) * eb);
        for r in 0..self.spec.rows() {
            out.extend_from_slice(&self.data[r * stride + lo * eb..r * stride + hi * eb]);
        }
        out
    }
}

/// float16 bytes to float32 bytes (little endian), value by value.
fn widen_f16(src: &[u8], dst: &mut [u8]) {
    for (s, d) in src.chunks_exact(2).zip(dst.chunks_exact_mut(4)) {
        let v = f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
        d.copy_from_slice(&v.to_le_bytes());
    }
}

/// One part of a chunk of tokens to append: C-contiguous bytes of the part's shape.
#[derive(Debug, Clone, Copy)]
pub struct ChunkPart<'a> {
    /// Element type of `bytes`.
    pub dtype: Dtype,
    /// The part's shape for the chunk's tokens.
    pub shape: &'a [usize],
    /// The elements, C order, little endian.
    pub bytes: &'a [u8],
}

/// The growable parts of one cache layer, all holding the same tokens.
#[derive(Debug, Clone)]
pub struct LayerStore {
    parts: Vec<Buffer>,
    tokens: usize,
    /// Token room: every part has room for `units(room)` entries per outer row, so the rows of
    /// every part are `room` tokens apart (what the decode step's kernel reads in place).
    room: usize,
}

fn shape_err(arg: &str, expected: String, actual: String) -> KvqError {
    KvqError::ShapeMismatch {
        arg: "store",
        expected: format!("{arg}: {expected}"),
        actual,
    }
}

impl LayerStore {
    /// An empty store of the declared parts. Errors: no parts, repeated names, no outer axis
    /// (the batch), `num` or `den` zero, a widenable part that is not float16, text or int64
    /// parts.
    pub fn new(specs: Vec<PartSpec>) -> Result<Self> {
        if specs.is_empty() {
            return Err(shape_err(
                "parts",
                "at least one part".into(),
                "none".into(),
            ));
        }
        let batch = specs[0].outer.first().copied();
        for (i, s) in specs.iter().enumerate() {
            if specs[..i].iter().any(|o| o.name == s.name) {
                return Err(shape_err(
                    "parts",
                    "unique part names".into(),
                    format!("{:?} twice", s.name),
                ));
            }
            if s.outer.is_empty() || s.outer.first().copied() != batch {
                return Err(shape_err(
                    &s.name,
                    format!("a batch axis of {batch:?} rows first"),
                    format!("outer axes {:?}", s.outer),
                ));
            }
            if s.num == 0 || s.den == 0 {
                return Err(shape_err(
                    &s.name,
                    "a positive token rate num / den".into(),
                    format!("{} / {}", s.num, s.den),
                ));
            }
            if (s.widen && s.dtype != Dtype::F16) || matches!(s.dtype, Dtype::Utf8 | Dtype::I64) {
                return Err(shape_err(
                    &s.name,
                    "uint8 or float entries (widenable ones float16)".into(),
                    Dtype::name(s.dtype).into(),
                ));
            }
            let total = s
                .outer
                .iter()
                .chain(&s.inner)
                .try_fold(1usize, |a, &b| a.checked_mul(b));
            if total.is_none() {
                return Err(shape_err(
                    &s.name,
                    "axes whose product fits in memory".into(),
                    format!("{:?} {:?}", s.outer, s.inner),
                ));
            }
        }
        Ok(Self {
            parts: specs
                .into_iter()
                .map(|spec| Buffer {
                    dtype: spec.dtype,
                    spec,
                    cap: 0,
                    data: Vec::new(),
                })
                .collect(),
            tokens: 0,
            room: 0,
        })
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Token room of every part's outer rows (`>= tokens`; rows of part `i` in
    /// [`LayerStore::buffer`] start `units(room)` entries apart).
    pub fn room(&self) -> usize {
        self.room
    }

    /// Batch rows.
    pub fn batch(&self) -> usize {
        self.parts[0].spec.outer[0]
    }

    /// The declared parts (with the current batch).
    pub fn specs(&self) -> impl Iterator<Item = &PartSpec> {
        self.parts.iter().map(|b| &b.spec)
    }

    /// Index of the part `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.parts.iter().position(|b| b.spec.name == name)
    }

    /// Current element type of part `i`.
    pub fn dtype(&self, i: usize) -> Dtype {
        self.parts[i].dtype
    }

    /// Bytes held (the entries of the tokens held, not the room reserved).
    pub fn nbytes(&self) -> usize {
        self.parts
            .iter()
            .map(|b| b.spec.rows() * b.spec.units(self.tokens) * b.entry_bytes())
            .sum()
    }

    /// Bytes reserved (held plus room).
    pub fn capacity_nbytes(&self) -> usize {
        self.parts.iter().map(|b| b.data.len()).sum()
    }

    fn unaligned(&self, tokens: usize) -> Option<&PartSpec> {
        self.specs().find(|s| !s.aligned(tokens))
    }

    /// Appends a chunk of `tokens` tokens: `chunk[i]` is part `i` (in declaration order) for
    /// those tokens. Errors (nothing is stored): a chunk of another part count, shape or
    /// element type, held tokens at which a part cannot be joined.
    pub fn append(&mut self, chunk: &[ChunkPart], tokens: usize) -> Result<()> {
        if chunk.len() != self.parts.len() {
            return Err(shape_err(
                "chunk",
                format!("{} parts", self.parts.len()),
                format!("{}", chunk.len()),
            ));
        }
        if tokens == 0 {
            return Ok(());
        }
        if let Some(s) = self.unaligned(self.tokens) {
            return Err(shape_err(
                &s.name,
                format!(
                    "whole entries before a join (tokens held a multiple of {})",
                    s.den / gcd(s.num, s.den)
                ),
                format!("{} tokens held", self.tokens),
            ));
        }
        for (b, c) in self.parts.iter().zip(chunk) {
            let want = b.spec.shape(tokens);
            if c.shape != want.as_slice() {
                return Err(shape_err(
                    &b.spec.name,
                    format!("shape {want:?} for {tokens} tokens"),
                    format!("{:?}", c.shape),
                ));
            }
            let ok =
                c.dtype == b.dtype || (b.spec.widen && matches!(c.dtype, Dtype::F16 | Dtype::F32));
            if !ok {
                return Err(shape_err(
                    &b.spec.name,
                    format!("dtype {}", Dtype::name(b.dtype)),
                    Dtype::name(c.dtype).into(),
                ));
            }
            let n: usize = want.iter().product();
            if c.bytes.len() != n * c.dtype.itemsize() {
                return Err(shape_err(
                    &b.spec.name,
                    format!("{} bytes", n * c.dtype.itemsize()),
                    format!("{}", c.bytes.len()),
                ));
            }
        }
        let held = self.tokens;
        if held + tokens > self.room {
            // Grown by half its room (amortised O(1) appends; after a long prompt's first
            // decode step at most a third of the room is unused).
            self.grow_to((self.room + self.room / 2).max(held + tokens).max(8));
        }
        for (b, c) in self.parts.iter_mut().zip(chunk) {
            let (u0, add) = (b.spec.units(held), b.spec.units(tokens));
            if c.dtype == Dtype::F32 && b.dtype == Dtype::F16 {
                b.widen(u0);
            }
            let eb = b.entry_bytes();
            let stride = b.row_stride();
            let src_row = add * b.spec.inner_len() * c.dtype.itemsize();
            for r in 0..b.spec.rows() {
                let src = &c.bytes[r * src_row..(r + 1) * src_row];
                let dst = &mut b.data[r * stride + u0 * eb..r * stride + (u0 + add) * eb];
                if c.dtype == b.dtype {
                    dst.copy_from_slice(src);
                } else {
                    widen_f16(src, dst);
                }
            }
        }
        self.tokens += tokens;
        Ok(())
    }

    /// Room for `tokens` more tokens, reserved at once (a long append in chunks then moves
    /// the parts at most once).
    pub fn reserve(&mut self, tokens: usize) {
        let need = self.tokens.saturating_add(tokens);
        if need > self.room {
            self.grow_to(need);
        }
    }

    /// Every part moved into room for `room` tokens; the old buffers' pages are handed back
    /// to the system ([`crate::alloc::note_freed`]).
    fn grow_to(&mut self, room: usize) {
        let (held, mut freed) = (self.tokens, 0);
        for b in &mut self.parts {
            freed += b.data.len();
            b.relayout(b.spec.units(held), b.spec.units(room));
        }
        self.room = room;
        crate::alloc::note_freed(freed);
    }

    /// Keeps tokens `lo .. hi` (`0 <= lo <= hi <= tokens`): a crop keeps a prefix, a sliding
    /// window drops the oldest tokens. Errors: a span outside the tokens held, `lo` (or `hi`,
    /// unless it is the last token) where a part cannot be cut.
    pub fn keep(&mut self, lo: usize, hi: usize) -> Result<()> {
        if !(lo <= hi && hi <= self.tokens) {
            return Err(shape_err(
                "span",
                format!("0 <= lo <= hi <= {} tokens", self.tokens),
                format!("{lo}..{hi}"),
            ));
        }
        for (m, last) in [(lo, false), (hi, hi == self.tokens)] {
            if let Some(s) = self.unaligned(m).filter(|_| !last) {
                return Err(shape_err(
                    &s.name,
                    format!(
                        "a cut at a multiple of {} tokens",
                        s.den / gcd(s.num, s.den)
                    ),
                    format!("{m}"),
                ));
            }
        }
        for b in &mut self.parts {
            let (u_lo, u_hi) = (b.spec.units(lo), b.spec.units(hi));
            if u_lo > 0 {
                let eb = b.entry_bytes();
                let stride = b.row_stride();
                for r in 0..b.spec.rows() {
                    let base = r * stride;
                    b.data.copy_within(base + u_lo * eb..base + u_hi * eb, base);
                }
            }
        }
        self.tokens = hi - lo;
        Ok(())
    }

    /// Drops every token (the parts keep their room).
    pub fn clear(&mut self) {
        self.tokens = 0;
    }

    /// Keeps the batch rows `index` in that order (a row may repeat: beam reorder, repeat
    /// interleave). Errors: an index outside the batch.
    pub fn select(&mut self, index: &[usize]) -> Result<()> {
        let batch = self.batch();
        if let Some(&bad) = index.iter().find(|&&i| i >= batch) {
            return Err(shape_err(
                "index",
                format!("batch rows in 0..{batch}"),
                format!("{bad}"),
            ));
        }
        for b in &mut self.parts {
            let per = b.spec.rows() / batch.max(1);
            let block = per * b.row_stride();
            let mut data = Vec::with_capacity(index.len() * block);
            for &i in index {
                data.extend_from_slice(&b.data[i * block..(i + 1) * block]);
            }
            b.data = data;
            b.spec.outer[0] = index.len();
        }
        Ok(())
    }

    /// Part `i` as contiguous C-order bytes of its shape for the tokens held.
    pub fn part(&self, i: usize) -> (Dtype, Vec<usize>, Vec<u8>) {
        let b = &self.parts[i];
        let units = b.spec.units(self.tokens);
        (b.dtype, b.spec.shape(self.tokens), b.gather(0, units))
    }

    /// Part `i`'s whole buffer: its outer rows of `units(room)` entries each (C order), the
    /// first `units(tokens)` of each held; borrowed, never copied.
    pub fn buffer(&self, i: usize) -> &[u8] {
        &self.parts[i].data
    }

    /// The parts as container sections named `prefix + name` (the saved format).
    pub fn sections(&self, prefix: &str) -> Vec<Section> {
        (0..self.parts.len())
            .map(|i| {
                let (dtype, shape, payload) = self.part(i);
                Section {
                    name: format!("{prefix}{}", self.parts[i].spec.name),
                    dtype,
                    shape: shape.iter().map(|&s| s as u64).collect(),
                    payload,
                }
            })
            .collect()
    }

    /// A store of `specs` holding `tokens` tokens read from `sections` (every part's section
    /// `prefix + name`; other sections are ignored). Errors: a missing section, or one of
    /// another shape or element type than the parts of `tokens` tokens.
    pub fn from_sections(
        specs: Vec<PartSpec>,
        sections: &[Section],
        prefix: &str,
        tokens: usize,
    ) -> Result<Self> {
        let mut store = Self::new(specs)?;
        let mut shapes = Vec::new();
        let mut found = Vec::new();
        for b in &store.parts {
            let name = format!("{prefix}{}", b.spec.name);
            let s =
                sections
                    .iter()
                    .find(|s| s.name == name)
                    .ok_or_else(|| KvqError::CorruptData {
                        what: format!("section {name:?} is missing"),
                    })?;
            let shape: Vec<usize> = s.shape.iter().map(|&v| v as usize).collect();
            if shape != b.spec.shape(tokens) {
                return Err(KvqError::CorruptData {
                    what: format!(
                        "section {name:?} has shape {shape:?}, {tokens} tokens need {:?}",
                        b.spec.shape(tokens)
                    ),
                });
            }
            shapes.push(shape);
            found.push(s);
        }
        let chunk: Vec<ChunkPart> = found
            .iter()
            .zip(&shapes)
            .map(|(s, shape)| ChunkPart {
                dtype: s.dtype,
                shape,
                bytes: &s.payload,
            })
            .collect();
        store
            .append(&chunk, tokens)
            .map_err(|e| KvqError::CorruptData {
                what: e.to_string(),
            })?;
        Ok(store)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Elements of a float part as float32 (for the attention over full-precision tokens).
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        Dtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A reference tensor: C-order elements (one byte each) of `outer x units x inner`.
    #[derive(Debug, Clone)]
    struct Dense {
        outer: Vec<usize>,
        units: usize,
        inner: usize,
        data: Vec<u8>,
    }

    impl Dense {
        fn rows(&self) -> usize {
            self.outer.iter().product()
        }
        fn row(&self, r: usize) -> &[u8] {
            &self.data[r * self.units * self.inner..(r + 1) * self.units * self.inner]
        }
        fn concat(&self, other: &Dense) -> Dense {
            let mut data = Vec::new();
            for r in 0..self.rows() {
                data.extend_from_slice(self.row(r));
                data.extend_from_slice(other.row(r));
            }
            Dense {
                units: self.units + other.units,
                data,
                ..self.clone()
            }
        }
        fn slice(&self, lo: usize, hi: usize) -> Dense {
            let mut data = Vec::new();
            for r in 0..self.rows() {
                data.extend_from_slice(&self.row(r)[lo * self.inner..hi * self.inner]);
            }
            Dense {
                units: hi - lo,
                data,
                ..self.clone()
            }
        }
        fn select(&self, idx: &[usize]) -> Dense {
            let per = self.rows() / self.outer[0] * self.units * self.inner;
            let mut data = Vec::new();
            for &i in idx {
                data.extend_from_slice(&self.data[i * per..(i + 1) * per]);
            }
            let mut outer = self.outer.clone();
            outer[0] = idx.len();
            Dense {
                outer,
                data,
                ..self.clone()
            }
        }
    }

    /// Two parts: per-token rows (1/1, inner 3) and a packed channel axis (4 bits: 1/2).
    fn specs(batch: usize) -> Vec<PartSpec> {
        vec![
            PartSpec {
                name: "codes".into(),
                dtype: Dtype::U8,
                widen: false,
                outer: vec![batch, 2],
                inner: vec![3],
                num: 1,
                den: 1,
            },
            PartSpec {
                name: "packed".into(),
                dtype: Dtype::U8,
                widen: false,
                outer: vec![batch, 2, 5],
                inner: vec![],
                num: 1,
                den: 2,
            },
        ]
    }

    fn dense(spec: &PartSpec, tokens: usize, seed: u8) -> Dense {
        let units = spec.units(tokens);
        let inner = spec.inner.iter().product();
        let n = spec.outer.iter().product::<usize>() * units * inner;
        Dense {
            outer: spec.outer.clone(),
            units,
            inner,
            data: (0..n)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect(),
        }
    }

    fn append(store: &mut LayerStore, chunk: &[Dense], tokens: usize) -> Result<()> {
        let shapes: Vec<Vec<usize>> = store.specs().map(|s| s.shape(tokens)).collect();
        let parts: Vec<ChunkPart> = chunk
            .iter()
            .zip(&shapes)
            .map(|(d, s)| ChunkPart {
                dtype: Dtype::U8,
                shape: s,
                bytes: &d.data,
            })
            .collect();
        store.append(&parts, tokens)
    }

    fn check(store: &LayerStore, want: &[Dense]) {
        assert!(store.room() >= store.tokens());
        for (i, w) in want.iter().enumerate() {
            let (_, shape, bytes) = store.part(i);
            assert_eq!(
                shape[shape.len() - 1 - store.parts[i].spec.inner.len()],
                w.units
            );
            assert_eq!(bytes, w.data, "part {i}");
            // The decode step's view: the buffer's outer rows `units(room)` entries apart, the
            // first `units(tokens)` of each held.
            let b = &store.parts[i];
            let eb = b.entry_bytes();
            let (room, held) = (
                b.spec.units(store.room()) * eb,
                b.spec.units(store.tokens()) * eb,
            );
            let buf = store.buffer(i);
            assert_eq!(buf.len(), b.spec.rows() * room, "part {i}");
            let rows: Vec<u8> = (0..b.spec.rows())
                .flat_map(|r| buf[r * room..r * room + held].iter().copied())
                .collect();
            assert_eq!(rows, w.data, "part {i} in place");
        }
    }

    #[test]
    fn appends_equal_concatenation_and_grow_by_half() {
        let mut store = LayerStore::new(specs(2)).unwrap();
        let sp: Vec<PartSpec> = store.specs().cloned().collect();
        let mut want: Vec<Dense> = sp.iter().map(|s| dense(s, 0, 0)).collect();
        let mut caps = Vec::new();
        for step in 0..100u8 {
            let chunk: Vec<Dense> = sp.iter().map(|s| dense(s, 2, step)).collect();
            append(&mut store, &chunk, 2).unwrap();
            want = want.iter().zip(&chunk).map(|(a, b)| a.concat(b)).collect();
            caps.push(store.parts[0].cap);
        }
        check(&store, &want);
        caps.dedup();
        assert_eq!(caps, vec![8, 12, 18, 27, 40, 60, 90, 135, 202]);
    }

    #[test]
    fn cuts_and_selects_equal_slices() {
        let mut store = LayerStore::new(specs(3)).unwrap();
        let sp: Vec<PartSpec> = store.specs().cloned().collect();
        let all: Vec<Dense> = sp.iter().map(|s| dense(s, 20, 7)).collect();
        append(&mut store, &all, 20).unwrap();
        store.keep(4, 18).unwrap();
        let want: Vec<Dense> = all
            .iter()
            .zip(&sp)
            .map(|(d, s)| d.slice(s.units(4), s.units(18)))
            .collect();
        check(&store, &want);
        store.select(&[2, 0, 0]).unwrap();
        let want: Vec<Dense> = want.iter().map(|d| d.select(&[2, 0, 0])).collect();
        check(&store, &want);
        assert_eq!(store.batch(), 3);
        // An odd cut of the packed part is refused (whole bytes), and nothing changes.
        assert!(store.keep(0, 5).unwrap_err().to_string().contains("packed"));
        assert!(store.select(&[3]).unwrap_err().to_string().contains("0..3"));
        check(&store, &want);
    }

    #[test]
    fn a_float32_chunk_widens_a_float16_part_exactly() {
        let spec = PartSpec {
            name: "norms".into(),
            dtype: Dtype::F16,
            widen: true,
            outer: vec![1, 2],
            inner: vec![],
            num: 1,
            den: 1,
        };
        let mut store = LayerStore::new(vec![spec]).unwrap();
        let a: Vec<u8> = [1.5f32, -2.25, 3.0, 4.0]
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let b: Vec<u8> = [1e6f32, 7.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let c: Vec<u8> = [0.5f32, 0.25]
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        for (dtype, shape, bytes) in [
            (Dtype::F16, [1usize, 2, 2], &a),
            (Dtype::F32, [1, 2, 1], &b),
            (Dtype::F16, [1, 2, 1], &c),
        ] {
            let part = ChunkPart {
                dtype,
                shape: &shape,
                bytes,
            };
            store.append(&[part], shape[2]).unwrap();
        }
        let (dtype, shape, bytes) = store.part(0);
        assert_eq!((dtype, shape), (Dtype::F32, vec![1, 2, 4]));
        assert_eq!(
            to_f32(dtype, &bytes).unwrap(),
            vec![1.5, -2.25, 1e6, 0.5, 3.0, 4.0, 7.0, 0.25]
        );
    }

    #[test]
    fn bad_chunks_are_refused_before_anything_is_stored() {
        let mut store = LayerStore::new(specs(1)).unwrap();
        let sp: Vec<PartSpec> = store.specs().cloned().collect();
        let chunk: Vec<Dense> = sp.iter().map(|s| dense(s, 3, 1)).collect();
        append(&mut store, &chunk, 3).unwrap();
        // 3 tokens hold half a byte of the packed part: no further join.
        let err = append(&mut store, &chunk, 3).unwrap_err().to_string();
        assert!(
            err.contains("packed") && err.contains("3 tokens held"),
            "{err}"
        );
        let mut store = LayerStore::new(specs(1)).unwrap();
        let shape = [1usize, 2, 9, 3];
        let bad = ChunkPart {
            dtype: Dtype::U8,
            shape: &shape,
            bytes: &[0; 54],
        };
        let good_shape = sp[1].shape(2);
        let ok = ChunkPart {
            dtype: Dtype::U8,
            shape: &good_shape,
            bytes: &[0; 10],
        };
        let err = store.append(&[bad, ok], 2).unwrap_err().to_string();
        assert!(
            err.contains("codes") && err.contains("[1, 2, 2, 3]"),
            "{err}"
        );
        assert_eq!(store.tokens(), 0);
        assert!(LayerStore::new(vec![]).is_err());
        let mut dup = specs(1);
        dup[1].name = "codes".into();
        assert!(LayerStore::new(dup).is_err());
    }

    #[test]
    fn sections_round_trip() {
        let mut store = LayerStore::new(specs(2)).unwrap();
        let sp: Vec<PartSpec> = store.specs().cloned().collect();
        let chunk: Vec<Dense> = sp.iter().map(|s| dense(s, 6, 3)).collect();
        append(&mut store, &chunk, 6).unwrap();
        let secs = store.sections("L0.keys.");
        assert_eq!(secs[0].name, "L0.keys.codes");
        let back = LayerStore::from_sections(sp.clone(), &secs, "L0.keys.", 6).unwrap();
        check(&back, &chunk);
        let err = LayerStore::from_sections(sp, &secs, "L0.keys.", 4).unwrap_err();
        assert!(err.to_string().contains("shape"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any sequence of appends (whole-byte chunks but the last), cuts and batch selections
        /// equals the same operations on concatenated reference tensors.
        #[test]
        fn operations_equal_the_reference(
            ops in proptest::collection::vec((0u8..4, 0usize..6, 0usize..6, proptest::collection::vec(0usize..3, 0..4)), 1..30),
        ) {
            let mut store = LayerStore::new(specs(3)).unwrap();
            let mut sp: Vec<PartSpec> = store.specs().cloned().collect();
            let mut want: Vec<Dense> = sp.iter().map(|s| dense(s, 0, 0)).collect();
            let mut tokens = 0usize;
            for (k, (op, a, b, idx)) in ops.into_iter().enumerate() {
                match op {
                    0 | 1 => {
                        let n = 2 * a + (op as usize & usize::from(b == 0));
                        let chunk: Vec<Dense> = sp.iter().map(|s| dense(s, n, k as u8)).collect();
                        let r = append(&mut store, &chunk, n);
                        if tokens.is_multiple_of(2) || n == 0 {
                            r.unwrap();
                            want = want.iter().zip(&chunk).map(|(w, c)| w.concat(c)).collect();
                            tokens += n;
                        } else {
                            prop_assert!(r.is_err());
                        }
                    }
                    2 => {
                        let lo = (2 * a).min(tokens) & !1;
                        let hi = (lo + 2 * b).min(tokens);
                        let hi = if hi == tokens { hi } else { hi & !1 };
                        store.keep(lo, hi).unwrap();
                        want = want.iter().zip(&sp).map(|(w, s)| w.slice(s.units(lo), s.units(hi))).collect();
                        tokens = hi - lo;
                    }
                    _ => {
                        store.select(&idx).unwrap();
                        want = want.iter().map(|w| w.select(&idx)).collect();
                        for s in &mut sp {
                            s.outer[0] = idx.len();
                        }
                        if idx.is_empty() {
                            return Ok(());
                        }
                        // Back to three rows for the next selection.
                        let three: Vec<usize> = (0..3).map(|i| i % idx.len()).collect();
                        store.select(&three).unwrap();
                        want = want.iter().map(|w| w.select(&three)).collect();
                        for s in &mut sp {
                            s.outer[0] = 3;
                        }
                    }
                }
                prop_assert_eq!(store.tokens(), tokens);
                check(&store, &want);
            }
        }
    }
}
