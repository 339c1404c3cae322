// kvqrs:requires common.wgsl
//
// hadamard.wgsl: the randomized Walsh-Hadamard rotation R = H_{d'} diag(s) / sqrt(d') and its
// inverse (docs/kernels.md section 3), float32, bit for bit the arithmetic of
// rust/core/src/kernels/hadamard.rs: coordinate i is multiplied by (s_i * (1/sqrt(d'))) (one
// float32 product), then the unnormalised fast transform runs with butterflies
// (a, b) -> (a + b, a - b) over strides h = 1, 2, ..., d'/2. WGSL requires + and * on f32 to
// be correctly rounded and there is no multiply here that a driver could fuse into an FMA, so
// results equal the Rust path's except where a driver flushes subnormals to zero.
//
// The stages h < B (B = min(64, d')) run inside `butterfly_block`, one invocation per block of
// B coordinates (blocks do not interact below stride B); every later stage is its own dispatch
// (`butterfly`, one invocation per butterfly), in the order h = B, 2B, ..., d'/2. Each
// butterfly sees exactly the operands of the sequential transform, so the result is the Rust
// path's bit for bit, and no invocation loops over a whole row (llvmpipe cuts loops off after
// about 65535 iterations per invocation).
//
// The sign vector s is generated on the device by rng.wgsl (entry `signs`, Philox stream 1)
// once per (seed, d') and bound here; 1/sqrt(d') is computed once on the host in float32
// (IEEE sqrt and division, as the Rust path does) and passed in `scale`.
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, head_dim: u32, padded: u32, has_signs: u32,
//                        has_row_scale: u32, scale: f32, h: u32 }
//   1  storage, read_write  rows_hd: array<f32>    rows * head_dim: the input of `forward_scale`,
//                                                   the output of `inverse_finish`
//   2  storage, read_write  work: array<f32>       rows * d', transformed in place
//   3  storage, read        signs: array<f32>      d' values +-1 (unused when has_signs = 0)
//   4  storage, read        row_scale: array<f32>  one float32 factor per row applied last by
//                                                   `inverse_finish` (the MSE decoder's norm)
//
// Entry points and grid (common.wgsl's 2-D grid of 64-wide groups):
//   forward_scale   one invocation per (row, i < d'): work = pad(x)_i * (s_i * scale);
//                   items = rows * d'
//   butterfly_block one invocation per block of h coordinates, stages 1 .. h/2 in order:
//                   items = rows * d' / h (here h = B)
//   butterfly       one invocation per butterfly of stage h: items = rows * d' / 2
//   inverse_scale   one invocation per (row, i < d'): work *= scale; items = rows * d'
//   inverse_finish  one invocation per (row, i < head_dim): out = work * s_i (* row_scale);
//                   items = rows * head_dim
// forward = forward_scale, butterfly_block, then butterfly for h = B .. d'/2;
// inverse = inverse_scale, butterfly_block, butterfly for h = B .. d'/2, then inverse_finish.

struct Params {
    items: u32,
    head_dim: u32,
    padded: u32,
    has_signs: u32,
    has_row_scale: u32,
    scale: f32,
    h: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> rows_hd: array<f32>;
@group(0) @binding(2) var<storage, read_write> work: array<f32>;
@group(0) @binding(3) var<storage, read> signs: array<f32>;
@group(0) @binding(4) var<storage, read> row_scale: array<f32>;

@compute @workgroup_size(64)
fn forward_scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let f = item_index(wid, nwg, lid);
    if (f >= params.items) {
        return;
    }
    let row = f / params.padded;
    let i = f % params.padded;
    var v = 0.0;
    if (i < params.head_dim) {
        v = rows_hd[row * params.head_dim + i];
    }
    var factor = params.scale;
    if (params.has_signs == 1u) {
        factor = signs[i] * params.scale;
    }
    work[f] = v * factor;
}

@compute @workgroup_size(64)
fn butterfly_block(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let blk = item_index(wid, nwg, lid);
    if (blk >= params.items) {
        return;
    }
    let base = blk * params.h;
    for (var h = 1u; h < params.h; h = h * 2u) {
        for (var j = 0u; j < params.h; j = j + 2u * h) {
            for (var i = base + j; i < base + j + h; i = i + 1u) {
                let u = work[i];
                let v = work[i + h];
                work[i] = u + v;
                work[i + h] = u - v;
            }
        }
    }
}

@compute @workgroup_size(64)
fn butterfly(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = item_index(wid, nwg, lid);
    if (t >= params.items) {
        return;
    }
    let halfn = params.padded / 2u;
    let k = t % halfn;
    let i = (t / halfn) * params.padded + (k / params.h) * 2u * params.h + k % params.h;
    let u = work[i];
    let v = work[i + params.h];
    work[i] = u + v;
    work[i + params.h] = u - v;
}

@compute @workgroup_size(64)
fn inverse_scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let f = item_index(wid, nwg, lid);
    if (f >= params.items) {
        return;
    }
    work[f] = work[f] * params.scale;
}

@compute @workgroup_size(64)
fn inverse_finish(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let f = item_index(wid, nwg, lid);
    if (f >= params.items) {
        return;
    }
    let row = f / params.head_dim;
    let i = f % params.head_dim;
    var v = work[row * params.padded + i];
    if (params.has_signs == 1u) {
        v = v * signs[i];
    }
    if (params.has_row_scale == 1u) {
        v = v * row_scale[row];
    }
    rows_hd[f] = v;
}
