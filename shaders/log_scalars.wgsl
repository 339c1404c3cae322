// kvqrs:requires common.wgsl
//
// log_scalars.wgsl: log-coded scalars (docs/kernels.md section 13), the same bytes and floats
// as rust/core/src/kernels/log_scalars.rs. Non-negative finite float32 values (checked on the
// host) in 8 bits each on a grid of 1/16 octave, one exponent byte per group of `group`
// consecutive values of a row (the last group may be shorter).
//
//   grid index  r(v) = 16 (E - 127) + #{k : m >= T_k} from the float32 bits of v (biased
//               exponent E, mantissa m with the exponent of 1.0), integer and comparison
//               operations only; none for zero and subnormals (E = 0). The values are read as
//               their u32 bit patterns (what bitcast<u32> of each float32 gives), so no float
//               operation, which a driver may flush to zero, touches a subnormal. The sign bit
//               is ignored: -0.0 is zero, as the oracle and the definition have it.
//   exponents   b = clamp(floor(max r / 16) + 127, 16, 254) per (row, group); 127 when no
//               value of the group has an index. Its top level is e = 16 (b - 127) + 15.
//   encode      c = e - r, 0 when negative (the clamp lowered b); 254 for 254 < c <= 270;
//               255 (zero) beyond, and for values without an index.
//   decode      k = e - c: bits of L_(k mod 16) plus floor(k / 16) in the exponent field
//               (an exact exponent shift: every level is a normal float32); 0.0 for c = 255.
// THRESHOLDS (T_k, the smallest float32 >= 2^((k + 0.5) / 16)) and LEVELS (L_j, the float32
// nearest 2^(j / 16)) are the Rust tables' bit patterns.
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, n: u32, group: u32, groups: u32, values: u32, exps: u32 }
//               groups = ceil(n / group), values = rows * n, exps = rows * groups
//   1  storage, read        values_in: array<u32>   exponents / encode: rows * n float32 bits
//   2  storage, read_write  exps_out: array<u32>    exponents: rows * groups bytes, 4 per word
//   3  storage, read        exps_in: array<u32>     encode / decode: rows * groups bytes
//   4  storage, read_write  codes_out: array<u32>   encode: rows * n code bytes, 4 per word
//   5  storage, read        codes_in: array<u32>    decode: rows * n code bytes
//   6  storage, read_write  values_out: array<u32>  decode: rows * n float32 bits
//
// Entry points and grid (common.wgsl's 2-D grid of 64-wide groups):
//   exponents  one invocation per word of 4 exponent bytes: items = ceil(rows * groups / 4);
//              it loops over 4 groups (the host keeps group <= 8192 values)
//   encode     one invocation per word of 4 codes: items = ceil(rows * n / 4), after
//              `exponents` (its exps_out bound as exps_in)
//   decode     one invocation per value: items = rows * n

