//! Decode attention over a paged KV cache (the block layout of vLLM's paged attention, Kwon et
//! al. 2023) straight from the stored codes, through a block table.
//!
//! The cache is one page per (block, KV head): `block_size` token slots of one fixed byte size,
//! stored part by part (a structure of arrays): a part of `row_bytes` bytes per token (packed
//! codes, norms, scales, zero points, QJL signs) fills `block_size * row_bytes` bytes at its
//! `offset` in the page. The rows of one page are then exactly the per-head arrays that
//! [`decode_attention_with`] reads, so every page is attended in place, by the fused kernel,
//! with no key or value reconstructed and nothing copied but the page's few stored scalars
//! (decoded from their little-endian bytes). A query token attends to the first `length`
//! tokens of its sequence (its position + 1 for causal attention, so prefill and decode steps
//! are the same call); the per-page softmax parts are merged by their log-sum-exp,
//! `out = sum_i e^(lse_i - m) out_i / sum_i e^(lse_i - m)` in float64, equal to one softmax
//! over all the tokens up to float32 rounding of the parts.
//!
//! Query tokens x KV heads run in parallel (rayon); each one's pages are merged in block
//! order, so results do not depend on the thread count.

use half::f16;

use super::attention::{decode_attention_with, AttentionShape, CodedRows, QjlRows};
use super::{check_head_dim, check_len};
use crate::error::{KvqError, Result};
use crate::par;
use crate::scalars::ScalarView;
use crate::simd::{self, Isa};

/// Storage type of a part of stored scalars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scalar {
    /// IEEE binary16, little-endian.
    F16,
    /// float32, little-endian.
    F32,
}

impl Scalar {
    fn bytes(self) -> usize {
        match self {
            Scalar::F16 => 2,
            Scalar::F32 => 4,
        }
    }
}

/// Where one part of a slot lives in a page: `offset` bytes from the page start, `row_bytes`
/// bytes per token, `block_size` rows in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Byte offset of the part's rows in the page.
    pub offset: usize,
    /// Bytes per token.
    pub row_bytes: usize,
}

/// A part of one stored scalar per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScalarPart {
    /// Where its rows are.
    pub part: Part,
    /// Their storage type (`part.row_bytes` must be its size).
    pub kind: Scalar,
}

/// The QJL residual parts of an MSE side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedQjl {
    /// Packed sign bits, ceil(d'/8) bytes per token.
    pub signs: Part,
    /// Stored `||r||`.
    pub norms: ScalarPart,
    /// Sketch seed.
    pub seed: u64,
}

/// One side (keys or values) of the slot layout: the per-token [`CodedRows`] kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PagedRows {
    /// Norm-and-direction codes with an optional QJL residual (`kv`, `kqv`, `qkqv`).
    Mse {
        /// Packed codes.
        codes: Part,
        /// Norms.
        norms: ScalarPart,
        /// Bits of the MSE stage.
        bits: u32,
        /// Rotation seed, or None.
        seed: Option<u64>,
        /// QJL residual.
        qjl: Option<PagedQjl>,
    },
    /// Asymmetric uniform groups along each token (`block`).
    UniformTokens {
        /// Packed codes.
        codes: Part,
        /// Scales, `groups` per token.
        scales: Part,
        /// Zero points, `groups` per token.
        zeros: Part,
        /// Storage type of scales and zero points.
        kind: Scalar,
        /// Bits per code.
        bits: u32,
        /// Coordinates per group.
        group: usize,
        /// Rotation seed, or None.
        seed: Option<u64>,
    },
}

/// The paged cache of one layer.
#[derive(Debug, Clone, Copy)]
pub struct PagedCache<'a> {
    /// Bytes from the first page to the end of the last one.
    pub data: &'a [u8],
    /// Number of blocks.
    pub blocks: usize,
    /// KV heads per block.
    pub kv_heads: usize,
    /// Token slots per page.
    pub block_size: usize,
    /// Bytes of one page (`block_size` slots).
    pub page_bytes: usize,
    /// Bytes from block `b` to block `b + 1`.
    pub block_stride: usize,
    /// Bytes from the page of KV head `h` to that of `h + 1` in one block.
    pub head_stride: usize,
}

