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

use super::attention::{decode_attention_with, reconstruct_with, AttentionShape, CodedRows};
use super::{check_head_dim, check_len};
use crate::dtype::Dtype;
use crate::error::{KvqError, Result};
use crate::par;
use crate::rows::{Field, Resolve, Rows};
use crate::scalars::ScalarRead;
use crate::simd::{self, Isa};

/// Where one part of a slot lives in a page: `offset` bytes from the page start, `row_bytes`
/// bytes per token, `block_size` rows in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Byte offset of the part's rows in the page.
    pub offset: usize,
    /// Bytes per token.
    pub row_bytes: usize,
}

/// A part of stored scalars (little-endian float16 or float32), a few per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScalarPart {
    /// Where its rows are.
    pub part: Part,
    /// Their dtype ([`Dtype::F16`] or [`Dtype::F32`]; `part.row_bytes` a multiple of its size).
    pub dtype: Dtype,
}

/// One side (keys or values) of the slot layout: the row formats of [`Rows`] over places in
/// a page. The paged kernel reads the per-token ones: [`Rows::Mse`] (QJL residual optional),
/// [`Rows::UniformTokens`], as keys [`Rows::TokenRuns`], each alone or in [`Rows::Centred`].
/// Their bases and means are held by value (`basis_heads` / `mean_heads` tables, a divisor of
/// the KV heads; KV head `h` reads table `h % count`).
pub type PagedRows = Rows<Part, ScalarPart, Part, Vec<f32>>;

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

impl<'a> PagedQueries<'a> {
    /// Each query token's sequence row and length, with the block table.
    pub fn sequences(&self) -> PagedSequences<'a> {
        PagedSequences {
            seq: self.seq,
            lengths: self.lengths,
            block_table: self.block_table,
            table_width: self.table_width,
        }
    }
}

/// Token spans of sequences in the block table: the first `lengths[i]` tokens of block-table
/// row `seq[i]`.
#[derive(Debug, Clone, Copy)]
pub struct PagedSequences<'a> {
    /// Block-table rows.
    pub seq: &'a [i32],
    /// Tokens of each, from its first.
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

/// Checks that every part of a side fits in a page, whole scalars per token.
struct Fits<'c> {
    cache: &'c PagedCache<'c>,
}

impl Fits<'_> {
    fn part(&self, part: &Part, at: Field<'_>) -> Result<()> {
        let end = part
            .row_bytes
            .checked_mul(self.cache.block_size)
            .and_then(|b| b.checked_add(part.offset));
        if part.row_bytes == 0 || end.is_none_or(|e| e > self.cache.page_bytes) {
            return Err(dim_error(
                "layout",
                format!(
                    "part {at} ({} bytes per token at offset {}) inside a page of {} bytes ({} slots)",
                    part.row_bytes, part.offset, self.cache.page_bytes, self.cache.block_size
                ),
                part.row_bytes,
            ));
        }
        Ok(())
    }
}

impl<'a> Resolve<'a, Part, ScalarPart, Part, Vec<f32>> for Fits<'_> {
    type Bytes = ();
    type Scalars = Dtype;
    type Floats = ();
    type Table = ();
    type Error = KvqError;
    fn bytes(&mut self, part: &'a Part, at: Field<'_>) -> Result<()> {
        self.part(part, at)
    }
    fn scalars(&mut self, s: &'a ScalarPart, at: Field<'_>) -> Result<Dtype> {
        self.part(&s.part, at)?;
        if !matches!(s.dtype, Dtype::F16 | Dtype::F32) {
            return Err(KvqError::ShapeMismatch {
                arg: "layout",
                expected: format!("part {at}: float16 or float32 stored scalars"),
                actual: s.dtype.name().into(),
            });
        }
        let size = s.dtype.itemsize();
        if !s.part.row_bytes.is_multiple_of(size) {
            return Err(dim_error(
                "layout",
                format!("part {at}: a whole number of {size}-byte scalars per token"),
                s.part.row_bytes,
            ));
        }
        Ok(s.dtype)
    }
    fn floats(&mut self, part: &'a Part, at: Field<'_>) -> Result<()> {
        self.part(part, at)
    }
    fn table(&mut self, _: &'a Vec<f32>, _: Field<'_>) -> Result<()> {
        Ok(())
    }
}

