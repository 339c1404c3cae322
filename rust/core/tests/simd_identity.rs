//! Every kernel on every instruction set this CPU supports must return the scalar reference's
//! bytes exactly: codes, packed bytes, stored norms and scales, floats (compared as bits), and
//! the same errors. Also: results do not depend on the rayon thread count.

use kvqrs_core::kernels::attention::{
    decode_attention_with, Attention, AttentionShape, ChannelRun, CodedRows, QjlRows, SideRows,
    TokenRunView,
};
use kvqrs_core::kernels::hadamard::{padded_dim, Rotation};
use kvqrs_core::kernels::headq::HeadqCoder;
use kvqrs_core::kernels::lloyd_max::codebook;
use kvqrs_core::kernels::mse::{MseQuantizer, RowScale};
use kvqrs_core::kernels::pack::{pack_with, packed_len, unpack_with};
use kvqrs_core::kernels::qjl::QjlSketcher;
use kvqrs_core::rng::{gaussians, random_orthonormal_basis};
use kvqrs_core::scalars::{FloatView, ScalarView};
use kvqrs_core::Isa;
use proptest::prelude::*;

/// The head_dims of the Python suite (tests/strategies.py) plus the small and odd ones.
const HEAD_DIMS: [usize; 15] = [40, 64, 80, 96, 112, 128, 160, 192, 256, 2, 3, 5, 8, 17, 33];