struct Params {
    items: u32,
    n: u32,
    group: u32,
    groups: u32,
    values: u32,
    exps: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> values_in: array<u32>;
@group(0) @binding(2) var<storage, read_write> exps_out: array<u32>;
@group(0) @binding(3) var<storage, read> exps_in: array<u32>;
@group(0) @binding(4) var<storage, read_write> codes_out: array<u32>;
@group(0) @binding(5) var<storage, read> codes_in: array<u32>;
@group(0) @binding(6) var<storage, read_write> values_out: array<u32>;

const LOG_THRESHOLDS = array<u32, 16>(
    0x3f82cd87u, 0x3f88980fu, 0x3f8ea43au, 0x3f94f4f0u, 0x3f9b8d3au, 0x3fa27044u, 0x3fa9a15bu, 0x3fb123f6u,
    0x3fb8fbb0u, 0x3fc12c4du, 0x3fc9b9beu, 0x3fd2a81eu, 0x3fdbfbb8u, 0x3fe5b907u, 0x3fefe4bau, 0x3ffa83b3u,
);
const LOG_LEVELS = array<u32, 16>(
    0x3f800000u, 0x3f85aac3u, 0x3f8b95c2u, 0x3f91c3d3u, 0x3f9837f0u, 0x3f9ef532u, 0x3fa5fed7u, 0x3fad583fu,
    0x3fb504f3u, 0x3fbd08a4u, 0x3fc5672au, 0x3fce248cu, 0x3fd744fdu, 0x3fe0ccdfu, 0x3feac0c7u, 0x3ff5257du,
);
const LOG_BIAS: i32 = 127;
const LOG_EXP_MIN: i32 = 16;
const LOG_EXP_MAX: i32 = 254;
const LOG_LOWEST: i32 = 254;
const LOG_ZERO: u32 = 255u;
// Below every grid index (the smallest is 16 * -126 = -2016): "no index".
const NO_INDEX: i32 = -65536;

// round(16 log2 v) of the float32 with bits `bits`, or NO_INDEX for zero and subnormals.
fn grid_index(bits: u32) -> i32 {
    let a = bits & 0x7fffffffu;
    let biased = a >> 23u;
    if (biased == 0u) {
        return NO_INDEX;
    }
    let m = (a & 0x007fffffu) | 0x3f800000u;
    var thresholds = LOG_THRESHOLDS;
    var j = 0;
    for (var k = 0u; k < 16u; k = k + 1u) {
        j = j + select(0, 1, m >= thresholds[k]);
    }
    return 16 * (i32(biased) - LOG_BIAS) + j;
}

// Grid index of the top level of exponent byte b: 16 (b - 127) + 15.
fn top_of(b: u32) -> i32 {
    return 16 * (i32(b) - LOG_BIAS) + 15;
}

// Index of the (row, group) pair of flat value f.
fn group_of(f: u32) -> u32 {
    return (f / params.n) * params.groups + (f % params.n) / params.group;
}

// Exponent byte of the flat (row, group) pair g.
fn exp_byte(g: u32) -> u32 {
    return byte_of(exps_in[g >> 2u], g);
}

@compute @workgroup_size(64)
fn exponents(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let w = item_index(wid, nwg, lid);
    if (w >= params.items) {
        return;
    }
    var word = 0u;
    for (var t = 0u; t < 4u; t = t + 1u) {
        let g = 4u * w + t;
        if (g < params.exps) {
            let base = (g / params.groups) * params.n;
            let start = (g % params.groups) * params.group;
            let end = min(start + params.group, params.n);
            var largest = NO_INDEX;
            for (var i = start; i < end; i = i + 1u) {
                largest = max(largest, grid_index(values_in[base + i]));
            }
            var b = u32(LOG_BIAS);
            if (largest != NO_INDEX) {
                // `>>` on i32 is arithmetic: floor(largest / 16).
                b = u32(clamp((largest >> 4u) + LOG_BIAS, LOG_EXP_MIN, LOG_EXP_MAX));
            }
            word = word | (b << (8u * t));
        }
    }
    exps_out[w] = word;
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
            let r = grid_index(values_in[f]);
            var code = LOG_ZERO;
            if (r != NO_INDEX) {
                let c = top_of(exp_byte(group_of(f))) - r;
                if (c <= LOG_LOWEST) {
                    code = u32(max(c, 0));
                } else if (c <= LOG_LOWEST + 16) {
                    code = u32(LOG_LOWEST);
                }
            }
            word = word | (code << (8u * t));
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
    let c = byte_of(codes_in[f >> 2u], f);
    if (c == LOG_ZERO) {
        values_out[f] = 0u;
        return;
    }
    let k = top_of(exp_byte(group_of(f))) - i32(c);
    var levels = LOG_LEVELS;
    // k & 15 is k mod 16 and k >> 4 is floor(k / 16) for negative k too (two's complement);
    // the u32 sum wraps exactly as the Rust path's i32 sum.
    values_out[f] = levels[u32(k & 15)] + (bitcast<u32>(k >> 4u) << 23u);
}
