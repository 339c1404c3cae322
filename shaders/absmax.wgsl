// kvqrs:requires common.wgsl
//
// absmax.wgsl: symmetric per-row absmax codes (docs/kernels.md section 14), float32 as in
// rust/core/src/kernels/absmax.rs. Each row holds d coordinates; coordinate i has a bit width
// w_i in 0..8 (0: not coded) and the top code L_i = 2^w_i - 1.
//
//   absmax  per row: a = max |x_i| over the coded coordinates (0 when none is coded); the host
//           rounds a to float16 (round to nearest even, as the Rust path does; an error if that
//           is infinite) between `absmax` and `encode`
//   encode  code = clamp(floor(((x / s + 1) * 0.5) * L + 0.5), 0, L) with the STORED s (u = 0
//           when s = 0); code 0 in the uncoded coordinates
//   decode  x_hat = level * s, level = (2 code - L) / L read from a table the host computes in
//           float32 (the Rust path's division, correctly rounded): bit for bit the Rust path's,
//           as WGSL's f32 multiply is correctly rounded; the table's width-0 entry is 0, so the
//           uncoded coordinates decode to 0 * s = 0
// The maximum is exact; the division x / s is not required to be correctly rounded in WGSL
// (2.5 ulp), and a driver may contract ((u + 1) * 0.5) * L + 0.5 into an FMA, so a code can differ
// from the Rust path's only where t + 0.5 lies within rounding of an integer.
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, d: u32, values: u32 }    values = rows * d
//   1  storage, read        x: array<f32>           absmax / encode: rows * d
//   2  storage, read_write  absmax_out: array<f32>  absmax: rows
//   3  storage, read        scales: array<f32>      encode / decode: rows stored scales as float32
//   4  storage, read        tops: array<f32>        absmax / encode: d top codes L_i as float32
//   5  storage, read_write  codes_out: array<u32>   encode: rows * d code bytes, 4 per word
//   6  storage, read        codes_in: array<u32>    decode: rows * d code bytes
//   7  storage, read        levels: array<f32>      decode: 511 levels, width w at 2^w - 1 + code
//   8  storage, read        bases: array<u32>       decode: d table offsets 2^w_i - 1
//   9  storage, read_write  values_out: array<f32>  decode: rows * d
//
// Entry points and grid (common.wgsl's 2-D grid of 64-wide groups):
//   absmax  one invocation per row: items = rows
//   encode  one invocation per word of 4 codes: items = ceil(rows * d / 4)
//   decode  one invocation per value: items = rows * d

struct Params {
    items: u32,
    d: u32,
    values: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> absmax_out: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> tops: array<f32>;
@group(0) @binding(5) var<storage, read_write> codes_out: array<u32>;
@group(0) @binding(6) var<storage, read> codes_in: array<u32>;
@group(0) @binding(7) var<storage, read> levels: array<f32>;
@group(0) @binding(8) var<storage, read> bases: array<u32>;
@group(0) @binding(9) var<storage, read_write> values_out: array<f32>;

@compute @workgroup_size(64)
fn absmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = item_index(wid, nwg, lid);
    if (row >= params.items) {
        return;
    }
    var a = 0.0;
    for (var i = 0u; i < params.d; i = i + 1u) {
        if (tops[i] > 0.0) {
            a = max(a, abs(x[row * params.d + i]));
        }
    }
    absmax_out[row] = a;
}

@compute @workgroup_size(64)
fn encode(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let w = item_index(wid, nwg, lid);
    if (w >= params.items) {
        return;
    }
    var word = 0u;
    for (var k = 0u; k < 4u; k = k + 1u) {
        let f = 4u * w + k;
        if (f < params.values) {
            let top = tops[f % params.d];
            if (top > 0.0) {
                let s = scales[f / params.d];
                var u = 0.0;
                if (s > 0.0) {
                    u = x[f] / s;
                }
                let t = ((u + 1.0) * 0.5) * top;
                word = word | (u32(clamp(floor(t + 0.5), 0.0, top)) << (8u * k));
            }
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
    let level = levels[bases[f % params.d] + byte_of(codes_in[f >> 2u], f)];
    values_out[f] = level * scales[f / params.d];
}
