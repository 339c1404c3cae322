// kvqrs:requires common.wgsl
//
// pack.wgsl: bit packing of b-bit codes, 1 <= b <= 8 (docs/kernels.md section 2).
// Code i of a row occupies bits i*b .. i*b+b-1 of the row's little-endian bit stream (bit 0 =
// least significant bit of byte 0); every row starts on a byte boundary; unused high bits of a
// row's last byte are zero. Same bytes as rust/core/src/kernels/pack.rs.
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, rows: u32, count: u32, bits: u32, row_bytes: u32 }
//               count = codes per row, row_bytes = ceil(count * bits / 8)
//   1  storage, read        codes_in: array<u32>   pack: rows * count code bytes, flat,
//                                                   4 bytes per little-endian word
//   2  storage, read_write  packed_out: array<u32> pack: rows * row_bytes bytes, flat
//   3  storage, read        packed_in: array<u32>  unpack: rows * row_bytes bytes, flat
//   4  storage, read_write  codes_out: array<u32>  unpack: rows * count code bytes, flat
// Byte buffers are padded on the host to a whole number of words.
//
// Entry points and grid (common.wgsl's 2-D grid of 64-wide groups):
//   pack    one invocation per output word: items = ceil(rows * row_bytes / 4). Rows may
//           straddle words; no two invocations write the same word, so no atomics.
//   unpack  one invocation per output word of codes: items = ceil(rows * count / 4).
// Codes are range-checked on the host before packing (a code >= 2^b is an error there).

struct Params {
    items: u32,
    rows: u32,
    count: u32,
    bits: u32,
    row_bytes: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> codes_in: array<u32>;
@group(0) @binding(2) var<storage, read_write> packed_out: array<u32>;
@group(0) @binding(3) var<storage, read> packed_in: array<u32>;
@group(0) @binding(4) var<storage, read_write> codes_out: array<u32>;

fn code_at(flat: u32) -> u32 {
    return byte_of(codes_in[flat >> 2u], flat);
}

// Byte j of row `row` of the packed stream: bits 8j .. 8j+7 of the row.
fn packed_byte(row: u32, j: u32) -> u32 {
    let b = params.bits;
    let bit0 = j * 8u;
    let first = bit0 / b;
    let last = min((bit0 + 7u) / b, params.count - 1u);
    var v = 0u;
    for (var i = first; i <= last; i = i + 1u) {
        let c = code_at(row * params.count + i);
        let pos = i * b;
        if (pos >= bit0) {
            v = v | (c << (pos - bit0));
        } else {
            v = v | (c >> (bit0 - pos));
        }
    }
    return v & 0xffu;
}

@compute @workgroup_size(64)
fn pack(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let w = item_index(wid, nwg, lid);
    if (w >= params.items) {
        return;
    }
    let total = params.rows * params.row_bytes;
    var word = 0u;
    for (var t = 0u; t < 4u; t = t + 1u) {
        let k = 4u * w + t;
        if (k < total) {
            word = word | (packed_byte(k / params.row_bytes, k % params.row_bytes) << (8u * t));
        }
    }
    packed_out[w] = word;
}

fn packed_in_byte(k: u32) -> u32 {
    return byte_of(packed_in[k >> 2u], k);
}

@compute @workgroup_size(64)
fn unpack(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let w = item_index(wid, nwg, lid);
    if (w >= params.items) {
        return;
    }
    let total = params.rows * params.count;
    let mask = (1u << params.bits) - 1u;
    var word = 0u;
    for (var t = 0u; t < 4u; t = t + 1u) {
        let f = 4u * w + t;
        if (f < total) {
            let row = f / params.count;
            let pos = (f % params.count) * params.bits;
            let k = row * params.row_bytes + pos / 8u;
            var two = packed_in_byte(k);
            // A code spans at most two bytes (b <= 8); the second one exists only inside the row.
            if ((pos % 8u) + params.bits > 8u) {
                two = two | (packed_in_byte(k + 1u) << 8u);
            }
            word = word | (((two >> (pos % 8u)) & mask) << (8u * t));
        }
    }
    codes_out[w] = word;
}
