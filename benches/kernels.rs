//! Criterion benches of the kvqrs-core kernels: the scalar reference against the dispatched SIMD
//! path (one thread each), the SIMD path on every rayon thread, and a plain memory copy of the
//! same float32 input as the bandwidth yardstick.
//!
//! Throughput is always counted as the float32 input the kernel covers (vectors x head_dim x 4
//! bytes), also for decoders and packing, so every line compares directly with `memcpy`.
//!
//! Groups:
//! - `cache/*`: 2^12 vectors of head_dim 128 (2 MiB), every kernel, resident in cache;
//! - `dram/*`: 2^20 vectors (512 MiB per buffer, more than this machine's 480 MiB L3) cycling
//!   through two buffers, so each pass streams from main memory: rotation and the `kqv`-style
//!   4-bit MSE encode/decode (also with packing), into reused output buffers (`_into`) and
//!   through the allocating API. `KVQRS_BENCH_ROWS_LOG2` sets the size (default 20).
//!
//! - `pack_paths/*`: pack and unpack (into reused buffers) of the same 2^12 x 128 codes at 2, 3
//!   and 4 bits on every pack path this CPU runs (`scalar`, `shift`, `bmi2`), whatever the
//!   dispatcher would pick; the dispatch summary is printed first.
//!
//! - `attention/*`: fused decode attention on one thread, 3 KV heads x 3 query rows
//!   (9 query heads, GQA), head_dim 64, 4k and 32k tokens, the four 4-bit cache layouts of
//!   `benches/bench_attention.py` (`kv`, `kqv` = 4-bit keys + 3-bit values with a QJL residual,
//!   `kivi`, `qkqv`); throughput counts the tokens' float32 keys and values (2 x 64 x 4 bytes
//!   each), the bytes SDPA over a float32 cache reads.
//!
//! Run: `cargo bench -p kvqrs-core --bench kernels` (add a filter such as `dram/` or `mse`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, Bencher, BenchmarkGroup, Criterion, Throughput};
use kvqrs_core::kernels::attention::{decode_attention_with, AttentionShape, CodedRows, QjlRows};
use kvqrs_core::kernels::hadamard::Rotation;
use kvqrs_core::kernels::headq::HeadqCoder;
use kvqrs_core::kernels::lloyd_max::codebook;
use kvqrs_core::kernels::mse::MseQuantizer;
use kvqrs_core::kernels::pack::{
    pack_into, pack_path_into, pack_with, packed_len, unpack_into, unpack_path_into, unpack_with,
};
use kvqrs_core::kernels::qjl::QjlSketcher;
use kvqrs_core::rng::{gaussians, random_orthonormal_basis};
use kvqrs_core::scalars::{FloatView, ScalarView};
use kvqrs_core::{Isa, PackPath};
use rayon::prelude::*;

const D: usize = 128;
const BITS: u32 = 4;

/// The paths compared: the scalar reference and every SIMD path this CPU supports (AVX2 and
/// AVX-512 side by side on an AVX-512 machine).
fn paths() -> Vec<Isa> {
    Isa::available()
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a rayon pool")
}

/// Gaussian rows, generated once per size.
fn rows(n: usize, seed: u64) -> Vec<f32> {
    gaussians(seed, 7, n * D)
}

/// Times `f` with the whole sample loop inside pool `p` (one `install` per sample, so the hop
/// into the pool is not part of each iteration).
fn timed<'a, R>(
    p: &'a rayon::ThreadPool,
    mut f: impl FnMut() -> R + Send + 'a,
) -> impl FnMut(&mut Bencher<'_>) + 'a {
    move |b| {
        b.iter_custom(|iters| {
            p.install(|| {
                let t0 = Instant::now();
                for _ in 0..iters {
                    black_box(f());
                }
                t0.elapsed()
            })
        })
    }
}

fn configure(g: &mut BenchmarkGroup<'_, WallTime>, rows: usize) {
    g.throughput(Throughput::Bytes((rows * D * 4) as u64));
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(2));
}

