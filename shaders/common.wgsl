// kvqrs shared WGSL piece: common.wgsl (no bindings, no entry points).
//
// WGSL has no #include: kvqrs.gpu composes every kernel shader as
//   common.wgsl + [philox.wgsl] + <kernel>.wgsl
// following the "kvqrs:requires" line at the top of each kernel file.
//
// Dispatch convention shared by every kernel entry point: workgroups of WG = 64 invocations
// along x; the host dispatches ceil(items / 64) workgroups laid out on a 2-D grid
// (x <= 65535, y = ceil(workgroups / 65535)), and each invocation handles the item
// item_index(...) (a value, a word, a row or a pair, as the kernel header says), returning
// early when it is >= the item count of the call.

const WG: u32 = 64u;

fn item_index(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

// The fixed combining tree of the eight strided accumulators (docs/kernels.md section 8):
// ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)).
fn combine8(a: array<f32, 8>) -> f32 {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Byte k of a byte array stored as little-endian u32 words.
fn byte_of(word: u32, k: u32) -> u32 {
    return (word >> ((k & 3u) * 8u)) & 0xffu;
}
