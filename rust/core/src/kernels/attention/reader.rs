//! What every row layout of the fused attention shares: reading packed rows as float32 values
//! a block of tokens at a time, the float32-lane value sums carried into float64, and the
//! query rotation and its inverse.

use std::ops::Range;
use std::sync::Arc;

use super::super::hadamard::Rotation;
use super::super::pack::{packed_len, unpack_range};
use super::AttentionShape;
use crate::error::{KvqError, Result};
use crate::scalars::ScalarView;
use crate::simd::{ops, Isa};

/// Tokens summed in float32 lanes before their sum is carried into float64. A float32 sum of
/// `BLOCK` terms `w_j x_j` errs by at most about `BLOCK * 2^-24` of `sum_j |w_j x_j|`, and the
/// weights of a softmax sum to one, so the value error stays below `2e-6 max |v_hat|`.
pub(super) const BLOCK: usize = 32;

/// Reads packed rows of `bits`-bit codes as float32 values through a 256-entry table
/// (centroids, integer levels or `+-1` signs): the SIMD unpack, then the table decode of the
/// path (a register permute up to 4 bits).
#[derive(Debug, Clone)]
pub(super) struct RowReader {
    pub(super) n: usize,
    pub(super) bits: u32,
    pub(super) row_bytes: usize,
    table: Vec<f32>,
}

impl RowReader {
    /// Rows of `n` codes whose code `c` stands for `values[c]`.
    pub(super) fn new(n: usize, bits: u32, values: &[f32]) -> Self {
        let mut table = values.to_vec();
        table.resize(256, 0.0);
        Self {
            n,
            bits,
            row_bytes: packed_len(n, bits),
            table,
        }
    }

    /// `out[i] = values[code(start + i)]` for the codes of a packed row from code `start`
    /// (`scratch` holds at least `out.len()` bytes).
    #[inline]
    pub(super) fn decode(
        &self,
        isa: Isa,
        row: &[u8],
        start: usize,
        scratch: &mut [u8],
        out: &mut [f32],
    ) {
        let bit = start * self.bits as usize;
        if bit.is_multiple_of(8) {
            ops::decode_packed(isa, &row[bit / 8..], self.bits, &self.table, out);
        } else {
            let codes = &mut scratch[..out.len()];
            unpack_range(row, self.bits, start, codes);
            ops::decode(isa, codes, &self.table, self.bits, 1.0, out);
        }
    }

    /// `out[r * len + i] = values[code(start + i)]` of rows `first .. first + out.len() / len`
    /// of `codes` (rows of `row_bytes`): one call when `start` begins a byte, else row by row.
    pub(super) fn decode_rows(
        &self,
        isa: Isa,
        codes: &[u8],
        (first, start, len): (usize, usize, usize),
        scratch: &mut [u8],
        out: &mut [f32],
    ) {
        let (rb, bit) = (self.row_bytes, start * self.bits as usize);
        if bit.is_multiple_of(8) {
            let packed = &codes[first * rb + bit / 8..];
            ops::decode_packed_rows(isa, packed, (rb, len), self.bits, &self.table, out);
        } else {
            for (r, o) in out.chunks_exact_mut(len).enumerate() {
                let row = &codes[(first + r) * rb..(first + r + 1) * rb];
                self.decode(isa, row, start, scratch, o);
            }
        }
    }

    /// `ops::axpy_rows` (one weight per row, stride `len`) of the values of codes `start ..
    /// start + len` of rows `first .. first + w.len() / rows` of `codes` (rows of `row_bytes`):
    /// read packed in place where the SIMD path decodes them in registers and `start` begins a
    /// byte, else decoded into `buf` first (`scratch`: its codes' bytes; both grown as needed,
    /// kept for the next call).
    pub(super) fn axpy_rows_from(
        &self,
        isa: Isa,
        part: (&mut [f32], usize),
        w: &[f32],
        (codes, first, start, len): (&[u8], usize, usize, usize),
        (buf, scratch): (&mut Vec<f32>, &mut Vec<u8>),
    ) {
        let (rb, bit) = (self.row_bytes, start * self.bits as usize);
        if ops::fuses_packed_rows(isa, self.bits) && bit.is_multiple_of(8) {
            let packed = &codes[first * rb + bit / 8..];
            let rows = (packed, rb, self.bits, &self.table[..]);
            ops::axpy_rows_packed(isa, part, w, (1, len), rows);
        } else {
            let count = w.len() / part.1;
            buf.resize(count * len, 0.0);
            scratch.resize(len, 0);
            self.decode_rows(isa, codes, (first, start, len), scratch, buf);
            ops::axpy_rows(isa, part, w, (1, len), buf, len);
        }
    }