/// The query tokens of one call.
#[derive(Debug, Clone, Copy)]
pub struct PagedQueries<'a> {
    /// tokens x q_heads x head_dim float32; query head `i` reads KV head `i / (q_heads / kv_heads)`.
    pub q: &'a [f32],
    /// Query heads.
    pub q_heads: usize,
    /// head_dim d.
    pub head_dim: usize,
    /// Logit scale.
    pub scale: f32,
    /// Block-table row (sequence) of each query token.
    pub seq: &'a [i32],
    /// Tokens each query token attends to: the first `length` of its sequence.
    pub lengths: &'a [i32],
    /// sequences x `table_width` block ids.
    pub block_table: &'a [i32],
    /// Block ids per sequence row.
    pub table_width: usize,
}

fn dim_error(arg: &'static str, expected: String, actual: usize) -> KvqError {
    KvqError::InvalidDimension {
        arg,
        expected,
        actual: i64::try_from(actual).unwrap_or(i64::MAX),
    }
}

fn index_error(arg: &'static str, expected: String, actual: i32) -> KvqError {
    KvqError::InvalidDimension {
        arg,
        expected,
        actual: i64::from(actual),
    }
}

/// Stored scalars of the first `n` rows of a part, decoded from their bytes.
enum Plane {
    F16(Vec<u16>),
    F32(Vec<f32>),
}

impl Plane {
    fn read(page: &[u8], part: Part, kind: Scalar, n: usize) -> Self {
        let bytes = &page[part.offset..part.offset + n * part.row_bytes];
        match kind {
            Scalar::F16 => Plane::F16(
                bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]).to_bits())
                    .collect(),
            ),
            Scalar::F32 => Plane::F32(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
        }
    }

    fn view(&self) -> ScalarView<'_> {
        match self {
            Plane::F16(v) => ScalarView::F16(v),
            Plane::F32(v) => ScalarView::F32(v),
        }
    }
}

/// The first `n` rows of one side in one page, held for one kernel call.
struct PageSide<'a> {
    rows: PagedRows,
    page: &'a [u8],
    n: usize,
    planes: [Option<Plane>; 3],
}

impl<'a> PageSide<'a> {
    fn new(rows: PagedRows, page: &'a [u8], n: usize) -> Self {
        let planes = match rows {
            PagedRows::Mse { norms, qjl, .. } => [
                Some(Plane::read(page, norms.part, norms.kind, n)),
                qjl.map(|q| Plane::read(page, q.norms.part, q.norms.kind, n)),
                None,
            ],
            PagedRows::UniformTokens {
                scales,
                zeros,
                kind,
                ..
            } => [
                Some(Plane::read(page, scales, kind, n)),
                Some(Plane::read(page, zeros, kind, n)),
                None,
            ],
        };
        Self {
            rows,
            page,
            n,
            planes,
        }
    }

