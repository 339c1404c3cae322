// kvqrs:requires common.wgsl
//
// qjl.wgsl: the 1-bit QJL sign sketch and its estimators (docs/kernels.md section 6).
//
// S (m x dim, i.i.d. N(0, 1)) is NOT generated here: its Box-Muller step is specified in
// float64 and WGSL has no f64, so kvqrs.gpu builds S on the host with the Rust generator
// (kvqrs.rng.qjl_matrix) and uploads it once per (seed, m, dim). ||r|| comes from mse.wgsl
// (`norms`) and the sign bits are packed by pack.wgsl (bits = 1); the host chains the three in
// one submission.
//
// Arithmetic follows the Rust path: dot products in the fixed order of docs section 8 (eight
// strided float32 accumulators, product rounded then added, fixed combining tree);
// k = float32(sqrt(pi/2) / m) is computed on the host in float64.
//   sketch_bits      bit(row, i) = 1 if (S r_row)_i < 0 else 0 (sign(0) = +1)
//   project          (S y_row)_i as float32
//   inner_product    out(i, j) = (k * ||r_j||) * sum_l (S y_i)_l sigma_jl, sigma = 1 - 2 bit
//   vector_estimate  out(row, c) = (sum_{i = 0..m-1 in order} sigma_i S[i, c]) * (k * ||r_row||)
// WGSL allows a driver to contract a product and a sum into a fused multiply-add; lavapipe does
// not, and the products with sigma are exact anyway, so only the projections S r and S y can
// differ from the Rust path, by rounding (tests allow it where |S r| is at rounding level).
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, dim: u32, m: u32, cols: u32, k: f32 }
//               cols = rows * m (sketch_bits), number of sketched rows nr (inner_product)
//   1  storage, read        s: array<f32>          m * dim, row-major
//   2  storage, read        vecs: array<f32>       rows * dim: residuals r or queries y
//   3  storage, read_write  bits_out: array<u32>   sketch_bits: rows * m bytes 0/1, 4 per word
//   4  storage, read_write  values_out: array<f32> project: rows * m; inner_product: ny * nr;
//                                                   vector_estimate: rows * dim
//   5  storage, read        proj: array<f32>       inner_product: ny * m projections S y
//   6  storage, read        signs: array<u32>      packed sign bytes, ceil(m / 8) per row
//   7  storage, read        norms: array<f32>      stored ||r|| per sketched row, as float32
//
// Entry points and grid (common.wgsl's 2-D grid of 64-wide groups):
//   sketch_bits      one invocation per word of 4 bits: items = ceil(rows * m / 4)
//   project          one invocation per (row, i): items = rows * m
//   inner_product    one invocation per (i, j): items = ny * nr
//   vector_estimate  one invocation per (row, c): items = rows * dim

struct Params {
    items: u32,
    dim: u32,
    m: u32,
    cols: u32,
    k: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> s: array<f32>;
@group(0) @binding(2) var<storage, read> vecs: array<f32>;
@group(0) @binding(3) var<storage, read_write> bits_out: array<u32>;
@group(0) @binding(4) var<storage, read_write> values_out: array<f32>;
@group(0) @binding(5) var<storage, read> proj: array<f32>;
@group(0) @binding(6) var<storage, read> signs: array<u32>;
@group(0) @binding(7) var<storage, read> norms: array<f32>;

// (S v_row)_i in the fixed order.
fn project_one(row: u32, i: u32) -> f32 {
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    let sb = i * params.dim;
    let vb = row * params.dim;
    for (var c = 0u; c < params.dim; c = c + 1u) {
        acc[c & 7u] = acc[c & 7u] + s[sb + c] * vecs[vb + c];
    }
    return combine8(acc);
}

// sigma_i = +1 or -1 of sketched row `row`.
fn sigma(row: u32, i: u32) -> f32 {
    let k = row * ((params.m + 7u) / 8u) + i / 8u;
    let bit = (byte_of(signs[k >> 2u], k) >> (i % 8u)) & 1u;
    return 1.0 - 2.0 * f32(bit);
}

@compute @workgroup_size(64)
fn sketch_bits(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let w = item_index(wid, nwg, lid);
    if (w >= params.items) {
        return;
    }
    var word = 0u;
    for (var t = 0u; t < 4u; t = t + 1u) {
        let f = 4u * w + t;
        if (f < params.cols) {
            let neg = project_one(f / params.m, f % params.m) < 0.0;
            word = word | (select(0u, 1u, neg) << (8u * t));
        }
    }
    bits_out[w] = word;
}

@compute @workgroup_size(64)
fn project(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let f = item_index(wid, nwg, lid);
    if (f >= params.items) {
        return;
    }
    values_out[f] = project_one(f / params.m, f % params.m);
}

@compute @workgroup_size(64)
fn inner_product(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let f = item_index(wid, nwg, lid);
    if (f >= params.items) {
        return;
    }
    let i = f / params.cols;
    let j = f % params.cols;
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (var l = 0u; l < params.m; l = l + 1u) {
        acc[l & 7u] = acc[l & 7u] + proj[i * params.m + l] * sigma(j, l);
    }
    values_out[f] = (params.k * norms[j]) * combine8(acc);
}

@compute @workgroup_size(64)
fn vector_estimate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let f = item_index(wid, nwg, lid);
    if (f >= params.items) {
        return;
    }
    let row = f / params.dim;
    let c = f % params.dim;
    var acc = 0.0;
    for (var i = 0u; i < params.m; i = i + 1u) {
        let v = s[i * params.dim + c];
        if (sigma(row, i) > 0.0) {
            acc = acc + v;
        } else {
            acc = acc - v;
        }
    }
    values_out[f] = acc * (params.k * norms[row]);
}
