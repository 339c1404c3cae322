// kvqrs:requires common.wgsl philox.wgsl
//
// rng.wgsl: the seeded generator (docs/kernels.md section 1) on the device.
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, seed_lo: u32, seed_hi: u32, stream: u32 }
//   1  storage, read        blocks_in: array<u32>  philox_blocks: 6 words per block
//                                                   (counter c0..c3, key k0, k1)
//   2  storage, read_write  words_out: array<u32>  philox_blocks: 4 words per block
//   3  storage, read_write  signs_out: array<f32>  signs: +1.0 / -1.0, one per coordinate
//
// Entry points and grid (one invocation per item, common.wgsl's 2-D grid of 64-wide groups):
//   philox_blocks  items = number of blocks; Philox4x32-10 of each (counter, key), word for
//                  word equal to kvqrs.rng.philox4x32_10 (the test of the WGSL generator).
//   signs          items = d'; sign_i = +1 if the top bit of word(seed, stream, i) is 0 else
//                  -1 (the rotation signs use stream 1). kvqrs.gpu generates each (seed, d')
//                  sign vector once with this entry point and keeps it on the device.
//
// The Gaussian QJL matrix and the random orthonormal basis are NOT generated here: their
// Box-Muller and Gram-Schmidt steps are specified in float64 (docs/kernels.md section 1) and
// WGSL has no f64, so the host builds them with the Rust generator and uploads them once.

struct Params {
    items: u32,
    seed_lo: u32,
    seed_hi: u32,
    stream: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> blocks_in: array<u32>;
@group(0) @binding(2) var<storage, read_write> words_out: array<u32>;
@group(0) @binding(3) var<storage, read_write> signs_out: array<f32>;

@compute @workgroup_size(64)
fn philox_blocks(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = item_index(wid, nwg, lid);
    if (b >= params.items) {
        return;
    }
    let ctr = vec4<u32>(blocks_in[6u * b], blocks_in[6u * b + 1u], blocks_in[6u * b + 2u], blocks_in[6u * b + 3u]);
    let key = vec2<u32>(blocks_in[6u * b + 4u], blocks_in[6u * b + 5u]);
    let w = philox4x32_10(ctr, key);
    words_out[4u * b] = w.x;
    words_out[4u * b + 1u] = w.y;
    words_out[4u * b + 2u] = w.z;
    words_out[4u * b + 3u] = w.w;
}

@compute @workgroup_size(64)
fn signs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = item_index(wid, nwg, lid);
    if (i >= params.items) {
        return;
    }
    let w = philox_word(vec2<u32>(params.seed_lo, params.seed_hi), params.stream, i);
    signs_out[i] = select(1.0, -1.0, (w >> 31u) == 1u);
}