    fn bytes(&self, part: Part) -> &'a [u8] {
        &self.page[part.offset..part.offset + self.n * part.row_bytes]
    }

    fn plane(&self, i: usize) -> ScalarView<'_> {
        self.planes[i]
            .as_ref()
            .map_or(ScalarView::F32(&[]), Plane::view)
    }

    fn coded(&self) -> CodedRows<'_> {
        match self.rows {
            PagedRows::Mse {
                codes,
                bits,
                seed,
                qjl,
                ..
            } => CodedRows::Mse {
                codes: self.bytes(codes),
                norms: self.plane(0),
                bits,
                seed,
                qjl: qjl.map(|q| QjlRows {
                    signs: self.bytes(q.signs),
                    norms: self.plane(1),
                    seed: q.seed,
                }),
            },
            PagedRows::UniformTokens {
                codes,
                bits,
                group,
                seed,
                ..
            } => CodedRows::UniformTokens {
                codes: self.bytes(codes),
                scales: self.plane(0),
                zeros: self.plane(1),
                bits,
                group,
                seed,
            },
        }
    }

    /// Every part of `rows` with its name, to check that it fits in a page.
    fn parts(rows: &PagedRows) -> Vec<(&'static str, Part, Option<Scalar>)> {
        match *rows {
            PagedRows::Mse {
                codes, norms, qjl, ..
            } => {
                let mut v = vec![
                    ("codes", codes, None),
                    ("norms", norms.part, Some(norms.kind)),
                ];
                if let Some(q) = qjl {
                    v.push(("qjl_signs", q.signs, None));
                    v.push(("qjl_norms", q.norms.part, Some(q.norms.kind)));
                }
                v
            }
            PagedRows::UniformTokens {
                codes,
                scales,
                zeros,
                kind,
                ..
            } => vec![
                ("codes", codes, None),
                ("scales", scales, Some(kind)),
                ("zeros", zeros, Some(kind)),
            ],
        }
    }
}

fn check_parts(cache: &PagedCache, rows: &PagedRows) -> Result<()> {
    for (name, part, kind) in PageSide::parts(rows) {
        let end = part
            .row_bytes
            .checked_mul(cache.block_size)
            .and_then(|b| b.checked_add(part.offset));
        if part.row_bytes == 0 || end.is_none_or(|e| e > cache.page_bytes) {
            return Err(dim_error(
                "layout",
                format!(
                    "part {name} ({} bytes per token at offset {}) inside a page of {} bytes ({} slots)",
                    part.row_bytes, part.offset, cache.page_bytes, cache.block_size
                ),
                part.row_bytes,
            ));
        }
        if let Some(k) = kind {
            if part.row_bytes % k.bytes() != 0 {
                return Err(dim_error(
                    "layout",
                    format!(
                        "part {name}: a whole number of {}-byte scalars per token",
                        k.bytes()
                    ),
                    part.row_bytes,
                ));
            }
        }
    }
    Ok(())
}

fn check_cache(cache: &PagedCache) -> Result<()> {
    if cache.blocks == 0 || cache.kv_heads == 0 || cache.block_size == 0 {
        return Err(dim_error(
            "cache",
            "at least one block, KV head and slot".into(),
            0,
        ));
    }
    if cache.kv_heads > 1 && cache.head_stride < cache.page_bytes {
        return Err(dim_error(
            "cache.head_stride",
            format!("at least the page size {}", cache.page_bytes),
            cache.head_stride,
        ));
    }
    let block_span = (cache.kv_heads - 1)
        .checked_mul(cache.head_stride)
        .and_then(|s| s.checked_add(cache.page_bytes));
    let span = block_span.and_then(|b| {
        (cache.blocks - 1)
            .checked_mul(cache.block_stride)
            .and_then(|s| s.checked_add(b))
    });
    match (block_span, span) {
        (Some(b), Some(s)) if cache.blocks == 1 || cache.block_stride >= b => {
            if cache.data.len() < s {
                Err(dim_error(
                    "cache",
                    format!("at least {s} bytes for {} blocks", cache.blocks),
                    cache.data.len(),
                ))
            } else {
                Ok(())
            }
        }
        _ => Err(dim_error(
            "cache.block_stride",
            "a block stride that holds every KV head's page".into(),
            cache.block_stride,
        )),
    }
}