fn cache(c: &mut Criterion) {
    let n = 1usize << 12;
    let x = rows(n, 1);
    let one = pool(1);
    let mut g = c.benchmark_group("cache");
    configure(&mut g, n);
    let mut dst = vec![0.0f32; x.len()];
    g.bench_function("memcpy", timed(&one, || dst.copy_from_slice(&x)));

    let q = MseQuantizer::new(D, BITS, Some(1)).expect("quantizer");
    let codes = q.encode(&x).expect("codes");
    let unit: Vec<f32> = x.iter().map(|v| v / 12.0).collect();
    let cb = codebook(D, BITS).expect("codebook");
    let basis = random_orthonormal_basis(3, D, 8).expect("basis");
    let y = rows(1, 5);
    for isa in paths() {
        let name = isa.name();
        let q = MseQuantizer::new(D, BITS, Some(1))
            .and_then(|q| q.with_isa(isa))
            .expect("quantizer");
        let rot = Rotation::new(D, Some(1))
            .and_then(|r| r.with_isa(isa))
            .expect("rotation");
        let sk = QjlSketcher::new(D, D, 2)
            .and_then(|s| s.with_isa(isa))
            .expect("sketcher");
        let hq = HeadqCoder::new(&basis, D, 8, 2)
            .and_then(|h| h.with_isa(isa))
            .expect("coder");
        let sketch = sk.sketch(&x).expect("sketch");
        let side = hq.encode(&x).expect("side codes");
        let mut out_codes = vec![0u8; x.len()];
        let mut out_f = vec![0.0f32; x.len()];
        let packed = pack_with(isa, &codes.codes, D, BITS).expect("packed");
        g.bench_function(format!("rotation/{name}"), timed(&one, || rot.forward(&x)));
        g.bench_function(
            format!("lloyd_max_encode/{name}"),
            timed(&one, || cb.encode_into_with(isa, &unit, &mut out_codes)),
        );
        g.bench_function(
            format!("lloyd_max_decode/{name}"),
            timed(&one, || cb.decode_into_with(isa, &codes.codes, &mut out_f)),
        );
        g.bench_function(
            format!("pack/{name}"),
            timed(&one, || pack_with(isa, &codes.codes, D, BITS)),
        );
        g.bench_function(
            format!("unpack/{name}"),
            timed(&one, || unpack_with(isa, &packed, D, BITS)),
        );
        g.bench_function(format!("mse_encode/{name}"), timed(&one, || q.encode(&x)));
        g.bench_function(
            format!("mse_decode/{name}"),
            timed(&one, || q.decode(&codes)),
        );
        g.bench_function(
            format!("qjl_sketch_m128/{name}"),
            timed(&one, || sk.sketch(&x)),
        );
        g.bench_function(
            format!("qjl_inner_product_1q/{name}"),
            timed(&one, || sk.inner_product(&y, &sketch)),
        );
        g.bench_function(
            format!("headq_encode_r8/{name}"),
            timed(&one, || hq.encode(&x)),
        );
        g.bench_function(
            format!("headq_score_correction_1q/{name}"),
            timed(&one, || hq.score_correction(&y, &side)),
        );
    }
    g.finish();
}