    /// Calls `f(j0, values of rows j0 .. j0 + count)` (count x n) for the tokens `span` of head
    /// `h` (of `t` tokens) in `codes`, in blocks of [`BLOCK`] tokens from `span.start`. When
    /// rows hold no padding bits (`n * bits % 8 == 0`) a block is one bit stream, decoded in
    /// one call.
    pub(super) fn each_block(
        &self,
        isa: Isa,
        codes: &[u8],
        (h, t): (usize, usize),
        span: Range<usize>,
        mut f: impl FnMut(usize, &[f32]),
    ) {
        let (rb, n) = (self.row_bytes, self.n);
        let stream = (n * self.bits as usize).is_multiple_of(8);
        let mut scratch = vec![0u8; n];
        let mut dec = vec![0.0f32; BLOCK * n];
        let rows = &codes[(h * t + span.start) * rb..(h * t + span.end) * rb];
        for (b, block) in rows.chunks(BLOCK * rb).enumerate() {
            let out = &mut dec[..block.len() / rb * n];
            if stream {
                ops::decode_packed(isa, block, self.bits, &self.table, out);
            } else {
                for (row, o) in block.chunks_exact(rb).zip(out.chunks_exact_mut(n)) {
                    self.decode(isa, row, 0, &mut scratch, o);
                }
            }
            f(span.start + b * BLOCK, out);
        }
    }

    /// Whether [`RowReader::each_block_in`] can hand blocks over packed on `isa` (rows without
    /// padding bits, codes the SIMD path decodes in registers: `ops::fuses_packed`).
    pub(super) fn fuses(&self, isa: Isa) -> bool {
        (self.n * self.bits as usize).is_multiple_of(8) && ops::fuses_packed(isa, self.bits)
    }