/// Checks every query token's sequence row, length and block ids; returns the number of
/// sequence rows.
fn check_queries(cache: &PagedCache, qs: &PagedQueries) -> Result<()> {
    check_head_dim("head_dim", qs.head_dim)?;
    if qs.q_heads == 0 || !qs.q_heads.is_multiple_of(cache.kv_heads) {
        return Err(dim_error(
            "q_heads",
            format!("a positive multiple of the {} KV heads", cache.kv_heads),
            qs.q_heads,
        ));
    }
    if !(qs.scale.is_finite() && qs.scale > 0.0) {
        return Err(KvqError::InvalidValue {
            arg: "scale",
            expected: "a finite positive logit scale",
            value: f64::from(qs.scale),
        });
    }
    let tokens = qs.lengths.len();
    check_len(
        "seq",
        qs.seq.len(),
        tokens,
        "one sequence row per query token",
    )?;
    let qlen = tokens
        .checked_mul(qs.q_heads)
        .and_then(|n| n.checked_mul(qs.head_dim));
    check_len(
        "q",
        qs.q.len(),
        qlen.unwrap_or(usize::MAX),
        "tokens x q_heads x head_dim",
    )?;
    if qs.table_width == 0 || !qs.block_table.len().is_multiple_of(qs.table_width) {
        return Err(dim_error(
            "block_table",
            format!("sequences x table_width ({}) block ids", qs.table_width),
            qs.block_table.len(),
        ));
    }
    let seqs = qs.block_table.len() / qs.table_width;
    let max_len = qs.table_width.saturating_mul(cache.block_size);
    for (&s, &len) in qs.seq.iter().zip(qs.lengths) {
        if s < 0 || s as usize >= seqs {
            return Err(index_error(
                "seq",
                format!("a block-table row in 0..{seqs}"),
                s,
            ));
        }
        if len < 1 || len as usize > max_len {
            return Err(index_error(
                "lengths",
                format!("1 ..= {max_len} tokens (table_width x block_size)"),
                len,
            ));
        }
        let row = &qs.block_table[s as usize * qs.table_width..];
        for &b in &row[..(len as usize).div_ceil(cache.block_size)] {
            if b < 0 || b as usize >= cache.blocks {
                return Err(index_error(
                    "block_table",
                    format!("block ids in 0..{}", cache.blocks),
                    b,
                ));
            }
        }
    }
    Ok(())
}

impl PagedRows {
    /// The same rows with part `i` (in [`PageSide::parts`]' order) at `offsets[i]`.
    fn relocated(&self, offsets: &[usize]) -> PagedRows {
        let at = |i: usize, p: Part| Part {
            offset: offsets[i],
            row_bytes: p.row_bytes,
        };
        match *self {
            PagedRows::Mse {
                codes,
                norms,
                bits,
                seed,
                qjl,
            } => PagedRows::Mse {
                codes: at(0, codes),
                norms: ScalarPart {
                    part: at(1, norms.part),
                    kind: norms.kind,
                },
                bits,
                seed,
                qjl: qjl.map(|q| PagedQjl {
                    signs: at(2, q.signs),
                    norms: ScalarPart {
                        part: at(3, q.norms.part),
                        kind: q.norms.kind,
                    },
                    seed: q.seed,
                }),
            },
            PagedRows::UniformTokens {
                codes,
                scales,
                zeros,
                kind,
                bits,
                group,
                seed,
            } => PagedRows::UniformTokens {
                codes: at(0, codes),
                scales: at(1, scales),
                zeros: at(2, zeros),
                kind,
                bits,
                group,
                seed,
            },
        }
    }
}

/// One side's first `len` rows of KV head `h`, gathered from the pages of `blocks` into one
/// page of `len` slots (each part's rows contiguous): the rows the fused kernel reads in one
/// call. Copying a slot's few bytes costs less than a kernel call per page (its query
/// rotation, tables and read-out rotation).
fn gather_side(
    cache: &PagedCache,
    rows: &PagedRows,
    blocks: &[i32],
    h: usize,
    len: usize,
) -> (PagedRows, Vec<u8>) {
    let parts = PageSide::parts(rows);
    let bs = cache.block_size;
    let mut buf = vec![0u8; parts.iter().map(|(_, p, _)| p.row_bytes * len).sum()];
    let mut offsets = Vec::with_capacity(parts.len());
    let mut at = 0;
    for (_, p, _) in &parts {
        for (i, &b) in blocks.iter().enumerate() {
            let n = (len - i * bs).min(bs);
            let src = b as usize * cache.block_stride + h * cache.head_stride + p.offset;
            let dst = at + i * bs * p.row_bytes;
            buf[dst..dst + n * p.row_bytes]
                .copy_from_slice(&cache.data[src..src + n * p.row_bytes]);
        }
        offsets.push(at);
        at += len * p.row_bytes;
    }
    (rows.relocated(&offsets), buf)
}