fn simd_isas() -> Vec<Isa> {
    Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
        .collect()
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Deterministic test rows mixing scales: Gaussian rows, rows scaled to 1e30 and 1e-30
/// (subnormal products), zero rows, one-hot rows and rows of repeated values.
fn mixed_rows(seed: u64, rows: usize, d: usize) -> Vec<f32> {
    let g = gaussians(seed, 7, rows * d);
    let mut x = Vec::with_capacity(rows * d);
    for r in 0..rows {
        let row = &g[r * d..(r + 1) * d];
        match r % 7 {
            0 | 1 => x.extend_from_slice(row),
            2 => x.extend(row.iter().map(|v| v * 1e30)),
            3 => x.extend(row.iter().map(|v| v * 1e-30)),
            4 => x.extend(std::iter::repeat_n(0.0, d)),
            5 => x.extend((0..d).map(|i| if i == r % d { -3.5 } else { 0.0 })),
            _ => x.extend(std::iter::repeat_n(0.25, d)),
        }
    }
    x
}

#[test]
fn rotation_is_bit_identical_on_every_isa() {
    for &d in &HEAD_DIMS {
        for seed in [None, Some(5u64)] {
            let reference = Rotation::new(d, seed)
                .unwrap()
                .with_isa(Isa::Scalar)
                .unwrap();
            let x = mixed_rows(d as u64, 9, d);
            let y = reference.forward(&x).unwrap();
            let back = reference.inverse(&y).unwrap();
            for isa in simd_isas() {
                let rot = Rotation::new(d, seed).unwrap().with_isa(isa).unwrap();
                assert_eq!(
                    bits_of(&rot.forward(&x).unwrap()),
                    bits_of(&y),
                    "{isa:?} d={d}"
                );
                assert_eq!(
                    bits_of(&rot.inverse(&y).unwrap()),
                    bits_of(&back),
                    "{isa:?} d={d}"
                );
            }
        }
    }
}

#[test]
fn mse_codes_norms_and_decode_are_bit_identical() {
    for &d in &HEAD_DIMS {
        let x = mixed_rows(100 + d as u64, 14, d);
        for bits in 1..=8 {
            for seed in [Some(3u64), None] {
                let reference = MseQuantizer::new(d, bits, seed)
                    .unwrap()
                    .with_isa(Isa::Scalar)
                    .unwrap();
                let c = reference.encode(&x).unwrap();
                let xh = reference.decode(&c).unwrap();
                for isa in simd_isas() {
                    let q = MseQuantizer::new(d, bits, seed)
                        .unwrap()
                        .with_isa(isa)
                        .unwrap();
                    let ci = q.encode(&x).unwrap();
                    assert_eq!(ci, c, "{isa:?} d={d} bits={bits} seed={seed:?}");
                    for mode in [RowScale::LeastSquares, RowScale::PreserveNorm] {
                        assert_eq!(
                            q.clone().with_scale(mode).encode(&x).unwrap(),
                            reference.clone().with_scale(mode).encode(&x).unwrap(),
                            "{mode:?} {isa:?} d={d} bits={bits} seed={seed:?}"
                        );
                    }
                    assert_eq!(
                        bits_of(&q.decode(&c).unwrap()),
                        bits_of(&xh),
                        "{isa:?} d={d} bits={bits}"
                    );
                }
            }
        }
    }
}

/// The fused packed encoder and decoder equal pack(encode) and decode(unpack) on every path,
/// scalar included, for every width (rows that end mid-byte included).
#[test]
fn packed_mse_equals_pack_of_codes_on_every_isa() {
    for &d in &HEAD_DIMS {
        let x = mixed_rows(200 + d as u64, 11, d);
        for bits in 1..=8 {
            for seed in [Some(9u64), None] {
                for isa in Isa::available() {
                    let q = MseQuantizer::new(d, bits, seed)
                        .unwrap()
                        .with_isa(isa)
                        .unwrap();
                    let c = q.encode(&x).unwrap();
                    let cd = q.code_dim();
                    let (packed, norms) = q.encode_packed(&x).unwrap();
                    assert_eq!(
                        packed,
                        pack_with(Isa::Scalar, &c.codes, cd, bits).unwrap(),
                        "{isa:?} d={d} bits={bits}"
                    );
                    assert_eq!(norms, c.norms, "{isa:?} d={d} bits={bits}");
                    let xh = q.decode_packed(&packed, norms.view()).unwrap();
                    assert_eq!(
                        bits_of(&xh),
                        bits_of(&q.decode(&c).unwrap()),
                        "{isa:?} d={d} bits={bits}"
                    );
                }
            }
        }
    }
}

#[test]
fn values_on_the_boundaries_encode_identically() {
    // Every float32 boundary, its neighbours one ulp away, +-0 and values beyond +-1.
    for bits in 1..=8 {
        let cb = codebook(128, bits).unwrap();
        let mut x = vec![0.0f32, -0.0, 1.5, -1.5, 1e-40, -1e-40];
        for &b in &cb.boundaries_f32 {
            x.extend([
                b,
                f32::from_bits(b.to_bits() + 1),
                f32::from_bits(b.to_bits().wrapping_sub(1)),
                -b,
            ]);
        }
        let mut want = vec![0u8; x.len()];
        cb.encode_into_with(Isa::Scalar, &x, &mut want).unwrap();
        let mut back = vec![0.0f32; x.len()];
        cb.decode_into_with(Isa::Scalar, &want, &mut back).unwrap();
        for isa in simd_isas() {
            let mut got = vec![0u8; x.len()];
            cb.encode_into_with(isa, &x, &mut got).unwrap();
            assert_eq!(got, want, "{isa:?} bits={bits}");
            let mut dec = vec![0.0f32; x.len()];
            cb.decode_into_with(isa, &want, &mut dec).unwrap();
            assert_eq!(bits_of(&dec), bits_of(&back), "{isa:?} bits={bits}");
        }
    }
}

#[test]
fn errors_are_the_same_on_every_isa() {
    let d = 96;
    let mut x = mixed_rows(1, 6, d);
    x[3 * d + 7] = f32::NAN;
    let mut big = vec![1.0f32; 4 * d];
    big[2 * d..3 * d].fill(3e38); // finite, but the norm overflows float32
    for bits in [2u32, 4] {
        let reference = MseQuantizer::new(d, bits, Some(1))
            .unwrap()
            .with_isa(Isa::Scalar)
            .unwrap();
        let rot = Rotation::new(d, Some(1))
            .unwrap()
            .with_isa(Isa::Scalar)
            .unwrap();
        for isa in simd_isas() {
            let q = MseQuantizer::new(d, bits, Some(1))
                .unwrap()
                .with_isa(isa)
                .unwrap();
            // Compared as messages: the NaN inside NonFinite is never equal to itself.
            let msg = |e: kvqrs_core::KvqError| e.to_string();
            assert_eq!(
                msg(q.encode(&x).unwrap_err()),
                msg(reference.encode(&x).unwrap_err())
            );
            assert_eq!(
                msg(q.encode(&big).unwrap_err()),
                msg(reference.encode(&big).unwrap_err())
            );
            let r = Rotation::new(d, Some(1)).unwrap().with_isa(isa).unwrap();
            assert_eq!(
                msg(r.forward(&x).unwrap_err()),
                msg(rot.forward(&x).unwrap_err())
            );
            assert_eq!(
                msg(r.forward(&big).unwrap_err()),
                msg(rot.forward(&big).unwrap_err())
            );
        }
    }
}

#[test]
fn qjl_and_headq_are_bit_identical() {
    for &d in &HEAD_DIMS {
        let r = mixed_rows(200 + d as u64, 7, d);
        let y = gaussians(300 + d as u64, 9, 3 * d);
        for m in [d, 2 * d + 3] {
            let reference = QjlSketcher::new(d, m, 11)
                .unwrap()
                .with_isa(Isa::Scalar)
                .unwrap();
            let sk = reference.sketch(&r).unwrap();
            assert_eq!(sk.signs.len(), 7 * packed_len(m, 1));
            let ip = reference.inner_product(&y, &sk).unwrap();
            let ve = reference.vector_estimate(&sk).unwrap();
            for isa in simd_isas() {
                let q = QjlSketcher::new(d, m, 11).unwrap().with_isa(isa).unwrap();
                assert_eq!(q.sketch(&r).unwrap(), sk, "{isa:?} d={d} m={m}");
                assert_eq!(bits_of(&q.inner_product(&y, &sk).unwrap()), bits_of(&ip));
                assert_eq!(bits_of(&q.vector_estimate(&sk).unwrap()), bits_of(&ve));
            }
        }
        for rank in [1, 4.min(d), 9.min(d), d.min(17)] {
            let u = random_orthonormal_basis(4, d, rank).unwrap();
            for bits in [1u32, 2, 8] {
                let reference = HeadqCoder::new(&u, d, rank, bits)
                    .unwrap()
                    .with_isa(Isa::Scalar)
                    .unwrap();
                let c = reference.encode(&r).unwrap();
                let corr = reference.score_correction(&y, &c).unwrap();
                for isa in simd_isas() {
                    let h = HeadqCoder::new(&u, d, rank, bits)
                        .unwrap()
                        .with_isa(isa)
                        .unwrap();
                    assert_eq!(
                        h.encode(&r).unwrap(),
                        c,
                        "{isa:?} d={d} rank={rank} bits={bits}"
                    );
                    assert_eq!(
                        bits_of(&h.score_correction(&y, &c).unwrap()),
                        bits_of(&corr)
                    );
                }
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    // Large enough to be split over threads (above the single-thread threshold).
    let (d, rows) = (128, 6000); // 768 k floats per MSE call: above par::PAR_MIN_WORK (2^19)
    let x = mixed_rows(9, rows, d);
    let q = MseQuantizer::new(d, 4, Some(2)).unwrap();
    let sk = QjlSketcher::new(d, d, 3).unwrap();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let c = q.encode(&x).unwrap();
            let dec = bits_of(&q.decode(&c).unwrap());
            let packed = kvqrs_core::kernels::pack::pack(&c.codes, 128, 4).unwrap();
            let s = sk.sketch(&x).unwrap();
            let ve = bits_of(&sk.vector_estimate(&s).unwrap());
            let mut bad = x.clone();
            bad[(rows - 5) * d + 3] = f32::INFINITY;
            let err = q.encode(&bad).unwrap_err().to_string();
            (c, dec, packed, s, ve, err)
        })
    };
    let one = run(1);
    for threads in [2, 3, 4] {
        assert!(run(threads) == one, "{threads} threads differ from one");
    }
}

/// Pseudo-random bytes: valid packed codes of any width.
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    (0..n as u64)
        .map(|i| ((seed ^ i).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect()
}

/// Positive float16 bit patterns (norms, scales) in [0.5, 2); `neg` sets the sign (zeros).
fn halves(seed: u64, n: usize, neg: bool) -> Vec<u16> {
    bytes(seed, n)
        .iter()
        .map(|&b| 0x3800 + u16::from(b) * 4 + if neg && b % 2 == 1 { 0x8000 } else { 0 })
        .collect()
}

/// Stored parts of one side of a cache for the fused attention identity test.
struct Stored {
    codes: Vec<u8>,
    scalars: Vec<u16>,
    zeros: Vec<u16>,
    signs: Vec<u8>,
    qjl_norms: Vec<u16>,
    dense: Vec<f32>,
}

impl Stored {
    fn new(seed: u64, heads: usize, t: usize, d: usize) -> Self {
        let n = heads * t * 256;
        Self {
            codes: bytes(seed, n),
            scalars: halves(seed + 1, n, false),
            zeros: halves(seed + 2, n, true),
            signs: bytes(seed + 3, n),
            qjl_norms: halves(seed + 4, n, false),
            dense: mixed_rows(seed + 5, heads * t, d),
        }
    }

    /// Codes, scales and zero points of `ch` channels of `t` tokens in per-channel groups.
    fn channels(
        &self,
        ch: usize,
        t: usize,
        bits: u32,
        group: usize,
    ) -> (&[u8], ScalarView<'_>, ScalarView<'_>) {
        let groups = ch * t.div_ceil(group);
        (
            &self.codes[..ch * packed_len(t, bits)],
            ScalarView::Float(FloatView::F16(&self.scalars[..groups])),
            ScalarView::Float(FloatView::F16(&self.zeros[..groups])),
        )
    }

    /// The layouts of one side: MSE (no rotation; rotated; rotated with a QJL residual),
    /// uniform groups along tokens (plain, rotated), per-channel groups, dense rows.
    fn layouts(&self, h: usize, t: usize, d: usize, bits: u32, group: usize) -> Vec<CodedRows<'_>> {
        let v = h * t;
        let mse = |n: usize, seed: Option<u64>, qjl: bool| CodedRows::Mse {
            codes: &self.codes[..v * packed_len(n, bits)],
            norms: ScalarView::Float(FloatView::F16(&self.scalars[..v])),
            bits,
            seed,
            qjl: qjl.then_some(QjlRows {
                signs: &self.signs[..v * n.div_ceil(8)],
                norms: ScalarView::Float(FloatView::F16(&self.qjl_norms[..v])),
                seed: 9,
            }),
        };
        let tokens = |n: usize, seed: Option<u64>| CodedRows::UniformTokens {
            codes: &self.codes[..v * packed_len(n, bits)],
            scales: ScalarView::Float(FloatView::F16(&self.scalars[..v * n.div_ceil(group)])),
            zeros: ScalarView::Float(FloatView::F16(&self.zeros[..v * n.div_ceil(group)])),
            bits,
            group,
            seed,
        };
        let cd = padded_dim(d);
        let (codes, scales, zeros) = self.channels(h * d, t, bits, group);
        vec![
            mse(d, None, false),
            mse(cd, Some(3), false),
            mse(cd, Some(3), true),
            tokens(d, None),
            tokens(cd, Some(4)),
            CodedRows::UniformChannels {
                codes,
                scales,
                zeros,
                bits,
                group,
            },
            CodedRows::Dense(&self.dense[..v * d]),
        ]
    }
}

fn attention_bits(a: &Attention) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    (bits_of(&a.out), bits_of(&a.lse), bits_of(&a.probs))
}

