//! Native encoders of a layer store's two sides: a cache flushing tokens out of its
//! full-precision window encodes them and appends the codes in one call
//! ([`LayerStore::encode_append`]), with no per-part objects between the kernels and the
//! store. Each encoder is the kernel composition its Python coder runs on the Rust path, so the
//! stored bytes are the same: `MSECoder` and `MSEQJLCoder` (python/kvqrs/schemes/mse.py),
//! `KIVICoder` (kivi.py), `MatchedCoder` and `MatchedValueCoder` (matched.py),
//! `MatchedTokenCoder` (matched_tokens.py).

use crate::dtype::Dtype;
use crate::error::{KvqError, Result};
use crate::kernels::absmax;
use crate::kernels::log_scalars;
use crate::kernels::mse::MseQuantizer;
use crate::kernels::mse_qjl::MseQjlEncoder;
use crate::kernels::pack::{pack_into, packed_len};
use crate::kernels::uniform::UniformQuantizer;
use crate::scalars::ScalarPlane;
use crate::simd::{self, ops};
use crate::store::{ChunkPart, LayerStore};
use crate::window::gather_tokens;

/// The encoder of one side (keys or values) of a layer store.
#[derive(Debug, Clone)]
pub enum SideEncoder {
    /// `kv` / `kqv`, `matched` values: packed MSE codes and norms (parts `codes`, `norms`;
    /// `norm_exps` too with log-coded norms), optionally around a calibrated mean.
    Mse(MseSide),
    /// `kqv` values, `qkqv`: the MSE stage and the QJL sketch of its residual (parts `codes`,
    /// `norms`, `qjl_signs`, `qjl_norms`).
    MseQjl(MseQjlEncoder),
    /// KIVI values: uniform groups along each token's coordinates (parts `codes`, `scales`,
    /// `zeros`).
    Tokens(UniformQuantizer),
    /// KIVI keys and `matched` transform codes: uniform groups along tokens, per coordinate.
    Channels(ChannelSide),
    /// `matched` keys with per-token scales: each token's transform coordinates over their
    /// calibrated deviations, one float16 absmax scale per token (parts `codes<suffix>` per
    /// run, `scales`).
    TokenRuns(TokenRunSide),
}

/// One encoded part: its name within the side, dtype and C-order bytes.
pub type EncodedPart = (String, Dtype, Vec<u8>);

fn plane_part(name: &str, plane: ScalarPlane) -> EncodedPart {
    match plane {
        ScalarPlane::F16(v) => (
            name.into(),
            Dtype::F16,
            v.iter().flat_map(|h| h.to_le_bytes()).collect(),
        ),
        ScalarPlane::F32(v) => (
            name.into(),
            Dtype::F32,
            v.iter().flat_map(|f| f.to_le_bytes()).collect(),
        ),
    }
}

/// A calibrated mean per KV head (`heads x d`, one head serving all when `heads` is 1),
/// subtracted in float32 before coding, as the Python coders do.
#[derive(Debug, Clone)]
pub struct Centring {
    mean: Vec<f32>,
    head_dim: usize,
}

impl Centring {
    /// Errors unless `mean` holds whole rows of `head_dim` finite values.
    pub fn new(mean: Vec<f32>, head_dim: usize) -> Result<Self> {
        if head_dim == 0 || mean.is_empty() || !mean.len().is_multiple_of(head_dim) {
            return Err(KvqError::ShapeMismatch {
                arg: "mean",
                expected: format!("kv_heads x {head_dim} values"),
                actual: format!("{} values", mean.len()),
            });
        }
        crate::kernels::check_finite("mean", &mean, head_dim)?;
        Ok(Self { mean, head_dim })
    }

    /// Calibrated heads.
    pub fn heads(&self) -> usize {
        self.mean.len() / self.head_dim
    }

    /// `x - mean` for rows in blocks of `tokens` (block `b` is KV head `b % heads` of a
    /// `(batch, kv_heads)` layout whose kv_heads are the calibrated heads, or any with one).
    fn centred(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let d = self.head_dim;
        let mut out = x.to_vec();
        for (b, block) in out.chunks_mut(tokens.max(1) * d).enumerate() {
            let h = b % self.heads();
            let mu = &self.mean[h * d..(h + 1) * d];
            for row in block.chunks_exact_mut(d) {
                row.iter_mut().zip(mu).for_each(|(v, &m)| *v -= m);
            }
        }
        out
    }
}

