// kvqrs:requires common.wgsl
//
// lloyd_max.wgsl: Lloyd-Max encode and decode (docs/kernels.md section 4), and the
// direction step of the MSE stage (section 5, steps 3-4). The codebook itself (centroids and
// boundaries of the sphere marginal, a float64 Lloyd iteration) is computed on the host by the
// Rust path, rounded once to float32 and uploaded once per (d', bits).
//
//   encode:  code = #{j : boundary_j <= v} (binary search over the float32 boundaries; a value
//            equal to a boundary goes up), with v = x, or v = x / norm_row when has_norms = 1
//            (a zero norm gives v = 0). Comparisons are exact, so codes equal the Rust path's
//            for the same float32 v. The division is not required to be correctly rounded in
//            WGSL (2.5 ulp), which moves a code only within a few ulps of a boundary.
//   decode:  v = centroids[code], times norm_row when has_norms = 1 (one float32 product: the
//            MSE decoder without a rotation).
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, row_len: u32, levels: u32, has_norms: u32, values: u32 }
//               levels = 2^bits, values = number of values
//   1  storage, read        x: array<f32>          encode input, items values (rows * row_len)
//   2  storage, read        table: array<f32>      encode: levels - 1 boundaries;
//                                                   decode: levels centroids
//   3  storage, read        norms: array<f32>      one per row (unused when has_norms = 0)
//   4  storage, read_write  codes_out: array<u32>  encode: items code bytes, 4 per word
//   5  storage, read        codes_in: array<u32>   decode: items code bytes, 4 per word
//   6  storage, read_write  values_out: array<f32> decode: items values
//
// Entry points and grid (common.wgsl's 2-D grid of 64-wide groups):
//   encode  one invocation per output word of 4 codes: items = ceil(values / 4)
//   decode  one invocation per value: items = values

struct Params {
    items: u32,
    row_len: u32,
    levels: u32,
    has_norms: u32,
    values: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read> norms: array<f32>;
@group(0) @binding(4) var<storage, read_write> codes_out: array<u32>;
@group(0) @binding(5) var<storage, read> codes_in: array<u32>;
@group(0) @binding(6) var<storage, read_write> values_out: array<f32>;

// Number of boundaries <= v (partition point of the ascending float32 boundaries).
fn bucketize(v: f32) -> u32 {
    var lo = 0u;
    var hi = params.levels - 1u;
    while (lo < hi) {
        let mid = (lo + hi) / 2u;
        if (table[mid] <= v) {
            lo = mid + 1u;
        } else {
            hi = mid;
        }
    }
    return lo;
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
            var v = x[f];
            if (params.has_norms == 1u) {
                let n = norms[f / params.row_len];
                v = select(0.0, v / n, n > 0.0);
            }
            word = word | (bucketize(v) << (8u * t));
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
    var v = table[byte_of(codes_in[f >> 2u], f)];
    if (params.has_norms == 1u) {
        v = v * norms[f / params.row_len];
    }
    values_out[f] = v;
}