fn dram(c: &mut Criterion) {
    let log2: u32 = std::env::var("KVQRS_BENCH_ROWS_LOG2")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let n = 1usize << log2;
    // Two input buffers used in turn: with 512 MiB each, no pass finds its input in the L3.
    let inputs = [rows(n, 1), rows(n, 2)];
    let (one, all) = (pool(1), pool(rayon::current_num_threads()));
    let mut g = c.benchmark_group("dram");
    configure(&mut g, n);

    let mut dst = vec![0.0f32; n * D];
    let mut k = 0usize;
    let mut next = || {
        k += 1;
        k % 2
    };
    g.bench_function(
        "memcpy/1t",
        timed(&one, || dst.copy_from_slice(&inputs[next()])),
    );
    g.bench_function(
        "memcpy/all_threads",
        timed(&all, || {
            dst.par_chunks_mut(1 << 16)
                .zip(inputs[next()].par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s))
        }),
    );
    // A copy into fresh memory pays the page faults of its output, as every kernel that returns
    // a new buffer (and NumPy's `x.copy()`) does.
    g.bench_function("memcpy_fresh/1t", timed(&one, || inputs[next()].to_vec()));

    let q0 = MseQuantizer::new(D, BITS, Some(1)).expect("quantizer");
    let coded = [
        q0.encode(&inputs[0]).expect("codes"),
        q0.encode(&inputs[1]).expect("codes"),
    ];
    let packed: Vec<Vec<u8>> = coded
        .iter()
        .map(|c| pack_with(Isa::Scalar, &c.codes, D, BITS).expect("packed"))
        .collect();
    let mut codes = vec![0u8; n * D];
    let mut norms = vec![0.0f32; n];
    let mut bytes = vec![0u8; n * D * BITS as usize / 8];
    let mut variants: Vec<(Isa, &rayon::ThreadPool, &str)> =
        paths().into_iter().map(|i| (i, &one, "1t")).collect();
    variants.push((Isa::best(), &all, "all_threads"));
    for (isa, p, threads) in variants {
        let label = format!("{}/{threads}", isa.name());
        let q = MseQuantizer::new(D, BITS, Some(1))
            .and_then(|q| q.with_isa(isa))
            .expect("quantizer");
        let rot = Rotation::new(D, Some(1))
            .and_then(|r| r.with_isa(isa))
            .expect("rotation");
        // Outputs into reused buffers: the kernels' own throughput.
        g.bench_function(
            format!("rotation_into/{label}"),
            timed(p, || rot.forward_into(&inputs[next()], &mut dst)),
        );
        g.bench_function(
            format!("mse_encode_into/{label}"),
            timed(p, || q.encode_into(&inputs[next()], &mut codes, &mut norms)),
        );
        g.bench_function(
            format!("mse_decode_into/{label}"),
            timed(p, || {
                let c = &coded[next()];
                q.decode_into(&c.codes, c.norms.view(), &mut dst)
            }),
        );
        g.bench_function(
            format!("mse_encode+pack_into/{label}"),
            timed(p, || {
                q.encode_into(&inputs[next()], &mut codes, &mut norms)?;
                pack_into(isa, &codes, D, BITS, &mut bytes)
            }),
        );
        g.bench_function(
            format!("unpack+mse_decode_into/{label}"),
            timed(p, || {
                let i = next();
                unpack_into(isa, &packed[i], D, BITS, &mut codes)?;
                q.decode_into(&codes, coded[i].norms.view(), &mut dst)
            }),
        );
        if isa != Isa::Scalar {
            // The allocating API (what the Python binding calls): fresh outputs every call.
            g.bench_function(
                format!("mse_encode/{label}"),
                timed(p, || q.encode(&inputs[next()])),
            );
            g.bench_function(
                format!("mse_decode/{label}"),
                timed(p, || q.decode(&coded[next()])),
            );
        }
    }
    g.finish();
}

/// Pseudo-random bytes (the kernel's time does not depend on the code values).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    (0..n as u64)
        .map(|i| ((seed ^ i).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect()
}

/// float16 bit patterns of values in [1, 1.25) (stored norms and scales are float16).
fn halves(seed: u64, n: usize) -> Vec<u16> {
    bytes(seed, n)
        .iter()
        .map(|&b| 0x3C00 | u16::from(b))
        .collect()
}

/// The stored parts of one side of a cache of `heads x t` vectors: codes, per-token norms or
/// per-group scales and zeros, QJL signs and norms.
struct Side {
    codes: Vec<u8>,
    scalars: Vec<u16>,
    zeros: Vec<u16>,
    signs: Vec<u8>,
    qjl_norms: Vec<u16>,
}

impl Side {
    fn new(seed: u64, vectors: usize, row_bytes: usize, scalars: usize, d: usize) -> Self {
        Self {
            codes: bytes(seed, vectors * row_bytes),
            scalars: halves(seed + 1, scalars),
            zeros: halves(seed + 2, scalars)
                .iter()
                .map(|h| h | 0x8000)
                .collect(),
            signs: bytes(seed + 3, vectors * d / 8),
            qjl_norms: halves(seed + 4, vectors),
        }
    }

    fn mse(&self, bits: u32, seed: Option<u64>, qjl: bool) -> CodedRows<'_> {
        CodedRows::Mse {
            codes: &self.codes,
            norms: ScalarView::Float(FloatView::F16(&self.scalars)),
            bits,
            seed,
            qjl: qjl.then_some(QjlRows {
                signs: &self.signs,
                norms: ScalarView::Float(FloatView::F16(&self.qjl_norms)),
                seed: 7,
            }),
        }
    }
}