/// Asserts that decode attention of `keys` (with `side`) and `values` gives the scalar path's
/// bits on every SIMD path and on pools of 1 and 3 threads (`what` names the case).
fn assert_attention_identical(
    (q, lay): (&[f32], &AttentionShape),
    keys: &CodedRows,
    side: Option<&SideRows>,
    values: &CodedRows,
    what: &str,
) {
    let run = |isa: Isa| {
        decode_attention_with(isa, q, lay, keys, side, values, true).map(|a| attention_bits(&a))
    };
    let want = run(Isa::Scalar).unwrap();
    for isa in simd_isas() {
        assert!(run(isa).unwrap() == want, "{isa:?} {what}");
    }
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let got = pool.install(|| run(Isa::best()).unwrap());
        assert!(got == want, "{threads} threads {what}");
    }
}

#[test]
fn fused_attention_is_bit_identical_on_every_isa_and_thread_count() {
    // Token counts below, at and across the float32 accumulation block (32) and the chunk of
    // tokens per task (256); head_dims with
    // vector tails and rotation padding; GQA groups of 1, 3 and 5 query rows.
    for (d, t, rows, bits, group) in [
        (64, 37, 3, 4, 32),
        (40, 100, 1, 3, 8),
        (33, 64, 5, 2, 5),
        (17, 31, 2, 1, 3),
        (96, 70, 3, 8, 32),
        (8, 9, 4, 5, 7),
        // Odd token counts over 1..4-bit rows the SIMD paths read packed (blocks and their
        // tails, groups of 16 and 48, 1..5 query rows).
        (64, 45, 5, 3, 16),
        (64, 97, 1, 2, 16),
        (80, 33, 4, 1, 48),
        (48, 71, 2, 4, 16),
        // Rows of 128 values: two passes of 64 over every token, groups of 32 and 64.
        (128, 41, 3, 4, 32),
        (128, 19, 4, 2, 64),
        // KIVI keys read packed in place per group of tokens (whole bytes per group): groups
        // that are not a multiple of 16 codes, a partial last group.
        (64, 75, 3, 1, 24),
        (24, 100, 2, 3, 40),
        // Several chunks of tokens merged by log-sum-exp, KIVI groups that do not divide it.
        (16, 600, 3, 4, 32),
        (12, 530, 2, 3, 7),
        // Above the work from which a call is split over the rayon pool (smaller ones run on
        // the calling thread; 2^25 without `OMP_WAIT_POLICY=PASSIVE`): 2 heads x 64 rows x
        // 2,200 tokens x 2 x 64 multiply-adds.
        (64, 2200, 64, 4, 32),
    ] {
        let heads = 2;
        let (ks, vs) = (
            Stored::new(d as u64, heads, t, d),
            Stored::new(7 + d as u64, heads, t, d),
        );
        let q: Vec<f32> = mixed_rows(3, heads * rows, d)
            .iter()
            .map(|v| v * 0.1)
            .collect();
        let q: Vec<f32> = q.iter().map(|v| v.clamp(-1e3, 1e3)).collect();
        let lay = AttentionShape::new(heads, rows, t, d, 1.0 / (d as f32).sqrt());
        let rank = d.min(4);
        let basis = random_orthonormal_basis(5, d, rank).unwrap();
        let side_codes = bytes(11, heads * t * packed_len(rank, 2));
        let side_scales = halves(12, heads * t, false);
        let side = SideRows {
            codes: &side_codes,
            scales: ScalarView::Float(FloatView::F16(&side_scales)),
            basis: &basis,
            basis_heads: 1,
            rank,
            bits: 2,
            sign: 1.0,
        };
        let keys = ks.layouts(heads, t, d, bits, group);
        let values = vs.layouts(heads, t, d, bits, group);
        for (ki, k) in keys.iter().enumerate() {
            for (vi, v) in values.iter().enumerate() {
                if matches!(v, CodedRows::UniformChannels { .. }) {
                    continue;
                }
                let sd = (ki == vi).then_some(&side);
                let what = format!("d={d} t={t} keys {ki} values {vi}");
                assert_attention_identical((&q, &lay), k, sd, v, &what);
            }
        }
    }
}