/// The MSE stage of a side, with an optional calibrated mean and optional 8-bit log norms
/// (`norm_group` tokens per exponent byte).
#[derive(Debug, Clone)]
pub struct MseSide {
    pub mse: MseQuantizer,
    pub mean: Option<Centring>,
    pub norm_group: Option<usize>,
}

impl MseSide {
    fn encode(&self, x: &[f32], tokens: usize) -> Result<Vec<EncodedPart>> {
        let centred = self.mean.as_ref().map(|m| m.centred(x, tokens));
        let (packed, norms) = self.mse.encode_packed(centred.as_deref().unwrap_or(x))?;
        let Some(group) = self.norm_group else {
            return Ok(vec![
                ("codes".into(), Dtype::U8, packed),
                plane_part("norms", norms),
            ]);
        };
        // The log code of the stored (rounded) norms, along each row's tokens.
        let (codes, exps) = log_scalars::encode(&norms.to_f32(), tokens, group)?;
        Ok(vec![
            ("codes".into(), Dtype::U8, packed),
            ("norms".into(), Dtype::U8, codes),
            ("norm_exps".into(), Dtype::U8, exps),
        ])
    }
}

/// A run of coordinates `lo .. hi` coded at `bits` bits, stored as parts `codes<suffix>` (and,
/// in uniform groups, `scales<suffix>`, `zeros<suffix>`).
#[derive(Debug, Clone)]
pub struct ChannelRun {
    pub bits: u32,
    pub lo: usize,
    pub hi: usize,
    pub suffix: String,
}

/// Errors unless every run codes 1 to 8 bits of coordinates `lo < hi <= head_dim`.
fn check_runs(runs: &[ChannelRun], head_dim: usize) -> Result<()> {
    for r in runs {
        crate::kernels::check_bits("bits", r.bits)?;
        if r.lo >= r.hi || r.hi > head_dim {
            return Err(KvqError::ShapeMismatch {
                arg: "runs",
                expected: format!("coordinates lo < hi <= {head_dim}"),
                actual: format!("{} .. {}", r.lo, r.hi),
            });
        }
    }
    Ok(())
}

/// A `matched` calibration's transform `y = (x - mu) U` per KV head: `basis` holds `U`,
/// `heads x d x d`, row-major `U[c][i]`, for the heads of the mean in `centring`.
#[derive(Debug, Clone)]
pub struct Projection {
    centring: Centring,
    basis: Vec<f64>,
}

impl Projection {
    /// Errors on a basis that is not `heads x d x d` for the mean's heads and `head_dim`, or
    /// not finite.
    pub fn new(head_dim: usize, centring: Centring, basis: Vec<f32>) -> Result<Self> {
        let want = centring.heads() * head_dim * head_dim;
        if centring.head_dim != head_dim || basis.len() != want {
            return Err(KvqError::ShapeMismatch {
                arg: "basis",
                expected: format!(
                    "{want} values ({} heads x {head_dim} x {head_dim})",
                    centring.heads()
                ),
                actual: format!("{} values", basis.len()),
            });
        }
        crate::kernels::check_finite("basis", &basis, head_dim)?;
        let basis = basis.iter().map(|&v| f64::from(v)).collect();
        Ok(Self { centring, basis })
    }

    /// Calibrated heads.
    pub fn heads(&self) -> usize {
        self.centring.heads()
    }

    /// `put(block, token, y)` for each row of `x` in blocks of `tokens` (block `b` is KV head
    /// `b % heads`, as [`Centring`]'s), in order: `y_i = sum_c (x_c - mu_c) U[c][i]` in
    /// float64 over `c` in order ([`ops::project_f64`]: the same bits on every SIMD path),
    /// rounded once to float32 (the Python coders' product; a float32 sum would round
    /// differently for 1 and many rows).
    fn each_row(&self, x: &[f32], tokens: usize, mut put: impl FnMut(usize, usize, &[f32])) {
        let (d, isa) = (self.centring.head_dim, simd::active());
        let centred = self.centring.centred(x, tokens);
        let (mut xc, mut y) = (vec![0.0f64; d], vec![0.0f32; d]);
        for (r, row) in centred.chunks_exact(d).enumerate() {
            let b = r / tokens.max(1);
            let u = &self.basis[(b % self.heads()) * d * d..][..d * d];
            xc.iter_mut().zip(row).for_each(|(o, &v)| *o = f64::from(v));
            ops::project_f64(isa, &xc, u, &mut y);
            put(b, r - b * tokens, &y);
        }
    }
}

