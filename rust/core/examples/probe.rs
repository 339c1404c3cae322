use kvqrs_core::kernels::mse::MseQuantizer;
use kvqrs_core::kernels::pack::{pack_into, unpack_into};
use kvqrs_core::Isa;
use std::time::Instant;
fn main() {
    let n = 1usize << 20;
    let d = 128;
    let xs = [
        kvqrs_core::rng::gaussians(1, 7, n * d),
        kvqrs_core::rng::gaussians(2, 7, n * d),
    ];
    let mut dst = vec![0.0f32; n * d];
    let mut codes = vec![0u8; n * d];
    let mut packed = vec![0u8; n * d / 2];
    let mut norms = vec![0.0f32; n];
    let gb = (n * d * 4) as f64 / 1e9;
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            for rep in 0..3 {
                let t = Instant::now(); dst.copy_from_slice(&xs[rep % 2]); let mc = gb / t.elapsed().as_secs_f64();
                for isa in [Isa::Scalar, Isa::Avx512] {
                    if isa == Isa::Scalar && (threads > 1 || rep > 0) { continue; }
                    let q = MseQuantizer::new(d, 4, Some(1)).unwrap().with_isa(isa).unwrap();
                    let t = Instant::now(); q.encode_into(&xs[rep % 2], &mut codes, &mut norms).unwrap(); let e = gb / t.elapsed().as_secs_f64();
                    let t = Instant::now(); pack_into(isa, &codes, d, 4, &mut packed).unwrap(); let p = gb / t.elapsed().as_secs_f64();
                    let t = Instant::now(); unpack_into(isa, &packed, d, 4, &mut codes).unwrap(); let u = gb / t.elapsed().as_secs_f64();
                    let nv = kvqrs_core::scalars::ScalarView::F32(&norms);
                    let t = Instant::now(); q.decode_into(&codes, nv, &mut dst).unwrap(); let de = gb / t.elapsed().as_secs_f64();
                    println!("{threads}t {isa:?}: memcpy {mc:.2} GB/s | encode_into {e:.2} pack {p:.2} unpack {u:.2} decode_into {de:.2}");
                }
            }
        });
    }
}