#[test]
fn fused_matched_runs_are_bit_identical_on_every_isa_and_thread_count() {
    // Per-channel runs in a basis (the matched scheme) around a mean, as keys and as values
    // (and MSE values around a mean): runs of different widths with width-0 columns between and
    // after them, tokens not a multiple of the group, over one and several chunks.
    for (d, t, rows, group) in [
        (12, 37, 3, 5),
        (40, 530, 2, 32),
        (64, 300, 3, 128),
        (24, 77, 3, 8),
    ] {
        let heads = 2;
        let bounds = [
            (5u32, 0, d / 4),
            (4, d / 4, d / 2),
            (2, d / 2 + 1, d - 3),
            (7, d - 3, d - 1),
        ];
        let stored: Vec<Stored> = (0..bounds.len() as u64)
            .map(|i| Stored::new(31 + i, heads, t, d))
            .collect();
        let runs: Vec<ChannelRun> = bounds
            .iter()
            .zip(&stored)
            .map(|(&(bits, start, stop), st)| {
                let (codes, scales, zeros) = st.channels(heads * (stop - start), t, bits, group);
                ChannelRun {
                    codes,
                    scales,
                    zeros,
                    bits,
                    start,
                    stop,
                }
            })
            .collect();
        let basis: Vec<f32> = (0..heads as u64)
            .flat_map(|h| random_orthonormal_basis(40 + h, d, d).unwrap())
            .collect();
        let mean = mixed_rows(41, heads, d);
        let mean: Vec<f32> = mean.iter().map(|v| v.clamp(-1e3, 1e3)).collect();
        let inner = CodedRows::ChannelRuns {
            runs,
            group,
            basis: &basis,
            basis_heads: heads,
        };
        let centred = CodedRows::Centred {
            rows: Box::new(inner.clone()),
            mean: &mean,
            mean_heads: heads,
        };
        let vs = Stored::new(42, heads, t, d);
        let mse = CodedRows::Mse {
            codes: &vs.codes[..heads * t * packed_len(padded_dim(d), 4)],
            norms: ScalarView::Float(FloatView::F16(&vs.scalars[..heads * t])),
            bits: 4,
            seed: Some(3),
            qjl: None,
        };
        let mse_centred = CodedRows::Centred {
            rows: Box::new(mse),
            mean: &mean[..d],
            mean_heads: 1,
        };
        let q: Vec<f32> = mixed_rows(43, heads * rows, d)
            .iter()
            .map(|v| (v * 0.1).clamp(-1e3, 1e3))
            .collect();
        let lay = AttentionShape::new(heads, rows, t, d, 1.0 / (d as f32).sqrt());
        for (vi, v) in [&centred, &inner, &mse_centred].into_iter().enumerate() {
            for k in [&centred, &inner] {
                let what = format!("d={d} t={t} values {vi}");
                assert_attention_identical((&q, &lay), k, None, v, &what);
            }
        }
    }
}