/// Errors unless `x` holds blocks of `tokens` rows of `d` finite values (none with no tokens).
fn check_blocks(x: &[f32], tokens: usize, d: usize) -> Result<()> {
    if (tokens == 0 && !x.is_empty()) || !x.len().is_multiple_of(d * tokens.max(1)) {
        return Err(KvqError::ShapeMismatch {
            arg: "x",
            expected: format!("blocks of {tokens} tokens x {d}"),
            actual: format!("{} values", x.len()),
        });
    }
    crate::kernels::check_finite("x", x, d)
}

/// Uniform groups of `group` tokens per coordinate: of the channels themselves (KIVI keys), or
/// of `y = (x - mu) U` (`matched`, the [`Projection`] in `transform`). Each run of coordinates
/// is one uniform-kernel call over every (batch, head) block, so its scales take one storage
/// (float16, or float32 for all).
#[derive(Debug, Clone)]
pub struct ChannelSide {
    pub head_dim: usize,
    pub transform: Option<Projection>,
    pub runs: Vec<ChannelRun>,
    pub group: usize,
}

impl ChannelSide {
    /// Errors on a basis that is not `heads x d x d` for the mean's heads, or runs outside
    /// `0 .. head_dim`.
    pub fn new(
        head_dim: usize,
        transform: Option<(Centring, Vec<f32>)>,
        runs: Vec<ChannelRun>,
        group: usize,
    ) -> Result<Self> {
        let transform = transform
            .map(|(c, basis)| Projection::new(head_dim, c, basis))
            .transpose()?;
        check_runs(&runs, head_dim)?;
        crate::kernels::check_row_len("group", group)?;
        Ok(Self {
            head_dim,
            transform,
            runs,
            group,
        })
    }

    /// The coordinates along tokens: `blocks x d x tokens`, of the transform
    /// ([`Projection::each_row`]) or of the channels.
    fn coordinates(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let d = self.head_dim;
        let mut y = vec![0.0f32; x.len()];
        let mut put = |b: usize, t: usize, row: &[f32]| {
            for (i, &v) in row.iter().enumerate() {
                y[b * d * tokens + i * tokens + t] = v;
            }
        };
        match &self.transform {
            Some(p) => p.each_row(x, tokens, put),
            None => {
                for (r, row) in x.chunks_exact(d).enumerate() {
                    put(r / tokens, r % tokens, row);
                }
            }
        }
        y
    }

    fn encode(&self, x: &[f32], tokens: usize) -> Result<Vec<EncodedPart>> {
        let d = self.head_dim;
        check_blocks(x, tokens, d)?;
        // No tokens: the uniform kernel refuses groups of 0 tokens below.
        let blocks = x.len() / (d * tokens.max(1));
        let y = self.coordinates(x, tokens);
        let mut parts = Vec::with_capacity(3 * self.runs.len());
        for r in &self.runs {
            let n = r.hi - r.lo;
            let mut rows = Vec::with_capacity(blocks * n * tokens);
            for b in 0..blocks {
                rows.extend_from_slice(&y[(b * d + r.lo) * tokens..(b * d + r.hi) * tokens]);
            }
            let code = UniformQuantizer::new(tokens, self.group, r.bits)?.encode(&rows)?;
            let mut packed = vec![0u8; blocks * n * packed_len(tokens, r.bits)];
            pack_into(simd::active(), &code.codes, tokens, r.bits, &mut packed)?;
            parts.push((format!("codes{}", r.suffix), Dtype::U8, packed));
            parts.push(plane_part(&format!("scales{}", r.suffix), code.scales));
            parts.push(plane_part(&format!("zeros{}", r.suffix), code.zeros));
        }
        Ok(parts)
    }
}

/// Per-token codes of `y = (x - mu) U` (the [`Projection`]) over the calibrated deviations
/// `sigma` (`heads x d`, positive): `z_i = y_i / sigma_i` in float32, then the absmax kernel
/// (one float16 scale per token over the coded coordinates, [`absmax::encode`]) with each
/// coordinate's width that of its run (0 outside the runs), each run's codes packed per token.
/// Parts, one entry per token: `codes<suffix>` per run (`packed_len(hi - lo, bits)` bytes),
/// then `scales` (float16).
#[derive(Debug, Clone)]
pub struct TokenRunSide {
    projection: Projection,
    deviations: Vec<f32>,
    widths: Vec<u8>,
    runs: Vec<ChannelRun>,
}