/// Whether the paged kernel reads `rows` as side `side`: a per-token layout (MSE, per-token
/// uniform groups, token runs as keys), alone or around a mean.
fn per_token(rows: &PagedRows, keys: bool) -> bool {
    match rows {
        Rows::Mse { .. } | Rows::UniformTokens { .. } => true,
        Rows::TokenRuns { .. } => keys,
        Rows::Centred { rows, .. } => {
            !matches!(**rows, Rows::Centred { .. }) && per_token(rows, keys)
        }
        _ => false,
    }
}

/// Errors unless a table held by value (`at`) is `count` tables of `per` floats, `count` a
/// divisor of the KV heads.
fn check_table(
    at: Field<'_>,
    table: &[f32],
    count: usize,
    per: usize,
    kv_heads: usize,
) -> Result<()> {
    if count == 0 || !kv_heads.is_multiple_of(count) {
        return Err(dim_error(
            "layout",
            format!("{at}: 1 table or one per KV head (a divisor of the {kv_heads} KV heads)"),
            count,
        ));
    }
    if Some(table.len()) != count.checked_mul(per) {
        return Err(dim_error(
            "layout",
            format!("{at}: {count} tables of {per} floats"),
            table.len(),
        ));
    }
    Ok(())
}

/// Errors unless the bases and means of `rows` are whole per-head tables of head_dim `d`.
fn check_tables(rows: &PagedRows, side: &str, cache: &PagedCache, d: usize) -> Result<()> {
    let at = |centred, name| Field {
        side,
        centred,
        run: None,
        name,
    };
    match rows {
        Rows::TokenRuns {
            basis, basis_heads, ..
        } => check_table(
            at(false, "basis"),
            basis,
            *basis_heads,
            d * d,
            cache.kv_heads,
        ),
        Rows::Centred {
            rows,
            mean,
            mean_heads,
        } => {
            if let Rows::TokenRuns {
                basis, basis_heads, ..
            } = &**rows
            {
                check_table(
                    at(true, "basis"),
                    basis,
                    *basis_heads,
                    d * d,
                    cache.kv_heads,
                )?;
            }
            check_table(at(false, "mean"), mean, *mean_heads, d, cache.kv_heads)
        }
        _ => Ok(()),
    }
}

/// Errors unless `rows` (side `side`) is a per-token row format whose parts fit in a page and
/// whose tables are per-head tables of head_dim `d`.
fn check_parts(cache: &PagedCache, rows: &PagedRows, side: &'static str, d: usize) -> Result<()> {
    let keys = side == "keys";
    if !per_token(rows, keys) {
        let expected = if keys {
            "MSERows, per-token UniformRows or TokenRunRows, alone or in CentredRows (per-token layouts)"
        } else {
            "MSERows or per-token UniformRows, alone or in CentredRows (per-token layouts)"
        };
        let actual = match rows {
            Rows::Centred { rows, .. } => format!("CentredRows of {}", rows.class()),
            _ => rows.class().into(),
        };
        return Err(KvqError::ShapeMismatch {
            arg: side,
            expected: expected.into(),
            actual,
        });
    }
    check_tables(rows, side, cache, d)?;
    let dtypes = rows.map(side, &mut Fits { cache })?;
    let inner = match &dtypes {
        Rows::Centred { rows, .. } => &**rows,
        other => other,
    };
    if let Rows::UniformTokens { scales, zeros, .. } = inner {
        if scales != zeros {
            return Err(KvqError::ShapeMismatch {
                arg: side,
                expected: format!("zero points of the scales' dtype {}", scales.name()),
                actual: zeros.name().into(),
            });
        }
    }
    Ok(())
}

/// Head `h`'s tables of gathered rows: each basis and mean narrowed to table `h % count` (one
/// table, count 1), as the fused kernel reads one KV head.
fn head_tables<B, S, F>(rows: &mut Rows<B, S, F, &[f32]>, h: usize, d: usize) {
    fn pick<'t>(table: &mut &'t [f32], count: &mut usize, h: usize, per: usize) {
        let all: &'t [f32] = table;
        let i = h % *count;
        *table = &all[i * per..(i + 1) * per];
        *count = 1;
    }
    match rows {
        Rows::TokenRuns {
            basis, basis_heads, ..
        }
        | Rows::ChannelRuns {
            basis, basis_heads, ..
        } => pick(basis, basis_heads, h, d * d),
        Rows::Centred {
            rows,
            mean,
            mean_heads,
        } => {
            head_tables(rows, h, d);
            pick(mean, mean_heads, h, d);
        }
        _ => {}
    }
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