#[test]
fn fused_token_runs_are_bit_identical_on_every_isa_and_thread_count() {
    // Per-token runs in a (not orthonormal) basis with one scale per token (the fixed-size
    // matched keys), alone and around a mean, over dense and MSE values: runs of 1..8 bits whose
    // widths are and are not multiples of 8 (the in-register decode and the unpack), column
    // gaps, float16 and float32 scales, one basis per head or one shared, one and several
    // chunks, a call above the rayon split.
    type Bounds = &'static [(u32, usize, usize)];
    let cases: [(usize, usize, usize, Bounds); 5] = [
        (
            64,
            37,
            3,
            &[(1, 0, 16), (3, 16, 40), (4, 41, 49), (8, 49, 64)],
        ),
        (40, 530, 2, &[(2, 0, 8), (5, 8, 19), (4, 21, 40)]),
        (17, 31, 5, &[(3, 1, 9), (6, 9, 17)]),
        (24, 1, 1, &[(7, 3, 5)]),
        (96, 2100, 8, &[(2, 0, 32), (4, 32, 96)]),
    ];
    for (d, t, rows, bounds) in cases {
        let heads = 2;
        let codes: Vec<Vec<u8>> = (bounds.iter().enumerate())
            .map(|(i, &(b, lo, hi))| bytes(50 + i as u64, heads * t * packed_len(hi - lo, b)))
            .collect();
        let runs: Vec<TokenRunView> = (bounds.iter().zip(&codes))
            .map(|(&(bits, start, stop), c)| TokenRunView {
                codes: c,
                bits,
                start,
                stop,
            })
            .collect();
        let sigma = gaussians(51, 1, d);
        let basis: Vec<f32> = (0..heads as u64)
            .flat_map(|h| random_orthonormal_basis(52 + h, d, d).unwrap())
            .enumerate()
            .map(|(i, v)| v * (1.0 + sigma[i % d].abs()))
            .collect();
        let scales16 = halves(53, heads * t, false);
        let scales32: Vec<f32> = gaussians(54, 1, heads * t)
            .iter()
            .map(|v| v.abs())
            .collect();
        let mean: Vec<f32> = mixed_rows(55, heads, d)
            .iter()
            .map(|v| v.clamp(-1e3, 1e3))
            .collect();
        let key = |scales, heads_of_basis: usize| CodedRows::TokenRuns {
            runs: runs.clone(),
            scales,
            basis: &basis[..heads_of_basis * d * d],
            basis_heads: heads_of_basis,
        };
        let f16 = key(ScalarView::Float(FloatView::F16(&scales16)), heads);
        let f32s = key(ScalarView::Float(FloatView::F32(&scales32)), 1);
        let centred = CodedRows::Centred {
            rows: Box::new(f16.clone()),
            mean: &mean,
            mean_heads: heads,
        };
        let vs = Stored::new(56, heads, t, d);
        let mse = CodedRows::Mse {
            codes: &vs.codes[..heads * t * packed_len(padded_dim(d), 3)],
            norms: ScalarView::Float(FloatView::F16(&vs.scalars[..heads * t])),
            bits: 3,
            seed: Some(3),
            qjl: None,
        };
        let dense = CodedRows::Dense(&vs.dense[..heads * t * d]);
        let q: Vec<f32> = mixed_rows(57, heads * rows, d)
            .iter()
            .map(|v| (v * 0.1).clamp(-1e3, 1e3))
            .collect();
        let lay = AttentionShape::new(heads, rows, t, d, 1.0 / (d as f32).sqrt());
        for (ki, k) in [&f16, &f32s, &centred].into_iter().enumerate() {
            for (vi, v) in [&dense, &mse].into_iter().enumerate() {
                let what = format!("d={d} t={t} keys {ki} values {vi}");
                assert_attention_identical((&q, &lay), k, None, v, &what);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn packing_is_byte_identical(bits in 1u32..=8, rows in 0usize..4, count in 0usize..80, seed in any::<u64>()) {
        let mask = (1u64 << bits) - 1;
        let codes: Vec<u8> = (0..rows * count)
            .map(|i| ((seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(17) & mask) as u8)
            .collect();
        let packed = pack_with(Isa::Scalar, &codes, count, bits).unwrap();
        for isa in simd_isas() {
            prop_assert_eq!(&pack_with(isa, &codes, count, bits).unwrap(), &packed);
            prop_assert_eq!(&unpack_with(isa, &packed, count, bits).unwrap(), &codes);
        }
    }

    #[test]
    fn random_rows_encode_identically(
        di in 0usize..HEAD_DIMS.len(),
        bits in 1u32..=8,
        rotate in any::<bool>(),
        vals in prop::collection::vec(-1e6f32..1e6, 1..400),
    ) {
        let d = HEAD_DIMS[di];
        let rows = vals.len() / d;
        let x = &vals[..rows * d];
        let seed = rotate.then_some(17u64);
        let reference = MseQuantizer::new(d, bits, seed).unwrap().with_isa(Isa::Scalar).unwrap();
        let c = reference.encode(x).unwrap();
        let xh = bits_of(&reference.decode(&c).unwrap());
        for isa in simd_isas() {
            let q = MseQuantizer::new(d, bits, seed).unwrap().with_isa(isa).unwrap();
            prop_assert_eq!(&q.encode(x).unwrap(), &c);
            prop_assert_eq!(&bits_of(&q.decode(&c).unwrap()), &xh);
        }
    }
}

#[test]
fn unsupported_isa_is_an_error_not_a_crash() {
    for isa in Isa::ALL {
        assert_eq!(
            Rotation::new(8, None).unwrap().with_isa(isa).is_ok(),
            isa.is_supported()
        );
        assert_eq!(pack_with(isa, &[1, 2], 2, 2).is_ok(), isa.is_supported());
    }
}
