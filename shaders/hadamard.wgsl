// kvqrs:requires common.wgsl
//
// hadamard.wgsl: the randomized Walsh-Hadamard rotation R = H_{d'} diag(s) / sqrt(d') and its
// inverse (SPEC 2.2; docs/kernels.md section 3), float32, bit for bit the arithmetic of
// rust/core/src/kernels/hadamard.rs: coordinate i is multiplied by (s_i * (1/sqrt(d'))) (one
// float32 product), then the unnormalised fast transform runs with butterflies
// (a, b) -> (a + b, a - b) over strides h = 1, 2, ..., d'/2. WGSL requires + and * on f32 to
// be correctly rounded and there is no multiply here that a driver could fuse into an FMA, so
// results equal the Rust path's except where a driver flushes subnormals to zero.
//
// The sign vector s is generated on the device by rng.wgsl (entry `signs`, Philox stream 1)
// once per (seed, d') and bound here; 1/sqrt(d') is computed once on the host in float32
// (IEEE sqrt and division, as the Rust path does) and passed in `scale`.
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, head_dim: u32, padded: u32, has_signs: u32,
//                        has_row_scale: u32, scale: f32 }
//   1  storage, read_write  rows_hd: array<f32>    rows * head_dim: the input of `forward`,
//                                                   the output of `inverse`
//   2  storage, read_write  work: array<f32>       rows * d': the output of `forward`, the
//                                                   input of `inverse` (transformed in place)
//   3  storage, read        signs: array<f32>      d' values +-1 (unused when has_signs = 0)
//   4  storage, read        row_scale: array<f32>  inverse: one float32 factor per row applied
//                                                   last (the MSE decoder's stored norm)
//
// Entry points and grid: one invocation per row (items = rows), each transforming its row
// sequentially in the storage buffer (O(d' log d')); the batch provides the parallelism.

struct Params {
    items: u32,
    head_dim: u32,
    padded: u32,
    has_signs: u32,
    has_row_scale: u32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> rows_hd: array<f32>;
@group(0) @binding(2) var<storage, read_write> work: array<f32>;
@group(0) @binding(3) var<storage, read> signs: array<f32>;
@group(0) @binding(4) var<storage, read> row_scale: array<f32>;

// The unnormalised Sylvester transform of work[base .. base + d'] in place.
fn fwht_row(base: u32) {
    let n = params.padded;
    for (var h = 1u; h < n; h = h * 2u) {
        for (var blk = 0u; blk < n; blk = blk + 2u * h) {
            for (var i = blk; i < blk + h; i = i + 1u) {
                let u = work[base + i];
                let v = work[base + i + h];
                work[base + i] = u + v;
                work[base + i + h] = u - v;
            }
        }
    }
}

@compute @workgroup_size(64)
fn forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = item_index(wid, nwg, lid);
    if (row >= params.items) {
        return;
    }
    let base = row * params.padded;
    for (var i = 0u; i < params.padded; i = i + 1u) {
        var v = 0.0;
        if (i < params.head_dim) {
            v = rows_hd[row * params.head_dim + i];
        }
        var f = params.scale;
        if (params.has_signs == 1u) {
            f = signs[i] * params.scale;
        }
        work[base + i] = v * f;
    }
    fwht_row(base);
}

@compute @workgroup_size(64)
fn inverse(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = item_index(wid, nwg, lid);
    if (row >= params.items) {
        return;
    }
    let base = row * params.padded;
    for (var i = 0u; i < params.padded; i = i + 1u) {
        work[base + i] = work[base + i] * params.scale;
    }
    fwht_row(base);
    for (var i = 0u; i < params.head_dim; i = i + 1u) {
        var v = work[base + i];
        if (params.has_signs == 1u) {
            v = v * signs[i];
        }
        if (params.has_row_scale == 1u) {
            v = v * row_scale[row];
        }
        rows_hd[row * params.head_dim + i] = v;
    }
}