impl TokenRunSide {
    /// Errors on a basis or deviations not of the mean's heads and `head_dim`, deviations
    /// that are not positive and finite, runs outside `0 .. head_dim` or overlapping.
    pub fn new(
        head_dim: usize,
        (centring, basis): (Centring, Vec<f32>),
        deviations: Vec<f32>,
        runs: Vec<ChannelRun>,
    ) -> Result<Self> {
        let projection = Projection::new(head_dim, centring, basis)?;
        let heads = projection.heads();
        crate::kernels::check_len(
            "deviations",
            deviations.len(),
            heads * head_dim,
            &format!("{heads} heads x {head_dim}"),
        )?;
        if let Some(i) = deviations.iter().position(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(KvqError::InvalidValue {
                arg: "deviations",
                expected: "positive finite deviations",
                value: f64::from(deviations[i]),
            });
        }
        check_runs(&runs, head_dim)?;
        let mut widths = vec![0u8; head_dim];
        for r in &runs {
            let span = &mut widths[r.lo..r.hi];
            if span.iter().any(|&w| w != 0) {
                return Err(KvqError::ShapeMismatch {
                    arg: "runs",
                    expected: "runs of distinct coordinates".into(),
                    actual: format!("{} .. {} overlapping another run", r.lo, r.hi),
                });
            }
            span.fill(r.bits as u8);
        }
        Ok(Self {
            projection,
            deviations,
            widths,
            runs,
        })
    }

    fn encode(&self, x: &[f32], tokens: usize) -> Result<Vec<EncodedPart>> {
        let d = self.widths.len();
        check_blocks(x, tokens, d)?;
        let mut z = vec![0.0f32; x.len()];
        self.projection.each_row(x, tokens, |b, t, y| {
            let sigma = &self.deviations[(b % self.projection.heads()) * d..][..d];
            let out = &mut z[(b * tokens + t) * d..][..d];
            for ((o, &v), &s) in out.iter_mut().zip(y).zip(sigma) {
                *o = v / s;
            }
        });
        let code = absmax::encode(&z, &self.widths)?;
        let rows = x.len() / d;
        let mut parts = Vec::with_capacity(self.runs.len() + 1);
        for r in &self.runs {
            let n = r.hi - r.lo;
            let run: Vec<u8> = code
                .codes
                .chunks_exact(d)
                .flat_map(|row| &row[r.lo..r.hi])
                .copied()
                .collect();
            let mut packed = vec![0u8; rows * packed_len(n, r.bits)];
            pack_into(simd::active(), &run, n, r.bits, &mut packed)?;
            parts.push((format!("codes{}", r.suffix), Dtype::U8, packed));
        }
        let scales = code.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        parts.push(("scales".into(), Dtype::F16, scales));
        Ok(parts)
    }
}

impl SideEncoder {
    /// Encodes rows of head_dim values, `(batch, kv_heads, tokens, head_dim)` in C order;
    /// returns the side's parts, in its layout's order. Errors as the kernels.
    pub fn encode(&self, x: &[f32], tokens: usize) -> Result<Vec<EncodedPart>> {
        Ok(match self {
            SideEncoder::Mse(m) => m.encode(x, tokens)?,
            SideEncoder::MseQjl(e) => {
                let c = e.encode(x)?;
                vec![
                    ("codes".into(), Dtype::U8, c.packed),
                    plane_part("norms", c.norms),
                    ("qjl_signs".into(), Dtype::U8, c.sketch.signs),
                    plane_part("qjl_norms", c.sketch.norms),
                ]
            }
            SideEncoder::Tokens(u) => {
                let c = u.encode(x)?;
                let (n, bits) = (u.row_len(), u.bits());
                let mut packed = vec![0u8; c.codes.len() / n.max(1) * packed_len(n, bits)];
                pack_into(simd::active(), &c.codes, n, bits, &mut packed)?;
                vec![
                    ("codes".into(), Dtype::U8, packed),
                    plane_part("scales", c.scales),
                    plane_part("zeros", c.zeros),
                ]
            }
            SideEncoder::Channels(c) => c.encode(x, tokens)?,
            SideEncoder::TokenRuns(t) => t.encode(x, tokens)?,
        })
    }
}