/// Checks the query heads, scale and queries, then [`check_sequences`].
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
    let qlen = tokens
        .checked_mul(qs.q_heads)
        .and_then(|n| n.checked_mul(qs.head_dim));
    check_len(
        "q",
        qs.q.len(),
        qlen.unwrap_or(usize::MAX),
        "tokens x q_heads x head_dim",
    )?;
    check_sequences(cache, &qs.sequences())
}

/// Checks every entry's sequence row, length and block ids.
fn check_sequences(cache: &PagedCache, qs: &PagedSequences) -> Result<()> {
    check_len(
        "seq",
        qs.seq.len(),
        qs.lengths.len(),
        "one sequence row per entry of lengths",
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

/// Gathers one side's first `len` rows of KV head `h` from the pages of `blocks`, each part's
/// rows contiguous (its scalars decoded from their bytes): the rows the fused kernel reads in
/// one call. Copying a slot's few bytes costs less than a kernel call per page (its query
/// rotation, tables and read-out rotation).
struct Gather<'c> {
    cache: &'c PagedCache<'c>,
    blocks: &'c [i32],
    h: usize,
    len: usize,
}

impl Gather<'_> {
    fn rows(&self, p: &Part) -> Vec<u8> {
        let (bs, len) = (self.cache.block_size, self.len);
        let mut buf = vec![0u8; p.row_bytes * len];
        for (i, &b) in self.blocks.iter().enumerate() {
            let n = (len - i * bs).min(bs);
            let src =
                b as usize * self.cache.block_stride + self.h * self.cache.head_stride + p.offset;
            let dst = i * bs * p.row_bytes;
            buf[dst..dst + n * p.row_bytes]
                .copy_from_slice(&self.cache.data[src..src + n * p.row_bytes]);
        }
        buf
    }
}

impl<'a> Resolve<'a, Part, ScalarPart, Part, Vec<f32>> for Gather<'_> {
    type Bytes = Vec<u8>;
    type Scalars = ScalarRead<'static>;
    type Floats = Vec<f32>;
    type Table = &'a [f32];
    type Error = KvqError;
    fn bytes(&mut self, part: &'a Part, _: Field<'_>) -> Result<Vec<u8>> {
        Ok(self.rows(part))
    }
    fn scalars(&mut self, s: &'a ScalarPart, at: Field<'_>) -> Result<ScalarRead<'static>> {
        let bytes = self.rows(&s.part);
        let read = ScalarRead::from_le(&bytes, s.dtype).ok_or_else(|| KvqError::ShapeMismatch {
            arg: "layout",
            expected: format!("part {at}: float16 or float32 stored scalars"),
            actual: s.dtype.name().into(),
        })?;
        Ok(read.into_owned())
    }
    fn floats(&mut self, _: &'a Part, at: Field<'_>) -> Result<Vec<f32>> {
        Err(KvqError::ShapeMismatch {
            arg: "layout",
            expected: format!("{at}: per-token coded rows"),
            actual: "float rows".into(),
        })
    }
    fn table(&mut self, t: &'a Vec<f32>, _: Field<'_>) -> Result<&'a [f32]> {
        Ok(t)
    }
}

/// `f` of the first `len` tokens of KV head `h` in the pages of `blocks`: both sides' rows
/// gathered from the pages, with the tables of KV head `h`.
fn with_head_rows<R>(
    cache: &PagedCache,
    (keys, values): (&PagedRows, &PagedRows),
    (blocks, h, len, d): (&[i32], usize, usize, usize),
    f: impl FnOnce(&CodedRows, &CodedRows) -> Result<R>,
) -> Result<R> {
    let mut gather = Gather {
        cache,
        blocks,
        h,
        len,
    };
    let (kr, vr) = (
        keys.map("keys", &mut gather)?,
        values.map("values", &mut gather)?,
    );
    let (mut kv, mut vv) = (kr.view(), vr.view());
    head_tables(&mut kv, h, d);
    head_tables(&mut vv, h, d);
    f(&kv, &vv)
}