/// Attention of one query token's `g` query heads over one KV head's first `length` tokens:
/// their rows gathered from the pages, then one fused-kernel call.
fn token_head(
    isa: Isa,
    cache: &PagedCache,
    keys: &PagedRows,
    values: &PagedRows,
    qs: &PagedQueries,
    t: usize,
    h: usize,
) -> Result<Vec<f32>> {
    let (d, g) = (qs.head_dim, qs.q_heads / cache.kv_heads);
    let q = &qs.q[(t * qs.q_heads + h * g) * d..(t * qs.q_heads + (h + 1) * g) * d];
    let len = qs.lengths[t] as usize;
    let row = &qs.block_table[qs.seq[t] as usize * qs.table_width..];
    let blocks = &row[..len.div_ceil(cache.block_size)];
    let (kr, kbuf) = gather_side(cache, keys, blocks, h, len);
    let (vr, vbuf) = gather_side(cache, values, blocks, h, len);
    let (ks, vs) = (PageSide::new(kr, &kbuf, len), PageSide::new(vr, &vbuf, len));
    let layout = AttentionShape::new(1, g, len, d, qs.scale);
    Ok(decode_attention_with(isa, q, &layout, &ks.coded(), None, &vs.coded(), false)?.out)
}

/// Decode attention of every query token over its sequence's first `length` tokens in the
/// paged `cache`, read through the block table: `out[t, i, :] = softmax_j(scale * q_(t,i) .
/// k_hat_j) @ v_hat` with the keys and values of KV head `i / (q_heads / kv_heads)`, computed
/// from the codes (docs/kernels.md section 11): each (token, KV head) gathers its rows from the
/// pages and reads them in one fused-kernel call.
///
/// Returns tokens x q_heads x head_dim float32.
///
/// Errors: a layout whose parts do not fit a page, a cache shorter than its blocks, q_heads not
/// a multiple of kv_heads, a bad scale, `q`, `seq` or `block_table` lengths that do not match,
/// a sequence row, length or block id out of range, and whatever [`decode_attention_with`]
/// reports for a page (bits, seeds, stored scalars, non-finite queries or logits).
pub fn paged_decode_attention(
    cache: &PagedCache,
    keys: &PagedRows,
    values: &PagedRows,
    queries: &PagedQueries,
) -> Result<Vec<f32>> {
    paged_decode_attention_with(simd::active(), cache, keys, values, queries)
}