fn attention(c: &mut Criterion) {
    const HEADS: usize = 3;
    const ROWS: usize = 3;
    const HD: usize = 64;
    const GROUP: usize = 32;
    let one = pool(1);
    let mut g = c.benchmark_group("attention");
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(2));
    let q = gaussians(9, 7, HEADS * ROWS * HD);
    for t in [4096usize, 32768] {
        g.throughput(Throughput::Bytes((t * HEADS * 2 * HD * 4) as u64));
        let v = HEADS * t;
        let lay = AttentionShape::new(HEADS, ROWS, t, HD, 0.125);
        let (m4, m3) = (packed_len(HD, 4), packed_len(HD, 3));
        let (k4, k3) = (Side::new(1, v, m4, v, HD), Side::new(11, v, m3, v, HD));
        let v4 = Side::new(21, v, m4, v, HD);
        let v3 = Side::new(31, v, m3, v, HD);
        let kc = Side::new(
            41,
            HEADS * HD,
            packed_len(t, 4),
            HEADS * HD * t.div_ceil(GROUP),
            HD,
        );
        let vt = Side::new(51, v, m4, v * HD / GROUP, HD);
        let kivi_keys = CodedRows::UniformChannels {
            codes: &kc.codes,
            scales: ScalarView::Float(FloatView::F16(&kc.scalars)),
            zeros: ScalarView::Float(FloatView::F16(&kc.zeros)),
            bits: 4,
            group: GROUP,
        };
        let kivi_values = CodedRows::UniformTokens {
            codes: &vt.codes,
            scales: ScalarView::Float(FloatView::F16(&vt.scalars)),
            zeros: ScalarView::Float(FloatView::F16(&vt.zeros)),
            bits: 4,
            group: GROUP,
            seed: None,
        };
        let layouts = [
            ("kv", k4.mse(4, None, false), v4.mse(4, None, false)),
            ("kqv", k4.mse(4, Some(1), false), v3.mse(3, Some(2), true)),
            ("kivi", kivi_keys, kivi_values),
            ("qkqv", k3.mse(3, Some(1), true), v3.mse(3, Some(2), true)),
        ];
        for (scheme, keys, values) in &layouts {
            for isa in paths() {
                g.bench_function(
                    format!("{scheme}/{t}/{}", isa.name()),
                    timed(&one, || {
                        decode_attention_with(isa, &q, &lay, keys, None, values, false)
                            .expect("attention")
                    }),
                );
            }
        }
    }
    g.finish();
}

/// Pack and unpack on each pack path side by side, at the widths of the cache layouts.
fn pack_paths(c: &mut Criterion) {
    eprintln!("kvqrs simd: {}", kvqrs_core::simd::summary());
    let n = 1usize << 12;
    let one = pool(1);
    let mut g = c.benchmark_group("pack_paths");
    configure(&mut g, n);
    for bits in [2u32, 3, 4] {
        let codes: Vec<u8> = (0..n * D)
            .map(|i| {
                ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 61) as u8 & ((1 << bits) - 1)
            })
            .collect();
        let mut packed = vec![0u8; n * packed_len(D, bits)];
        let mut back = vec![0u8; codes.len()];
        pack_path_into(PackPath::Scalar, &codes, D, bits, &mut packed).expect("packed");
        for path in PackPath::available() {
            let name = path.name();
            g.bench_function(
                format!("pack/{bits}b/{name}"),
                timed(&one, || pack_path_into(path, &codes, D, bits, &mut packed)),
            );
            g.bench_function(
                format!("unpack/{bits}b/{name}"),
                timed(&one, || unpack_path_into(path, &packed, D, bits, &mut back)),
            );
        }
    }
    g.finish();
}

criterion_group!(benches, cache, dram, attention, pack_paths);
criterion_main!(benches);
