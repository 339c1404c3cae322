// kvqrs:requires common.wgsl
//
// uniform.wgsl: the asymmetric min-max uniform quantizer of KIVI (docs/schemes.md; docs/kernels.md
// section 9), float32 as in rust/core/src/kernels/uniform.rs. Each row of n values is cut into
// consecutive groups of `group` values (the last may be shorter).
//
//   ranges  per (row, group): zero = min, raw_scale = (max - min) / (2^b - 1)
//   encode  code = clamp(floor((x - z) / s + 0.5), 0, 2^b - 1) with the STORED s and z (the
//           host picks float16 or float32 storage for each plane, as the Rust path does,
//           between `ranges` and `encode`); code 0 when s = 0
//   decode  x_hat = z + s * code
// min, max and the subtraction are exact; the divisions are not required to be correctly
// rounded in WGSL (2.5 ulp), so a code can differ from the Rust path's only where
// (x - z) / s + 0.5 lies within rounding of an integer. A driver may contract z + s * code
// into an FMA (lavapipe does not), a one-rounding difference of the decoded value.
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, n: u32, group: u32, groups: u32, top: f32, values: u32 }
//               groups = ceil(n / group), top = 2^b - 1, values = rows * n
//   1  storage, read        x: array<f32>          rows * n
//   2  storage, read_write  ranges_out: array<f32> ranges: 2 * rows * groups (scale, zero)
//   3  storage, read        stored: array<f32>     encode / decode: 2 * rows * groups
//                                                   (stored scale, stored zero) as float32
//   4  storage, read_write  codes_out: array<u32>  encode: rows * n code bytes, 4 per word
//   5  storage, read        codes_in: array<u32>   decode: rows * n code bytes
//   6  storage, read_write  values_out: array<f32> decode: rows * n
//
// Entry points and grid (common.wgsl's 2-D grid of 64-wide groups):
//   ranges  one invocation per (row, group): items = rows * groups
//   encode  one invocation per word of 4 codes: items = ceil(rows * n / 4)
//   decode  one invocation per value: items = rows * n

struct Params {
    items: u32,
    n: u32,
    group: u32,
    groups: u32,
    top: f32,
    values: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> ranges_out: array<f32>;
@group(0) @binding(3) var<storage, read> stored: array<f32>;
@group(0) @binding(4) var<storage, read_write> codes_out: array<u32>;
@group(0) @binding(5) var<storage, read> codes_in: array<u32>;
@group(0) @binding(6) var<storage, read_write> values_out: array<f32>;

// Index of the (row, group) pair of flat value f.
fn group_of(f: u32) -> u32 {
    return (f / params.n) * params.groups + (f % params.n) / params.group;
}

@compute @workgroup_size(64)
fn ranges(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = item_index(wid, nwg, lid);
    if (g >= params.items) {
        return;
    }
    let row = g / params.groups;
    let start = (g % params.groups) * params.group;
    let end = min(start + params.group, params.n);
    var lo = x[row * params.n + start];
    var hi = lo;
    for (var i = start + 1u; i < end; i = i + 1u) {
        let v = x[row * params.n + i];
        lo = min(lo, v);
        hi = max(hi, v);
    }
    ranges_out[2u * g] = (hi - lo) / params.top;
    ranges_out[2u * g + 1u] = lo;
}

@compute @workgroup_size(64)
fn encode(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let w = item_index(wid, nwg, lid);
    if (w >= params.items) {
        return;
    }
    var word = 0u;
    for (var t = 0u; t < 4u; t = t + 1u) {
        let f = 4u * w + t;
        if (f < params.values) {
            let g = group_of(f);
            let sc = stored[2u * g];
            var v = 0.0;
            if (sc > 0.0) {
                v = (x[f] - stored[2u * g + 1u]) / sc;
            }
            word = word | (u32(clamp(floor(v + 0.5), 0.0, params.top)) << (8u * t));
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
    let g = group_of(f);
    values_out[f] = stored[2u * g + 1u] + stored[2u * g] * f32(byte_of(codes_in[f >> 2u], f));
}
