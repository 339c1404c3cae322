//! Writing a paged cache's slots: a step's new tokens encoded by the layer's native encoders
//! and scattered part by part into their slots (block `slot / block_size`, position `slot %
//! block_size`) of every KV head's page, the layout the paged decode attention reads
//! (`kernels::paged`; docs/vllm.md).

use crate::dtype::Dtype;
use crate::encoders::{EncodedPart, SideEncoder};
use crate::error::{KvqError, Result};
use crate::par;

/// Tokens per unit of work of a write (keys or values): a prompt's tokens are coded in spans
/// over the threads.
const ENCODE_SPAN: usize = 256;

/// One stored part of a slot: the part `name` of side `side` (0 keys, 1 values) as its encoder
/// names it, `row_bytes` bytes per token at `offset` bytes into the slot (`block_size *
/// offset` into a page), stored as `dtype`.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotPart {
    pub side: usize,
    pub name: String,
    pub offset: usize,
    pub row_bytes: usize,
    pub dtype: Dtype,
}

/// Where the pages lie in the cache's bytes (from the first page to the end of the last).
#[derive(Debug, Clone, Copy)]
pub struct PageGeometry {
    pub blocks: usize,
    pub kv_heads: usize,
    /// Token slots per page.
    pub block_size: usize,
    /// Bytes from block `b` to block `b + 1`.
    pub block_stride: usize,
    /// Bytes from the page of KV head `h` to that of `h + 1` in one block.
    pub head_stride: usize,
}

/// A layer's slot writer: its key and value encoders and its slot's parts.
#[derive(Debug, Clone)]
pub struct SlotWriter {
    encoders: [SideEncoder; 2],
    parts: Vec<SlotPart>,
    head_dim: usize,
    slot_bytes: usize,
}

/// The argument names of the two sides (`SlotPart::side`).
const SIDES: [&str; 2] = ["keys", "values"];

/// `e` of side `side`'s encoder, which names its input `x`, with the side's name in its place.
fn of_side(e: KvqError, side: usize) -> KvqError {
    match e {
        KvqError::NonFinite {
            arg: "x",
            row,
            col,
            value,
        } => KvqError::NonFinite {
            arg: SIDES[side],
            row,
            col,
            value,
        },
        e => e,
    }
}

fn mismatch(arg: &'static str, expected: String, actual: String) -> KvqError {
    KvqError::ShapeMismatch {
        arg,
        expected,
        actual,
    }
}

