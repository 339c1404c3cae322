use kvqrs_core::kernels::mse::MseQuantizer;
use kvqrs_core::Isa;
use std::time::Instant;
fn main() {
    let n = 4096usize;
    let d = 128;
    let x = kvqrs_core::rng::gaussians(1, 7, n * d);
    let mut codes = vec![0u8; n * d];
    let mut norms = vec![0.0f32; n];
    let mut out = vec![0.0f32; n * d];
    let mut dst = vec![0.0f32; n * d];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| {
        for _ in 0..3 {
            let reps = 300;
            let t = Instant::now();
            for _ in 0..reps {
                dst.copy_from_slice(&x);
                std::hint::black_box(&dst);
            }
            let mc = t.elapsed().as_secs_f64() / (reps * n) as f64 * 1e9;
            let mut line = format!("memcpy {mc:.1} ns/row");
            for isa in [Isa::Avx2, Isa::Avx512] {
                let q = MseQuantizer::new(d, 4, Some(1))
                    .unwrap()
                    .with_isa(isa)
                    .unwrap();
                let t = Instant::now();
                for _ in 0..reps {
                    q.encode_into(&x, &mut codes, &mut norms).unwrap();
                }
                let e = t.elapsed().as_secs_f64() / (reps * n) as f64 * 1e9;
                let nv = kvqrs_core::scalars::ScalarView::F32(&norms);
                let t = Instant::now();
                for _ in 0..reps {
                    q.decode_into(&codes, nv, &mut out).unwrap();
                }
                let de = t.elapsed().as_secs_f64() / (reps * n) as f64 * 1e9;
                line += &format!(" | {isa:?} enc {e:.1} dec {de:.1}");
            }
            println!("{line}");
        }
    });
}