/// The blocks of the first `len` tokens of block-table row `seq`.
fn blocks_of<'a>(cache: &PagedCache, qs: &PagedSequences<'a>, seq: i32, len: usize) -> &'a [i32] {
    let row = &qs.block_table[seq as usize * qs.table_width..];
    &row[..len.div_ceil(cache.block_size)]
}

/// Attention of one query token's `g` query heads over one KV head's first `length` tokens:
/// their rows gathered from the pages, then one fused-kernel call.
fn token_head(
    isa: Isa,
    cache: &PagedCache,
    rows: (&PagedRows, &PagedRows),
    qs: &PagedQueries,
    t: usize,
    h: usize,
) -> Result<Vec<f32>> {
    let (d, g) = (qs.head_dim, qs.q_heads / cache.kv_heads);
    let q = &qs.q[(t * qs.q_heads + h * g) * d..(t * qs.q_heads + (h + 1) * g) * d];
    let len = qs.lengths[t] as usize;
    let blocks = blocks_of(cache, &qs.sequences(), qs.seq[t], len);
    with_head_rows(cache, rows, (blocks, h, len, d), |kv, vv| {
        let layout = AttentionShape::new(1, g, len, d, qs.scale);
        Ok(decode_attention_with(isa, q, &layout, kv, None, vv, false)?.out)
    })
}

