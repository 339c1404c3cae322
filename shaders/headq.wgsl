// kvqrs:requires common.wgsl
//
// headq.wgsl: the HeadQ side code (docs/kernels.md section 7), float32 as in
// rust/core/src/kernels/headq.rs. The basis U (d x r) comes from the host (a PCA of
// calibration queries, or the random-basis control built by the Rust generator in float64)
// and is uploaded transposed (r x d).
//
//   project     p = U^T v per row (r dot products over d, fixed order of docs section 8)
//   scales_of   raw_scale = max_i |p_i| / h per row, with h = (2^q - 1) / 2
//   encode      code_i = clamp(floor(p_i / s + h + 0.5), 0, 2^q - 1) with the STORED scale s
//               (the host picks float16 or float32 storage for the whole call, as the Rust
//               path does, between `project` and `encode`); all codes 2^(q-1) when s = 0
//   decode      out(row, c) = sum_{j in order} U[c, j] * z_j,  z_j = s * (code_j - h)
//   correction  out(i, j) = (U^T q_i) . z_j (fixed order over the rank)
// The divisions are not required to be correctly rounded in WGSL (2.5 ulp), and a driver may
// contract a product and a sum into an FMA (lavapipe does not): codes can differ from the Rust
// path's only where p / s + h + 0.5 lies within rounding of an integer.
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, dim: u32, rank: u32, cols: u32, half: f32, top: f32 }
//               half = h, top = 2^q - 1, cols = number of coded rows (correction)
//   1  storage, read        basis_t: array<f32>    rank * dim (U transposed)
//   2  storage, read        vecs: array<f32>       project: rows * dim (residuals or queries)
//   3  storage, read_write  proj: array<f32>       project output / encode input: rows * rank
//   4  storage, read_write  raw_scales: array<f32> scales_of output: rows
//   5  storage, read        scales: array<f32>     stored scales as float32: rows
//   6  storage, read_write  codes_out: array<u32>  encode: rows * rank code bytes, 4 per word
//   7  storage, read        codes_in: array<u32>   decode / correction: rows * rank code bytes
//   8  storage, read_write  values_out: array<f32> decode: rows * dim; correction: nq * nk
//   9  storage, read        qproj: array<f32>      correction: nq * rank projections U^T q
//
// Entry points and grid (common.wgsl's 2-D grid of 64-wide groups):
//   project     one invocation per (row, j): items = rows * rank
//   scales_of   one invocation per row: items = rows
//   encode      one invocation per word of 4 codes: items = ceil(rows * rank / 4)
//   decode      one invocation per (row, c): items = rows * dim
//   correction  one invocation per (i, j): items = nq * nk

struct Params {
    items: u32,
    dim: u32,
    rank: u32,
    cols: u32,
    half: f32,
    top: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> basis_t: array<f32>;
@group(0) @binding(2) var<storage, read> vecs: array<f32>;
@group(0) @binding(3) var<storage, read_write> proj: array<f32>;
@group(0) @binding(4) var<storage, read_write> raw_scales: array<f32>;
@group(0) @binding(5) var<storage, read> scales: array<f32>;
@group(0) @binding(6) var<storage, read_write> codes_out: array<u32>;
@group(0) @binding(7) var<storage, read> codes_in: array<u32>;
@group(0) @binding(8) var<storage, read_write> values_out: array<f32>;
@group(0) @binding(9) var<storage, read> qproj: array<f32>;

// z_j of coded row `row`.
fn side_value(row: u32, j: u32) -> f32 {
    let f = row * params.rank + j;
    return scales[row] * (f32(byte_of(codes_in[f >> 2u], f)) - params.half);
}

@compute @workgroup_size(64)
fn project(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let f = item_index(wid, nwg, lid);
    if (f >= params.items) {
        return;
    }
    let row = f / params.rank;
    let j = f % params.rank;
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (var c = 0u; c < params.dim; c = c + 1u) {
        acc[c & 7u] = acc[c & 7u] + basis_t[j * params.dim + c] * vecs[row * params.dim + c];
    }
    proj[f] = combine8(acc);
}

@compute @workgroup_size(64)
fn scales_of(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = item_index(wid, nwg, lid);
    if (row >= params.items) {
        return;
    }
    var top = 0.0;
    for (var j = 0u; j < params.rank; j = j + 1u) {
        top = max(top, abs(proj[row * params.rank + j]));
    }
    raw_scales[row] = top / params.half;
}

@compute @workgroup_size(64)
fn encode(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let w = item_index(wid, nwg, lid);
    if (w >= params.items) {
        return;
    }
    let total = params.cols * params.rank;
    var word = 0u;
    for (var t = 0u; t < 4u; t = t + 1u) {
        let f = 4u * w + t;
        if (f < total) {
            let sc = scales[f / params.rank];
            var v = 0.0;
            if (sc > 0.0) {
                v = proj[f] / sc;
            }
            let code = clamp(floor(v + params.half + 0.5), 0.0, params.top);
            word = word | (u32(code) << (8u * t));
        }
    }
    codes_out[w] = word;
}

@compute @workgroup_size(64)
fn decode(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let f = item_index(wid, nwg, lid);
    if (f >= params.items) {
        return;
    }
    let row = f / params.dim;
    let c = f % params.dim;
    var acc = 0.0;
    for (var j = 0u; j < params.rank; j = j + 1u) {
        acc = acc + basis_t[j * params.dim + c] * side_value(row, j);
    }
    values_out[f] = acc;
}

@compute @workgroup_size(64)
fn correction(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let f = item_index(wid, nwg, lid);
    if (f >= params.items) {
        return;
    }
    let i = f / params.cols;
    let j = f % params.cols;
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (var l = 0u; l < params.rank; l = l + 1u) {
        acc[l & 7u] = acc[l & 7u] + qproj[i * params.rank + l] * side_value(j, l);
    }
    values_out[f] = combine8(acc);
}