    /// [`RowReader::each_block`] as `f(j0, count, block)`: with `packed` (only where
    /// [`RowReader::fuses`]) each block is its packed bit stream, to be read by
    /// [`RowReader::dots_tokens`] / [`RowReader::axpy_rows`] without a decode into memory.
    pub(super) fn each_block_in(
        &self,
        isa: Isa,
        codes: &[u8],
        (h, t): (usize, usize),
        span: Range<usize>,
        packed: bool,
        mut f: impl FnMut(usize, usize, Block<'_>),
    ) {
        let (rb, n) = (self.row_bytes, self.n);
        if packed {
            debug_assert!(self.fuses(isa));
            // Each block's bytes run on to the end of `codes` (the SIMD reads may go past
            // the block's last row, never past the buffer).
            let (first, end) = (h * t + span.start, h * t + span.end);
            for j in (first..end).step_by(BLOCK) {
                let count = (end - j).min(BLOCK);
                f(
                    span.start + j - first,
                    count,
                    Block::Packed(&codes[j * rb..]),
                );
            }
        } else {
            self.each_block(isa, codes, (h, t), span, |j0, v| {
                f(j0, v.len() / n, Block::Values(v));
            });
        }
    }

    /// `ops::dots_tokens` of the `count` rows of a block (stride `n`), or
    /// `ops::dots_tokens_packed` of its packed rows.
    pub(super) fn dots_tokens(
        &self,
        isa: Isa,
        q: &[f32],
        (count, block): (usize, &Block<'_>),
        out: &mut [f32],
        stride: usize,
    ) {
        match *block {
            Block::Values(x) => ops::dots_tokens(isa, q, x, self.n, out, stride),
            Block::Packed(p) => {
                let codes = (self.bits, &self.table[..]);
                ops::dots_tokens_packed(isa, q, (p, count), codes, self.n, out, stride);
            }
        }
    }

    /// `ops::axpy_rows` of the rows of a block (stride `n`), or `ops::axpy_rows_packed` of its
    /// packed rows.
    pub(super) fn axpy_rows(
        &self,
        isa: Isa,
        part: (&mut [f32], usize),
        w: &[f32],
        shape: (usize, usize),
        block: &Block<'_>,
    ) {
        match *block {
            Block::Values(x) => ops::axpy_rows(isa, part, w, shape, x, self.n),
            Block::Packed(p) => {
                let rb = self.n * self.bits as usize / 8;
                ops::axpy_rows_packed(isa, part, w, shape, (p, rb, self.bits, &self.table));
            }
        }
    }

    /// Calls `f(j, values of row j)` for the tokens `span` of head `h`, in token order.
    pub(super) fn each_row(
        &self,
        isa: Isa,
        codes: &[u8],
        ht: (usize, usize),
        span: Range<usize>,
        mut f: impl FnMut(usize, &[f32]),
    ) {
        let n = self.n;
        self.each_block(isa, codes, ht, span, |j0, block| {
            for (k, row) in block.chunks_exact(n).enumerate() {
                f(j0 + k, row);
            }
        });
    }
}

/// A block of [`BLOCK`] (or fewer) rows: decoded values (count x n), or the packed bit stream
/// from the block's first row (running on past its last).
pub(super) enum Block<'a> {
    Values(&'a [f32]),
    Packed(&'a [u8]),
}

/// Per-query-row sums `sum_j w_(r,j) x_j` of one block of [`BLOCK`] rows `x_j` (n values each)
/// in SIMD float32 lanes held in registers (`ops::axpy_rows`, every query row at once, tokens
/// in increasing order), then carried into a float64 accumulator. Every step is elementwise
/// and the blocks are fixed by the token index, so every path and thread count agrees.
pub(super) struct Lanes {
    pub(super) part: Vec<f32>,
    /// The block's weights, query rows x tokens (x groups).
    pub(super) w: Vec<f32>,
    pub(super) n: usize,
    pub(super) rows: usize,
}

impl Lanes {
    /// Sums for `rows` query rows of `n` values each.
    pub(super) fn new(rows: usize, n: usize) -> Self {
        Self {
            part: vec![0.0; rows * n],
            w: Vec::with_capacity(rows * BLOCK),
            n,
            rows,
        }
    }

    /// Adds one block of rows (count x n) with weight `weight(r, k)` for query row `r` and the
    /// block's row `k`, then carries the sums into `acc` (row `r` at `r * stride + offset`).
    pub(super) fn add_block(
        &mut self,
        isa: Isa,
        block: &[f32],
        weight: impl Fn(usize, usize) -> f32,
        acc: &mut [f64],
        (stride, offset): (usize, usize),
    ) {
        let count = block.len() / self.n;
        self.w.clear();
        for r in 0..self.rows {
            self.w.extend((0..count).map(|k| weight(r, k)));
        }
        let one = (1, self.n);
        ops::axpy_rows(
            isa,
            (&mut self.part, self.rows),
            &self.w,
            one,
            block,
            self.n,
        );
        self.carry(isa, acc, (stride, offset));
    }

    /// Adds one block of `count` rows of `reader` (values or packed) with weight
    /// `p[r * pn + at + k] * nb[k]` for query row `r` and the block's row `k`, then carries the
    /// sums into `acc` (row `r` at `r * stride + offset`).
    pub(super) fn add_rows(
        &mut self,
        isa: Isa,
        (reader, count, block): (&RowReader, usize, &Block<'_>),
        (p, pn, at, nb): (&[f32], usize, usize, &[f32]),
        acc: &mut [f64],
        so: (usize, usize),
    ) {
        self.w.clear();
        for r in 0..self.rows {
            let pr = &p[r * pn + at..r * pn + at + count];
            self.w
                .extend(pr.iter().zip(&nb[..count]).map(|(&a, &b)| a * b));
        }
        let part = (&mut self.part[..], self.rows);
        reader.axpy_rows(isa, part, &self.w, (1, self.n), block);
        self.carry(isa, acc, so);
    }

    /// `acc[r * stride + offset + i] += part[r][i]`, then clears the lanes.
    pub(super) fn carry(&mut self, isa: Isa, acc: &mut [f64], (stride, offset): (usize, usize)) {
        for (r, pr) in self.part.chunks_exact(self.n).enumerate() {
            let ar = &mut acc[r * stride + offset..r * stride + offset + self.n];
            ops::add_to_f64(isa, ar, pr);
        }
        self.part.fill(0.0);
    }
}

/// The rotation of `seed` (None: none) and the code-domain dimension (d', or d).
pub(super) fn code_domain(seed: Option<u64>, d: usize) -> Result<(Option<Arc<Rotation>>, usize)> {
    let rot = seed.map(|s| Rotation::cached(d, s)).transpose()?;
    let cd = rot.as_ref().map_or(d, |r| r.padded_dim());
    Ok((rot, cd))
}

/// The query rows (rows x d) in the code domain (rotated, or copied): rows x `cd`.
pub(super) fn code_queries(
    isa: Isa,
    rot: &Option<Arc<Rotation>>,
    q: &[f32],
    d: usize,
    cd: usize,
) -> Vec<f32> {
    let mut qr = vec![0.0f32; q.len() / d * cd];
    for (o, row) in qr.chunks_exact_mut(cd).zip(q.chunks_exact(d)) {
        match rot {
            Some(r) => r.forward_row_isa(isa, row, o),
            None => o.copy_from_slice(row),
        }
    }
    qr
}

/// Un-rotates (or copies) the first `cd` values of each row of a float64 code-domain
/// accumulator (rows x `stride`), divided by its softmax normaliser, into `out` (rows x d).
pub(super) fn unrotate(
    isa: Isa,
    rot: &Option<Arc<Rotation>>,
    (acc, stride, cd): (&[f64], usize, usize),
    sums: &[f64],
    out: &mut [f32],
) {
    let d = out.len() / sums.len();
    let mut buf = vec![0.0f32; cd];
    for ((ar, &sum), o) in acc
        .chunks_exact(stride)
        .zip(sums)
        .zip(out.chunks_exact_mut(d))
    {
        for (b, &a) in buf.iter_mut().zip(&ar[..cd]) {
            *b = (a / sum) as f32;
        }
        match rot {
            Some(r) => r.inverse_row_isa(isa, &mut buf, o),
            None => o.copy_from_slice(&buf[..d]),
        }
    }
}

/// `[0, 1, ..., 2^bits - 1]`: the integer levels of a uniform code.
pub(super) fn levels(bits: u32) -> Vec<f32> {
    (0..1u32 << bits).map(|v| v as f32).collect()
}

/// `[(2c - L) / L for c in 0 ..= L]`, `L = 2^bits - 1`: the levels of a symmetric code in
/// `[-1, 1]` (one float32 division each).
pub(super) fn symmetric_levels(bits: u32) -> Vec<f32> {
    let top = (1i32 << bits) - 1;
    (0..=top)
        .map(|c| (2 * c - top) as f32 / top as f32)
        .collect()
}

/// One stored scalar per token of every head (heads x stride, the first `tokens` of each
/// head held), checked finite and not negative (`arg`; log-coded exponent bytes `exps_arg`)
/// and read as rows of `stride` (how log codes find each token's group exponent).
pub(super) fn per_token_scalars<'a>(
    view: ScalarView<'a>,
    (arg, exps_arg): (&'static str, &'static str),
    lay: &AttentionShape,
) -> Result<ScalarView<'a>> {
    let held = (lay.heads, lay.stride, lay.tokens);
    let view = view.in_rows(lay.stride);
    match view {
        ScalarView::Log(l) => l.validate((arg, exps_arg), held)?,
        _ => view.validate_rows(arg, held, false)?,
    }
    Ok(view)
}

/// `a * b`, or an error naming `arg` when it overflows.
pub(super) fn mul(arg: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or(KvqError::InvalidDimension {
        arg,
        expected: "sizes whose product fits in memory".into(),
        actual: i64::MAX,
    })
}