/// Decode attention of every query token over its sequence's first `length` tokens in the
/// paged `cache`, read through the block table: `out[t, i, :] = softmax_j(scale * q_(t,i) .
/// k_hat_j) @ v_hat` with the keys and values of KV head `i / (q_heads / kv_heads)`, computed
/// from the codes (docs/kernels.md section 11): each (token, KV head) gathers its rows from the
/// pages and reads them in one fused-kernel call.
///
/// Returns tokens x q_heads x head_dim float32.
///
/// Keys may be token runs in a basis and either side may sit around a mean
/// ([`Rows::Centred`]): KV head `h` reads basis and mean `h % count` of their tables.
///
/// Errors: rows other than per-token ones (MSE, per-token uniform, token runs as keys, alone or
/// around a mean), tables that are not 1 or a divisor of the KV heads of head_dim-sized tables,
/// a layout whose parts do not fit a page or whose scalars are not float16 / float32, a cache shorter than its blocks, q_heads not
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
    check_queries(cache, queries)?;
    check_parts(cache, keys, "keys", queries.head_dim)?;
    check_parts(cache, values, "values", queries.head_dim)?;
    // Multiply-adds of scores and read-out over every query token's context.
    let tokens: usize = queries.lengths.iter().map(|&l| l.max(0) as usize).sum();
    let work = tokens.saturating_mul(queries.q_heads * 2 * queries.head_dim);
    let units: Vec<Result<Vec<f32>>> = par::map_range(
        queries.lengths.len() * cache.kv_heads,
        work,
        par::par_min_attend(),
        |u| {
            token_head(
                isa,
                cache,
                (keys, values),
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

/// Tokens per unit of work of [`paged_reconstruct`] (rounded up to whole pages).
const RECONSTRUCT_TOKENS: usize = 256;

/// Keys and values of the first `lengths[i]` tokens of block-table rows `seq[i]`, every KV
/// head, decoded to the head domain ([`reconstruct_with`]): keys and values each float32, per
/// sequence `i` in order, kv_heads x `lengths[i]` x head_dim. Dense attention of a prompt's
/// many query tokens (a prefill) reads them, where reading the codes once per query token
/// would cost a pass over its context each.
///
/// Errors: as [`paged_decode_attention`] for the cache, rows and sequences, and non-finite
/// decoded rows.
pub fn paged_reconstruct(
    cache: &PagedCache,
    keys: &PagedRows,
    values: &PagedRows,
    seqs: &PagedSequences,
    head_dim: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    paged_reconstruct_with(simd::active(), cache, (keys, values), seqs, head_dim)
}

/// [`paged_reconstruct`] on the path `isa` (tests, benches).
pub fn paged_reconstruct_with(
    isa: Isa,
    cache: &PagedCache,
    (keys, values): (&PagedRows, &PagedRows),
    seqs: &PagedSequences,
    head_dim: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let isa = isa.checked()?;
    check_head_dim("head_dim", head_dim)?;
    check_cache(cache)?;
    check_sequences(cache, seqs)?;
    check_parts(cache, keys, "keys", head_dim)?;
    check_parts(cache, values, "values", head_dim)?;
    let heads = cache.kv_heads;
    let tokens: usize = seqs.lengths.iter().map(|&l| l.max(0) as usize).sum();
    // Decoding a token costs about head_dim multiply-adds per coordinate (unit query rows).
    let work = tokens.saturating_mul(heads * 2 * head_dim * head_dim);
    // Units of whole pages, (sequence, KV head, span) in output order: a long prompt's few
    // KV heads are split over every thread.
    let span = RECONSTRUCT_TOKENS.div_ceil(cache.block_size) * cache.block_size;
    let units: Vec<(usize, usize, usize)> = (0..seqs.seq.len())
        .flat_map(|i| {
            let spans = (seqs.lengths[i] as usize).div_ceil(span);
            (0..heads).flat_map(move |h| (0..spans).map(move |c| (i, h, c)))
        })
        .collect();
    let parts = par::map_range(units.len(), work, par::par_min_bulk(), |u| {
        let (i, h, c) = units[u];
        let len = seqs.lengths[i] as usize;
        let blocks = blocks_of(cache, seqs, seqs.seq[i], len);
        let (start, n) = (c * span, span.min(len - c * span));
        let blocks = &blocks[start / cache.block_size..(start + n).div_ceil(cache.block_size)];
        with_head_rows(cache, (keys, values), (blocks, h, n, head_dim), |kv, vv| {
            let lay = AttentionShape::new(1, 1, n, head_dim, 1.0);
            reconstruct_with(isa, &lay, kv, vv)
        })
    });
    let size = tokens * heads * head_dim;
    let (mut k, mut v) = (Vec::with_capacity(size), Vec::with_capacity(size));
    for p in parts {
        let (ku, vu) = p?;
        k.extend_from_slice(&ku);
        v.extend_from_slice(&vu);
    }
    Ok((k, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::{decode_attention, CodedRows};
    use crate::kernels::mse::MseQuantizer;
    use crate::kernels::pack::{pack, packed_len};
    use crate::rng::gaussians;
    use crate::rows::TokenRun;
    use crate::scalars::{FloatView, ScalarView};

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

    /// Sequence blocks 0, 1, 2 live in cache blocks 3, 0, 4 (of 5).
    const TABLE: [i32; 3] = [3, 0, 4];
    const BLOCKS: usize = 5;
    /// Tokens each query token attends to.
    const LENGTHS: [i32; 4] = [45, 1, 17, 32];

    fn le_bytes(x: &[f32]) -> Vec<u8> {
        x.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// The pages of `heads x t` tokens whose slots hold `parts` one after the other (each
    /// part heads x t rows, contiguous per head) through [`TABLE`]; returns the cache bytes,
    /// each part's place in a page and the page size.
    fn paginate(parts: &[&[u8]], heads: usize, t: usize) -> (Vec<u8>, Vec<Part>, usize) {
        let mut places = Vec::new();
        let mut slot = 0;
        for p in parts {
            let row_bytes = p.len() / (heads * t);
            places.push(Part {
                offset: BS * slot,
                row_bytes,
            });
            slot += row_bytes;
        }
        let page = BS * slot;
        let mut data = vec![0u8; BLOCKS * heads * page];
        for h in 0..heads {
            for j in 0..t {
                let start = (TABLE[j / BS] as usize * heads + h) * page;
                for (src, p) in parts.iter().zip(&places) {
                    let (rb, i) = (p.row_bytes, h * t + j);
                    let dst = start + p.offset + (j % BS) * rb;
                    data[dst..dst + rb].copy_from_slice(&src[i * rb..(i + 1) * rb]);
                }
            }
        }
        (data, places, page)
    }

    fn cache_of(data: &[u8], heads: usize, page: usize) -> PagedCache<'_> {
        PagedCache {
            data,
            blocks: BLOCKS,
            kv_heads: heads,
            block_size: BS,
            page_bytes: page,
            block_stride: heads * page,
            head_stride: page,
        }
    }

    /// Query tokens of sequence 0 attending to its first [`LENGTHS`] tokens.
    fn queries(q: &[f32], q_heads: usize) -> PagedQueries<'_> {
        PagedQueries {
            q,
            q_heads,
            head_dim: D,
            scale: 0.125,
            seq: &[0, 0, 0, 0],
            lengths: &LENGTHS,
            block_table: &TABLE,
            table_width: 3,
        }
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
                dtype: Dtype::F32,
            },
            bits,
            seed: Some(7),
            qjl: None,
        };
        let values = PagedRows::Mse {
            codes: part(rb + 4, rb),
            norms: ScalarPart {
                part: part(2 * rb + 4, 4),
                dtype: Dtype::F32,
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
        let (data, places, page) = paginate(&[&kc, &le_bytes(&kn), &vc, &le_bytes(&vn)], heads, t);
        let Rows::Mse { codes, .. } = values else {
            unreachable!()
        };
        assert_eq!((page, places[2]), (BS * slot, codes));
        let cache = cache_of(&data, heads, page);
        let q = gaussians(9, 2, LENGTHS.len() * heads * g * D);
        let qs = queries(&q, heads * g);
        let got = paged_decode_attention(&cache, &keys, &values, &qs).unwrap();
        for (ti, &len) in LENGTHS.iter().enumerate() {
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
                        norms: ScalarView::Float(FloatView::F32(kns)),
                        bits,
                        seed: Some(7),
                        qjl: None,
                    },
                    None,
                    &CodedRows::Mse {
                        codes: &vcs,
                        norms: ScalarView::Float(FloatView::F32(vns)),
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
        // Rows the paged kernel does not read, scalars of another dtype: errors naming them.
        let dense = PagedRows::Dense(Part {
            offset: 0,
            row_bytes: 4,
        });
        assert!(msg(paged_decode_attention(&cache, &dense, &values, &one))
            .starts_with("keys: expected MSERows, per-token UniformRows or TokenRunRows, alone or in CentredRows (per-token layouts), got DenseRows"));
        let Rows::Mse { norms, .. } = values.clone() else {
            unreachable!()
        };
        let bytes_norms = PagedRows::Mse {
            norms: ScalarPart {
                dtype: Dtype::U8,
                ..norms
            },
            codes: norms.part,
            bits: 4,
            seed: Some(7),
            qjl: None,
        };
        assert!(
            msg(paged_decode_attention(&cache, &keys, &bytes_norms, &one)).starts_with(
                "layout: expected part values.norms: float16 or float32 stored scalars, got uint8"
            )
        );
    }

    /// `matched` keys (token runs in per-head bases around per-head means, float16 scales)
    /// and values (MSE around per-head means), with one table shared by the KV heads and one
    /// per KV head: the pages give one contiguous call over every head (its tables by
    /// `h % count`) on the same tokens.
    #[test]
    fn matched_tables_per_kv_head_equal_one_contiguous_call() {
        let (heads, t, g, bits) = (2, 45, 3, 4);
        let runs = [(5u32, 0usize, 8usize), (3, 8, 24), (2, 24, 40), (1, 40, 48)];
        let codes: Vec<Vec<u8>> = (runs.iter().enumerate())
            .map(|(i, &(b, lo, hi))| {
                let n = heads * t * packed_len(hi - lo, b);
                let x = gaussians(20 + i as u64, 3, n);
                x.iter().map(|v| (v.abs() * 997.0) as u32 as u8).collect()
            })
            .collect();
        let scales: Vec<u16> = (gaussians(30, 3, heads * t).iter())
            .map(|v| half::f16::from_f32(0.25 + v.abs()).to_bits())
            .collect();
        let scale_bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        let (_, _, vc, vn) = coded(heads, t, bits);
        let mut parts: Vec<&[u8]> = codes.iter().map(Vec::as_slice).collect();
        let vn_bytes = le_bytes(&vn);
        parts.extend([scale_bytes.as_slice(), &vc, &vn_bytes]);
        let (data, places, page) = paginate(&parts, heads, t);
        let cache = cache_of(&data, heads, page);
        let q = gaussians(9, 2, LENGTHS.len() * heads * g * D);
        let qs = queries(&q, heads * g);
        let n_runs = runs.len();
        for tables in [1, heads] {
            let scaled = |seed, n, by: f32| -> Vec<f32> {
                gaussians(seed, 4, n).iter().map(|v| v * by).collect()
            };
            let (basis, kmean, vmean) = (
                scaled(40, tables * D * D, 0.2),
                scaled(41, tables * D, 2.0),
                scaled(42, tables * D, 1.0),
            );
            let keys = PagedRows::Centred {
                rows: Box::new(PagedRows::TokenRuns {
                    runs: (runs.iter().zip(&places))
                        .map(|(&(bits, start, stop), &codes)| TokenRun {
                            codes,
                            bits,
                            start,
                            stop,
                        })
                        .collect(),
                    scales: ScalarPart {
                        part: places[n_runs],
                        dtype: Dtype::F16,
                    },
                    basis: basis.clone(),
                    basis_heads: tables,
                }),
                mean: kmean.clone(),
                mean_heads: tables,
            };
            let values = PagedRows::Centred {
                rows: Box::new(PagedRows::Mse {
                    codes: places[n_runs + 1],
                    norms: ScalarPart {
                        part: places[n_runs + 2],
                        dtype: Dtype::F32,
                    },
                    bits,
                    seed: Some(7),
                    qjl: None,
                }),
                mean: vmean.clone(),
                mean_heads: tables,
            };
            let got = paged_decode_attention(&cache, &keys, &values, &qs).unwrap();
            let want_keys = CodedRows::Centred {
                rows: Box::new(CodedRows::TokenRuns {
                    runs: (runs.iter().zip(&codes))
                        .map(|(&(bits, start, stop), codes)| TokenRun {
                            codes: codes.as_slice(),
                            bits,
                            start,
                            stop,
                        })
                        .collect(),
                    scales: ScalarView::Float(FloatView::F16(&scales)),
                    basis: &basis,
                    basis_heads: tables,
                }),
                mean: &kmean,
                mean_heads: tables,
            };
            let want_values = CodedRows::Centred {
                rows: Box::new(CodedRows::Mse {
                    codes: &vc,
                    norms: ScalarView::Float(FloatView::F32(&vn)),
                    bits,
                    seed: Some(7),
                    qjl: None,
                }),
                mean: &vmean,
                mean_heads: tables,
            };
            for (ti, &len) in LENGTHS.iter().enumerate() {
                let shape = AttentionShape {
                    stride: t,
                    ..AttentionShape::new(heads, g, len as usize, D, 0.125)
                };
                let at = ti * heads * g * D;
                let qt = &q[at..at + heads * g * D];
                let want = decode_attention(qt, &shape, &want_keys, None, &want_values, false);
                for (a, b) in got[at..at + heads * g * D].iter().zip(&want.unwrap().out) {
                    assert!(
                        (a - b).abs() <= 2e-6 * (1.0 + b.abs()),
                        "{tables}: {a} vs {b}"
                    );
                }
            }
            // Tables that do not divide the KV heads, or of the wrong size: errors naming them.
            let msg = |k: &PagedRows, v: &PagedRows| {
                paged_decode_attention(&cache, k, v, &qs)
                    .unwrap_err()
                    .to_string()
            };
            let Rows::Centred { rows, .. } = keys.clone() else {
                unreachable!()
            };
            let three = PagedRows::Centred {
                rows,
                mean: vec![0.0; 3 * D],
                mean_heads: 3,
            };
            assert!(msg(&three, &values).starts_with(
                "layout: expected keys.mean: 1 table or one per KV head (a divisor of the 2 KV heads)"
            ));
            let Rows::Centred { rows, .. } = values.clone() else {
                unreachable!()
            };
            let short = PagedRows::Centred {
                rows,
                mean: vec![0.0; tables * D - 1],
                mean_heads: tables,
            };
            assert!(msg(&keys, &short).starts_with(&format!(
                "layout: expected values.mean: {tables} tables of {D} floats"
            )));
            let Rows::Centred { rows, .. } = keys.clone() else {
                unreachable!()
            };
            // Token runs are keys only: as values, alone or around a mean, refused by name.
            assert!(msg(&keys, &rows).starts_with(
                "values: expected MSERows or per-token UniformRows, alone or in CentredRows (per-token layouts), got TokenRunRows"
            ));
            assert!(msg(&keys, &keys).ends_with("got CentredRows of TokenRunRows"));
        }
    }
}