/// Tokens encoded per call of a long flush (rounded to whole groups of every part): a long
/// prompt's temporaries (float32 copies, centred and rotated rows, unpacked codes) then stay
/// a few MiB, where encoding 16k tokens of one layer at once made about 100 MiB of them.
const ENCODE_CHUNK: usize = 1024;

/// Tokens `lo .. lo + n` of every (batch, head) row of a token buffer `src`: rows of `cap`
/// tokens of `d` values (a cache's full-precision window, read in place).
#[derive(Debug, Clone, Copy)]
pub struct TokenRows<'a> {
    pub src: &'a [f32],
    pub cap: usize,
    pub lo: usize,
    pub d: usize,
}

impl TokenRows<'_> {
    /// Tokens `lo + from .. lo + from + n` of every row, contiguous.
    fn gather(&self, from: usize, n: usize) -> Result<Vec<f32>> {
        let rows = self.src.len() / (self.cap * self.d).max(1);
        gather_tokens(self.src, (self.cap, self.lo + from, n), (rows, self.d))
    }
}

impl LayerStore {
    /// [`LayerStore::encode_append`] of `tokens` tokens read from token buffers: encoded in
    /// chunks of about [`ENCODE_CHUNK`] tokens (whole groups of every part), so a long prompt
    /// makes no temporaries of its own size. An error leaves the store as it was (the chunks
    /// already appended are cut off again).
    pub fn encode_append_rows(
        &mut self,
        (ke, k): (&SideEncoder, TokenRows),
        (ve, v): (&SideEncoder, TokenRows),
        tokens: usize,
    ) -> Result<()> {
        let held = self.tokens();
        let align = (1..=tokens.max(1))
            .find(|&a| self.specs().all(|s| s.aligned(a)))
            .unwrap_or(tokens.max(1));
        // Chunks only where a cut after them is possible (else, one call).
        let step = if self.specs().all(|s| s.aligned(held)) {
            ENCODE_CHUNK.div_ceil(align) * align
        } else {
            tokens.max(1)
        };
        if step < tokens {
            self.reserve(tokens);
        }
        let mut done = 0;
        while done < tokens {
            let n = step.min(tokens - done);
            let res = k.gather(done, n).and_then(|kx| {
                let vx = v.gather(done, n)?;
                self.encode_append((ke, &kx), (ve, &vx), n)
            });
            if let Err(e) = res {
                if done > 0 {
                    self.keep(0, held)?;
                }
                return Err(e);
            }
            done += n;
        }
        Ok(())
    }

