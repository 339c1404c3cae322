// kvqrs shared WGSL piece: philox.wgsl (no bindings, no entry points).
//
// Philox4x32-10 (Salmon et al., SC'11) with the Random123 constants, bit for bit as
// docs/kernels.md section 1 and rust/core/src/rng.rs. WGSL has no 64-bit integers, so the
// 32 x 32 -> 64-bit products are assembled from 16-bit halves (u32 arithmetic wraps in WGSL).

const PHILOX_M0: u32 = 0xD2511F53u;
const PHILOX_M1: u32 = 0xCD9E8D57u;
const PHILOX_W0: u32 = 0x9E3779B9u;
const PHILOX_W1: u32 = 0xBB67AE85u;

// (hi, lo) words of the 64-bit product a * b.
fn mulhilo32(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    // Bits 16..47 of the product, before the carry into the high word: < 3 * 2^16 + 2^16.
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    let lo = (mid << 16u) | (p00 & 0xffffu);
    return vec2<u32>(hi, lo);
}

fn philox4x32_10(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {
    var c = counter;
    var k = key;
    for (var r = 0u; r < 10u; r = r + 1u) {
        if (r > 0u) {
            k = k + vec2<u32>(PHILOX_W0, PHILOX_W1);
        }
        let p0 = mulhilo32(PHILOX_M0, c.x);
        let p1 = mulhilo32(PHILOX_M1, c.z);
        c = vec4<u32>(p1.x ^ c.y ^ k.x, p1.y, p0.x ^ c.w ^ k.y, p0.y);
    }
    return c;
}

// word(seed, stream, index) of docs/kernels.md section 1 for a word index below 2^32
// (block = index / 4 < 2^30, so the counter's second word is 0).
fn philox_word(seed: vec2<u32>, stream: u32, index: u32) -> u32 {
    let block = philox4x32_10(vec4<u32>(index >> 2u, 0u, stream, 0u), seed);
    return block[index & 3u];
}