/// [`paged_decode_attention`] on the path `isa` (tests, benches).
pub fn paged_decode_attention_with(
    isa: Isa,
    cache: &PagedCache,
    keys: &PagedRows,
    values: &PagedRows,
    queries: &PagedQueries,
) -> Result<Vec<f32>> {
    let isa = isa.checked()?;
    check_cache(cache)?;
    check_parts(cache, keys)?;
    check_parts(cache, values)?;
    check_queries(cache, queries)?;
    // Multiply-adds of scores and read-out over every query token's context.
    let tokens: usize = queries.lengths.iter().map(|&l| l.max(0) as usize).sum();
    let work = tokens.saturating_mul(queries.q_heads * 2 * queries.head_dim);
    let units: Vec<Result<Vec<f32>>> = par::map_range(
        queries.lengths.len() * cache.kv_heads,
        work,
        par::PAR_MIN_ATTEND,
        |u| {
            token_head(
                isa,
                cache,
                keys,
                values,
                queries,
                u / cache.kv_heads,
                u % cache.kv_heads,
            )
        },
    );
    let mut out = Vec::with_capacity(queries.q.len());
    for u in units {
        out.extend_from_slice(&u?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::decode_attention;
    use crate::kernels::mse::MseQuantizer;
    use crate::kernels::pack::{pack, packed_len};
    use crate::rng::gaussians;

    const D: usize = 64;
    const BS: usize = 16;

    /// MSE keys and values of `heads x t` tokens, contiguous per head (codes, f32 norms).
    fn coded(heads: usize, t: usize, bits: u32) -> (Vec<u8>, Vec<f32>, Vec<u8>, Vec<f32>) {
        let quant = MseQuantizer::new(D, bits, Some(7)).unwrap();
        let x = gaussians(1, 2, 2 * heads * t * D);
        let (k, v) = (
            quant.encode(&x[..heads * t * D]).unwrap(),
            quant.encode(&x[heads * t * D..]).unwrap(),
        );
        let cd = quant.code_dim();
        (
            pack(&k.codes, cd, bits).unwrap(),
            k.norms.to_f32(),
            pack(&v.codes, cd, bits).unwrap(),
            v.norms.to_f32(),
        )
    }

    /// The slot layout: key codes, key norms, value codes, value norms.
    fn layout(bits: u32) -> (PagedRows, PagedRows, usize) {
        let rb = packed_len(D, bits);
        let part = |i: usize, row_bytes| Part {
            offset: BS * i,
            row_bytes,
        };
        let keys = PagedRows::Mse {
            codes: part(0, rb),
            norms: ScalarPart {
                part: part(rb, 4),
                kind: Scalar::F32,
            },
            bits,
            seed: Some(7),
            qjl: None,
        };
        let values = PagedRows::Mse {
            codes: part(rb + 4, rb),
            norms: ScalarPart {
                part: part(2 * rb + 4, 4),
                kind: Scalar::F32,
            },
            bits,
            seed: Some(7),
            qjl: None,
        };
        (keys, values, 2 * rb + 8)
    }

    #[test]
    fn pages_through_a_shuffled_block_table_equal_one_contiguous_call() {
        let (heads, t, bits, g) = (2, 45, 4, 3);
        let (kc, kn, vc, vn) = coded(heads, t, bits);
        let (keys, values, slot) = layout(bits);
        let rb = packed_len(D, bits);
        let (page, blocks) = (BS * slot, 5);
        let table = [3, 0, 4]; // sequence blocks 0, 1, 2 live in cache blocks 3, 0, 4
        let mut data = vec![0u8; blocks * heads * page];
        for h in 0..heads {
            for j in 0..t {
                let (i, o) = (j / BS, j % BS);
                let p = (table[i] * heads + h) * page;
                let src = h * t + j;
                let put = |data: &mut Vec<u8>, off: usize, w: usize, bytes: &[u8]| {
                    data[p + off * BS + o * w..p + off * BS + (o + 1) * w].copy_from_slice(bytes)
                };
                put(&mut data, 0, rb, &kc[src * rb..(src + 1) * rb]);
                put(&mut data, rb, 4, &kn[src].to_le_bytes());
                put(&mut data, rb + 4, rb, &vc[src * rb..(src + 1) * rb]);
                put(&mut data, 2 * rb + 4, 4, &vn[src].to_le_bytes());
            }
        }
        let cache = PagedCache {
            data: &data,
            blocks,
            kv_heads: heads,
            block_size: BS,
            page_bytes: page,
            block_stride: heads * page,
            head_stride: page,
        };
        let lengths = [45, 1, 17, 32];
        let q = gaussians(9, 2, lengths.len() * heads * g * D);
        let block_table: Vec<i32> = table.iter().map(|&b| b as i32).collect();
        let qs = PagedQueries {
            q: &q,
            q_heads: heads * g,
            head_dim: D,
            scale: 0.125,
            seq: &[0, 0, 0, 0],
            lengths: &lengths,
            block_table: &block_table,
            table_width: 3,
        };
        let got = paged_decode_attention(&cache, &keys, &values, &qs).unwrap();
        for (ti, &len) in lengths.iter().enumerate() {
            let n = len as usize;
            for h in 0..heads {
                let sl = |c: &[u8]| c[h * t * rb..(h * t + n) * rb].to_vec();
                let (kcs, vcs) = (sl(&kc), sl(&vc));
                let (kns, vns) = (&kn[h * t..h * t + n], &vn[h * t..h * t + n]);
                let want = decode_attention(
                    &q[(ti * heads + h) * g * D..(ti * heads + h + 1) * g * D],
                    &AttentionShape::new(1, g, n, D, 0.125),
                    &CodedRows::Mse {
                        codes: &kcs,
                        norms: ScalarView::F32(kns),
                        bits,
                        seed: Some(7),
                        qjl: None,
                    },
                    None,
                    &CodedRows::Mse {
                        codes: &vcs,
                        norms: ScalarView::F32(vns),
                        bits,
                        seed: Some(7),
                        qjl: None,
                    },
                    false,
                )
                .unwrap();
                let at = (ti * heads + h) * g * D;
                for (a, b) in got[at..at + g * D].iter().zip(&want.out) {
                    assert!((a - b).abs() <= 2e-6 * (1.0 + b.abs()), "{a} vs {b}");
                }
            }
        }
        // every path gives the same bits
        for isa in Isa::available() {
            assert_eq!(
                paged_decode_attention_with(isa, &cache, &keys, &values, &qs).unwrap(),
                got
            );
        }
    }

    #[test]
    fn bad_tables_lengths_and_layouts_are_errors() {
        let (keys, values, slot) = layout(4);
        let data = vec![0u8; 2 * BS * slot];
        let cache = PagedCache {
            data: &data,
            blocks: 2,
            kv_heads: 1,
            block_size: BS,
            page_bytes: BS * slot,
            block_stride: BS * slot,
            head_stride: BS * slot,
        };
        let q = vec![0.5f32; D];
        let qs =
            |seq: &'static [i32], lengths: &'static [i32], table: &'static [i32]| PagedQueries {
                q: &q,
                q_heads: 1,
                head_dim: D,
                scale: 0.125,
                seq,
                lengths,
                block_table: table,
                table_width: 2,
            };
        let msg = |r: Result<Vec<f32>>| r.unwrap_err().to_string();
        let run = |s: &PagedQueries| paged_decode_attention(&cache, &keys, &values, s);
        assert!(msg(run(&qs(&[0], &[17], &[0, 2])))
            .contains("block_table: expected block ids in 0..2, got 2"));
        assert!(
            msg(run(&qs(&[1], &[3], &[0, 1]))).contains("seq: expected a block-table row in 0..1")
        );
        assert!(msg(run(&qs(&[0], &[33], &[0, 1]))).contains("lengths: expected 1 ..= 32"));
        assert!(msg(run(&qs(&[0], &[0], &[0, 1]))).contains("lengths"));
        assert!(msg(run(&qs(&[0, 0], &[1], &[0, 1]))).contains("seq: expected"));
        // zero norms in an empty cache are valid stored scalars: a finite result
        assert!(run(&qs(&[0], &[20], &[1, 0]))
            .unwrap()
            .iter()
            .all(|v| v.is_finite()));
        let one = qs(&[0], &[1], &[0, 1]);
        let with = |c: PagedCache| msg(paged_decode_attention(&c, &keys, &values, &one));
        assert!(with(PagedCache {
            data: &data[..100],
            ..cache
        })
        .contains("cache: expected at least"));
        assert!(with(PagedCache {
            page_bytes: BS * slot - 1,
            ..cache
        })
        .contains("inside a page"));
    }
}