impl SlotWriter {
    /// Errors for an encoder that codes groups of tokens together (its tokens would not have
    /// a fixed size each) or parts that overlap or leave gaps in the slot.
    pub fn new(
        keys: SideEncoder,
        values: SideEncoder,
        parts: Vec<SlotPart>,
        head_dim: usize,
    ) -> Result<Self> {
        for enc in [&keys, &values] {
            if matches!(enc, SideEncoder::Channels(_)) {
                return Err(mismatch(
                    "encoders",
                    "per-token encoders (a paged slot holds one token)".into(),
                    "an encoder of channel groups spanning tokens".into(),
                ));
            }
        }
        let mut at = 0;
        for p in &parts {
            if p.offset != at || p.side > 1 || p.row_bytes == 0 {
                return Err(mismatch(
                    "parts",
                    format!("consecutive parts of keys (0) or values (1) from offset {at}"),
                    format!(
                        "{} (side {}) at offset {}, {} bytes",
                        p.name, p.side, p.offset, p.row_bytes
                    ),
                ));
            }
            at += p.row_bytes;
        }
        Ok(Self {
            encoders: [keys, values],
            parts,
            head_dim,
            slot_bytes: at,
        })
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// head_dim d of the tokens it writes.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Encodes `keys` and `values` (tokens x kv_heads x head_dim float32, C order) and writes
    /// token `i` into slot `slots[i]` of `cache` (a negative slot is padding: skipped). Errors,
    /// nothing written, for shapes that do not match, a slot beyond the cache, non-finite
    /// values, or an encoded part that does not fit its slot (a norm that needs float32 where
    /// the slot stores float16).
    pub fn write(
        &self,
        cache: &mut [u8],
        geom: &PageGeometry,
        keys: &[f32],
        values: &[f32],
        slots: &[i64],
    ) -> Result<()> {
        let (h, d) = (geom.kv_heads, self.head_dim);
        let row = h * d;
        for (arg, x) in [("keys", keys), ("values", values)] {
            if x.len() != slots.len() * row {
                return Err(mismatch(
                    arg,
                    format!("{} tokens x {h} heads x {d} values", slots.len()),
                    format!("{} values", x.len()),
                ));
            }
        }
        self.check_cache(cache.len(), geom)?;
        let capacity = geom.blocks * geom.block_size;
        let kept: Vec<usize> = (0..slots.len()).filter(|&i| slots[i] >= 0).collect();
        if let Some(&i) = kept.iter().find(|&&i| slots[i] as usize >= capacity) {
            return Err(mismatch(
                "slots",
                format!(
                    "slots below {capacity} ({} blocks of {})",
                    geom.blocks, geom.block_size
                ),
                slots[i].to_string(),
            ));
        }
        let gather = |x: &[f32]| -> Vec<f32> {
            kept.iter()
                .flat_map(|&i| x[i * row..(i + 1) * row].iter().copied())
                .collect()
        };
        let padded = kept.len() < slots.len();
        let sides = [keys, values].map(|x| if padded { gather(x) } else { x.to_vec() });
        // A prompt's many tokens in spans over the threads (keys and values alike: about
        // head_dim multiply-adds per coordinate, a rotation and a sketch or a basis); each
        // token is coded alone, so the spans join into the bytes of one call.
        let tokens = kept.len();
        let spans = tokens.div_ceil(ENCODE_SPAN).max(1);
        let work = tokens.saturating_mul(2 * row * d);
        let parts = par::map_range(2 * spans, work, par::par_min_bulk(), |u| {
            let (side, c) = (u / spans, u % spans);
            let x = &sides[side][c * ENCODE_SPAN * row..((c + 1) * ENCODE_SPAN).min(tokens) * row];
            self.encoders[side].encode(x, 1)
        });
        let mut spans_of = parts.into_iter();
        let mut encoded: Vec<Vec<EncodedPart>> = Vec::with_capacity(2);
        for (side, x) in sides.iter().enumerate() {
            let mut joined: Vec<EncodedPart> = Vec::new();
            for span in spans_of.by_ref().take(spans) {
                // An error is the whole side's, as one call reports it (rows counted from its
                // first token).
                let span = span
                    .or_else(|e| self.encoders[side].encode(x, 1).and(Err(e)))
                    .map_err(|e| of_side(e, side))?;
                if joined.is_empty() {
                    joined = span;
                } else {
                    for (j, (_, _, bytes)) in joined.iter_mut().zip(span) {
                        j.2.extend_from_slice(&bytes);
                    }
                }
            }
            encoded.push(joined);
        }
        let mut sources = Vec::with_capacity(self.parts.len());
        for p in &self.parts {
            let (_, dtype, bytes) = encoded[p.side]
                .iter()
                .find(|(name, _, _)| *name == p.name)
                .ok_or_else(|| mismatch("parts", format!("a part {}", p.name), "none".into()))?;
            if *dtype != p.dtype {
                // The encoder widens a chunk's scalars to float32 when one lies outside
                // float16's normal range; a fixed-size slot cannot hold the wider part.
                return Err(mismatch(
                    SIDES[p.side],
                    format!("{} in the slot's {:?}", p.name, p.dtype),
                    format!("{dtype:?} (a norm or scale outside float16's normal range)"),
                ));
            }
            if bytes.len() != kept.len() * h * p.row_bytes {
                return Err(mismatch(
                    "parts",
                    format!(
                        "{} as {:?}, {} bytes per token and head",
                        p.name, p.dtype, p.row_bytes
                    ),
                    format!("{dtype:?}, {} bytes for {} tokens", bytes.len(), kept.len()),
                ));
            }
            sources.push(bytes.as_slice());
        }
        for (j, &i) in kept.iter().enumerate() {
            let slot = slots[i] as usize;
            let (block, pos) = (slot / geom.block_size, slot % geom.block_size);
            for head in 0..h {
                let page = block * geom.block_stride + head * geom.head_stride;
                for (p, src) in self.parts.iter().zip(&sources) {
                    let dst = page + geom.block_size * p.offset + pos * p.row_bytes;
                    let from = (j * h + head) * p.row_bytes;
                    cache[dst..dst + p.row_bytes].copy_from_slice(&src[from..from + p.row_bytes]);
                }
            }
        }
        Ok(())
    }

    /// Errors unless every page lies within `len` bytes.
    fn check_cache(&self, len: usize, g: &PageGeometry) -> Result<()> {
        let page = g.block_size * self.slot_bytes;
        let end =
            (g.blocks.max(1) - 1) * g.block_stride + (g.kv_heads.max(1) - 1) * g.head_stride + page;
        if g.blocks == 0 || g.kv_heads == 0 || g.block_size == 0 || end > len {
            return Err(mismatch(
                "cache",
                format!(
                    "{} blocks x {} heads of {} slots of {} bytes within the bytes given",
                    g.blocks, g.kv_heads, g.block_size, self.slot_bytes
                ),
                format!("{len} bytes"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoders::MseSide;
    use crate::kernels::mse::MseQuantizer;

    fn mse(d: usize, bits: u32, seed: u64) -> SideEncoder {
        SideEncoder::Mse(MseSide {
            mse: MseQuantizer::new(d, bits, Some(seed)).unwrap(),
            mean: None,
            norm_group: None,
        })
    }

    fn writer(d: usize) -> SlotWriter {
        let (k, v) = (mse(d, 4, 1), mse(d, 2, 2));
        let parts = vec![
            SlotPart {
                side: 0,
                name: "codes".into(),
                offset: 0,
                row_bytes: d / 2,
                dtype: Dtype::U8,
            },
            SlotPart {
                side: 0,
                name: "norms".into(),
                offset: d / 2,
                row_bytes: 2,
                dtype: Dtype::F16,
            },
            SlotPart {
                side: 1,
                name: "codes".into(),
                offset: d / 2 + 2,
                row_bytes: d / 4,
                dtype: Dtype::U8,
            },
            SlotPart {
                side: 1,
                name: "norms".into(),
                offset: d / 2 + 2 + d / 4,
                row_bytes: 2,
                dtype: Dtype::F16,
            },
        ];
        SlotWriter::new(k, v, parts, d).unwrap()
    }

    #[test]
    fn each_token_lands_in_its_slot_as_its_encoding() {
        let (d, h, bs, blocks) = (16, 2, 4, 3);
        let w = writer(d);
        let sb = w.slot_bytes();
        let geom = PageGeometry {
            blocks,
            kv_heads: h,
            block_size: bs,
            block_stride: h * bs * sb,
            head_stride: bs * sb,
        };
        let mut cache = vec![0xAAu8; blocks * h * bs * sb];
        let x: Vec<f32> = (0..3 * h * d)
            .map(|i| ((i * 7 % 11) as f32) - 5.0)
            .collect();
        let slots = [9i64, -1, 2];
        w.write(&mut cache, &geom, &x, &x, &slots).unwrap();
        for (t, &slot) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
            let one = &x[t * h * d..(t + 1) * h * d];
            let (kp, vp) = (
                w.encoders[0].encode(one, 1).unwrap(),
                w.encoders[1].encode(one, 1).unwrap(),
            );
            let (block, pos) = (slot as usize / bs, slot as usize % bs);
            for head in 0..h {
                let page = block * geom.block_stride + head * geom.head_stride;
                for p in &w.parts {
                    let enc = if p.side == 0 { &kp } else { &vp };
                    let bytes = &enc.iter().find(|e| e.0 == p.name).unwrap().2;
                    let at = page + bs * p.offset + pos * p.row_bytes;
                    assert_eq!(
                        &cache[at..at + p.row_bytes],
                        &bytes[head * p.row_bytes..(head + 1) * p.row_bytes]
                    );
                }
            }
        }
        // The padding token and every other slot are untouched.
        let mut written = vec![false; cache.len()];
        for slot in [9usize, 2] {
            for head in 0..h {
                let page = slot / bs * geom.block_stride + head * geom.head_stride;
                for p in &w.parts {
                    let at = page + bs * p.offset + slot % bs * p.row_bytes;
                    written[at..at + p.row_bytes]
                        .iter_mut()
                        .for_each(|x| *x = true);
                }
            }
        }
        assert!(cache.iter().zip(&written).all(|(&b, &w)| w || b == 0xAA));
    }

    #[test]
    fn refuses_what_does_not_fit_and_writes_nothing() {
        let (d, h, bs) = (16, 2, 4);
        let w = writer(d);
        let sb = w.slot_bytes();
        let geom = PageGeometry {
            blocks: 2,
            kv_heads: h,
            block_size: bs,
            block_stride: h * bs * sb,
            head_stride: bs * sb,
        };
        let mut cache = vec![0u8; 2 * h * bs * sb];
        let x = vec![1.0f32; h * d];
        assert!(w.write(&mut cache, &geom, &x, &x, &[8]).is_err()); // beyond 2 blocks of 4
        assert!(w.write(&mut cache[1..], &geom, &x, &x, &[0]).is_err()); // too few bytes
        assert!(w.write(&mut cache, &geom, &x[1..], &x, &[0]).is_err());
        let mut nan = x.clone();
        nan[3] = f32::NAN;
        assert!(w.write(&mut cache, &geom, &nan, &x, &[0]).is_err());
        let big = vec![1e30f32; h * d]; // norms beyond float16: the slot stores float16
        assert!(w.write(&mut cache, &geom, &big, &x, &[0]).is_err());
        assert!(cache.iter().all(|&b| b == 0));
        let bad = vec![SlotPart {
            side: 0,
            name: "codes".into(),
            offset: 1,
            row_bytes: 8,
            dtype: Dtype::U8,
        }];
        assert!(SlotWriter::new(mse(d, 4, 1), mse(d, 2, 2), bad, d).is_err());
    }
}