    /// Encodes `tokens` new tokens of every (batch, head) row, keys `k` and values `v`
    /// (`(batch, kv_heads, tokens, head_dim)` float32, C order), and appends their codes: the
    /// store's parts must be `keys.<part>` and `values.<part>` of the two encoders, one entry
    /// per token. Both sides are encoded before anything is stored, so an error (non-finite
    /// rows, a norm beyond float32, parts that do not match) leaves the store unchanged.
    pub fn encode_append(
        &mut self,
        keys: (&SideEncoder, &[f32]),
        values: (&SideEncoder, &[f32]),
        tokens: usize,
    ) -> Result<()> {
        // (side, part name, dtype, bytes): a store part is named `{side}.{name}`, matched
        // without building the names (this runs once per decode step and layer).
        let mut named: Vec<(&str, EncodedPart)> = Vec::new();
        for (side, (enc, x)) in [("keys", keys), ("values", values)] {
            named.extend(enc.encode(x, tokens)?.into_iter().map(|p| (side, p)));
        }
        let is = |full: &str, side: &str, name: &str| {
            full.strip_prefix(side)
                .and_then(|r| r.strip_prefix('.'))
                .is_some_and(|r| r == name)
        };
        let shapes: Vec<Vec<usize>> = self.specs().map(|s| s.shape(tokens)).collect();
        let mut chunk = Vec::with_capacity(shapes.len());
        for (spec, shape) in self.specs().zip(&shapes) {
            let part = named
                .iter()
                .find(|(side, (n, _, _))| is(&spec.name, side, n))
                .ok_or_else(|| KvqError::ShapeMismatch {
                    arg: "encoders",
                    expected: format!("a part {}", spec.name),
                    actual: named
                        .iter()
                        .map(|(side, p)| format!("{side}.{}", p.0))
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
            chunk.push(ChunkPart {
                dtype: part.1 .1,
                shape,
                bytes: &part.1 .2,
            });
        }
        if named.len() != chunk.len() {
            return Err(KvqError::ShapeMismatch {
                arg: "encoders",
                expected: format!("{} parts", chunk.len()),
                actual: format!("{}", named.len()),
            });
        }
        self.append(&chunk, tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::hadamard::padded_dim;
    use crate::store::PartSpec;

    fn spec(name: &str, dtype: Dtype, widen: bool, inner: Vec<usize>) -> PartSpec {
        PartSpec {
            name: name.into(),
            dtype,
            widen,
            outer: vec![2, 3],
            inner,
            num: 1,
            den: 1,
        }
    }

    fn kqv_store(d: usize, kbits: u32, vbits: u32) -> LayerStore {
        let cd = padded_dim(d);
        LayerStore::new(vec![
            spec(
                "keys.codes",
                Dtype::U8,
                false,
                vec![cd * kbits as usize / 8],
            ),
            spec("keys.norms", Dtype::F16, true, vec![]),
            spec(
                "values.codes",
                Dtype::U8,
                false,
                vec![cd * (vbits - 1) as usize / 8],
            ),
            spec("values.norms", Dtype::F16, true, vec![]),
            spec("values.qjl_signs", Dtype::U8, false, vec![cd / 8]),
            spec("values.qjl_norms", Dtype::F16, true, vec![]),
        ])
        .unwrap()
    }

    fn rows(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    /// The token-major chunk of `t` tokens from rows ordered (batch, head, token).
    fn encode_then_append(
        store: &mut LayerStore,
        k: &SideEncoder,
        v: &SideEncoder,
        kx: &[f32],
        vx: &[f32],
        t: usize,
    ) {
        let mut parts = k.encode(kx, t).unwrap();
        parts.extend(v.encode(vx, t).unwrap());
        let shapes: Vec<Vec<usize>> = store.specs().map(|s| s.shape(t)).collect();
        let chunk: Vec<ChunkPart> = parts
            .iter()
            .zip(&shapes)
            .map(|((_, dtype, bytes), shape)| ChunkPart {
                dtype: *dtype,
                shape,
                bytes,
            })
            .collect();
        store.append(&chunk, t).unwrap();
    }

    #[test]
    fn encode_append_equals_encoding_then_appending() {
        let d = 64;
        let k = SideEncoder::Mse(MseSide {
            mse: MseQuantizer::new(d, 4, Some(5)).unwrap(),
            mean: None,
            norm_group: None,
        });
        let v = SideEncoder::MseQjl(MseQjlEncoder::new(d, 4, 6, 7).unwrap());
        let (mut a, mut b) = (kqv_store(d, 4, 4), kqv_store(d, 4, 4));
        for (step, t) in [3usize, 1, 1, 4].into_iter().enumerate() {
            let (kx, vx) = (
                rows(6 * t * d, step as u32),
                rows(6 * t * d, 99 + step as u32),
            );
            a.encode_append((&k, &kx), (&v, &vx), t).unwrap();
            encode_then_append(&mut b, &k, &v, &kx, &vx, t);
        }
        assert_eq!(a.tokens(), 9);
        for i in 0..6 {
            assert_eq!(a.part(i), b.part(i));
        }
    }

    #[test]
    fn a_failed_encode_stores_nothing() {
        let d = 64;
        let k = SideEncoder::Mse(MseSide {
            mse: MseQuantizer::new(d, 4, Some(5)).unwrap(),
            mean: None,
            norm_group: None,
        });
        let v = SideEncoder::MseQjl(MseQjlEncoder::new(d, 4, 6, 7).unwrap());
        let mut store = kqv_store(d, 4, 4);
        let kx = rows(6 * d, 1);
        let mut vx = rows(6 * d, 2);
        vx[70] = f32::NAN;
        assert!(store.encode_append((&k, &kx), (&v, &vx), 1).is_err());
        assert_eq!(store.tokens(), 0);
        // Keys and values swapped: the parts do not match the store's.
        assert!(store.encode_append((&v, &kx), (&k, &kx), 1).is_err());
        assert_eq!(store.tokens(), 0);
    }

    /// A key side of 8-bit log norms, one exponent byte per `group` tokens.
    fn log_norm_store(d: usize, group: usize) -> (LayerStore, SideEncoder, SideEncoder) {
        let k = SideEncoder::Mse(MseSide {
            mse: MseQuantizer::new(d, 4, Some(5)).unwrap(),
            mean: None,
            norm_group: Some(group),
        });
        let v = SideEncoder::MseQjl(MseQjlEncoder::new(d, 4, 6, 7).unwrap());
        let cd = padded_dim(d);
        let mut specs = vec![
            spec("keys.codes", Dtype::U8, false, vec![cd / 2]),
            spec("keys.norms", Dtype::U8, false, vec![]),
            spec("keys.norm_exps", Dtype::U8, false, vec![]),
        ];
        specs[2].den = group;
        specs.extend(kqv_store(d, 4, 4).specs().skip(2).cloned());
        (LayerStore::new(specs).unwrap(), k, v)
    }

    #[test]
    fn a_long_window_is_encoded_in_chunks_as_in_one_call() {
        // 2,560 tokens read from buffers of 2,600 tokens per row from token 17: three chunks
        // of whole exponent groups, the same bytes as one encode of the gathered tokens.
        let (d, t, cap, lo, group) = (64, 2560, 2600, 17, 256);
        let (mut a, k, v) = log_norm_store(d, group);
        let (mut b, _, _) = log_norm_store(d, group);
        let (kb, vb) = (rows(6 * cap * d, 1), rows(6 * cap * d, 2));
        let window = |src| TokenRows { src, cap, lo, d };
        a.encode_append_rows((&k, window(&kb)), (&v, window(&vb)), t)
            .unwrap();
        let gather = |src: &[f32]| gather_tokens(src, (cap, lo, t), (6, d)).unwrap();
        b.encode_append((&k, &gather(&kb)), (&v, &gather(&vb)), t)
            .unwrap();
        assert_eq!(a.tokens(), t);
        for i in 0..a.specs().count() {
            assert_eq!(a.part(i), b.part(i), "part {i}");
        }
        // A value the last chunk refuses leaves the store as it was.
        let mut bad = vb.clone();
        bad[(5 * cap + lo + t - 3) * d] = f32::NAN;
        let err = a.encode_append_rows((&k, window(&kb)), (&v, window(&bad)), t);
        assert!(err.is_err());
        assert_eq!(a.tokens(), t);
        for i in 0..a.specs().count() {
            assert_eq!(a.part(i), b.part(i), "part {i} after the refused append");
        }
    }

    fn run(bits: u32, lo: usize, hi: usize, suffix: &str) -> ChannelRun {
        ChannelRun {
            bits,
            lo,
            hi,
            suffix: suffix.into(),
        }
    }

    #[test]
    fn channel_runs_under_the_identity_code_the_channels() {
        // An identity basis around a zero mean: two runs of half the channels each hold, per
        // (batch, head) block, the halves of the per-channel (KIVI key) codes.
        let (d, t, blocks) = (8, 16, 3);
        let x = rows(blocks * t * d, 3);
        let kivi = ChannelSide::new(d, None, vec![run(4, 0, d, "")], 8).unwrap();
        let mut eye = vec![0.0f32; d * d];
        (0..d).for_each(|i| eye[i * d + i] = 1.0);
        let mean = Centring::new(vec![0.0; d], d).unwrap();
        let runs = vec![run(4, 0, 4, "a"), run(4, 4, d, "b")];
        let ident = ChannelSide::new(d, Some((mean, eye)), runs, 8).unwrap();
        let (whole, halves) = (kivi.encode(&x, t).unwrap(), ident.encode(&x, t).unwrap());
        assert_eq!(
            halves.iter().map(|p| p.0.as_str()).collect::<Vec<_>>(),
            ["codesa", "scalesa", "zerosa", "codesb", "scalesb", "zerosb"]
        );
        for (part, per_row) in [(0, t / 2), (1, 2 * 2), (2, 2 * 2)] {
            let (a, b) = (&halves[part].2, &halves[part + 3].2);
            for blk in 0..blocks {
                let row = &whole[part].2[blk * d * per_row..(blk + 1) * d * per_row];
                let half = d / 2 * per_row;
                assert_eq!(&row[..half], &a[blk * half..(blk + 1) * half]);
                assert_eq!(&row[half..], &b[blk * half..(blk + 1) * half]);
            }
        }
        // A basis of the wrong size and a run past head_dim are refused.
        let mean = Centring::new(vec![0.0; d], d).unwrap();
        assert!(
            ChannelSide::new(d, Some((mean, vec![0.0; d])), vec![run(4, 0, d, "")], 8).is_err()
        );
        assert!(ChannelSide::new(d, None, vec![run(4, 0, d + 1, "")], 8).is_err());
        assert!(kivi.encode(&x[..d * t - 1], t).is_err());
    }

    #[test]
    fn token_runs_under_the_identity_are_the_absmax_codes_of_the_scaled_channels() {
        // An identity basis around a zero mean, two heads of deviations 1 and 2: each token's
        // codes are the absmax kernel's of x / sigma of its block's head, each run packed per
        // token; coordinates 6, 7 (width 0) store nothing.
        let (d, t, blocks) = (8, 5, 4);
        let x = rows(blocks * t * d, 5);
        let mut eye = vec![0.0f32; 2 * d * d];
        (0..2 * d).for_each(|i| eye[i * d + i % d] = 1.0);
        let sigma: Vec<f32> = (0..2 * d).map(|i| if i < d { 1.0 } else { 2.0 }).collect();
        let runs = vec![run(4, 0, 2, "4"), run(3, 2, 6, "3")];
        let mean = Centring::new(vec![0.0; 2 * d], d).unwrap();
        let side = TokenRunSide::new(d, (mean, eye.clone()), sigma.clone(), runs).unwrap();
        let parts = side.encode(&x, t).unwrap();
        assert_eq!(
            parts
                .iter()
                .map(|p| (p.0.as_str(), p.1))
                .collect::<Vec<_>>(),
            [
                ("codes4", Dtype::U8),
                ("codes3", Dtype::U8),
                ("scales", Dtype::F16)
            ]
        );
        let z: Vec<f32> = x
            .chunks_exact(t * d)
            .enumerate()
            .flat_map(|(b, blk)| {
                blk.iter()
                    .map(move |&v| v / if b % 2 == 0 { 1.0 } else { 2.0 })
            })
            .collect();
        let want = absmax::encode(&z, &[4, 4, 3, 3, 3, 3, 0, 0]).unwrap();
        let pick = |lo: usize, hi: usize| -> Vec<u8> {
            want.codes
                .chunks_exact(d)
                .flat_map(|r| r[lo..hi].to_vec())
                .collect()
        };
        assert_eq!(
            parts[0].2,
            crate::kernels::pack::pack(&pick(0, 2), 2, 4).unwrap()
        );
        assert_eq!(
            parts[1].2,
            crate::kernels::pack::pack(&pick(2, 6), 4, 3).unwrap()
        );
        let scales: Vec<u8> = want.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        assert_eq!(parts[2].2, scales);
        // No tokens: empty parts of the same names.
        let none = side.encode(&[], 0).unwrap();
        assert!(none.len() == 3 && none.iter().all(|p| p.2.is_empty()));
        // A scale past float16, non-finite input and malformed tables are errors.
        let mut big = x.clone();
        big[3] = 1e6;
        assert!(matches!(
            side.encode(&big, t),
            Err(KvqError::ScaleOverflow { row: 0, .. })
        ));
        big[3] = f32::NAN;
        assert!(matches!(
            side.encode(&big, t),
            Err(KvqError::NonFinite { .. })
        ));
        assert!(side.encode(&x[..d * t - 1], t).is_err());
        let table = |sigma: Vec<f32>, runs| {
            let mean = Centring::new(vec![0.0; 2 * d], d).unwrap();
            TokenRunSide::new(d, (mean, eye.clone()), sigma, runs)
        };
        assert!(table(sigma.clone(), vec![run(4, 0, 2, "4")]).is_ok());
        assert!(table(sigma[..d].to_vec(), vec![run(4, 0, 2, "4")]).is_err());
        assert!(table(vec![0.0; 2 * d], vec![run(4, 0, 2, "4")]).is_err());
        assert!(table(sigma.clone(), vec![run(4, 0, 3, "4"), run(3, 2, 4, "3")]).is_err());
        assert!(table(sigma, vec![run(9, 0, 2, "9")]).is_err());
    }
}
