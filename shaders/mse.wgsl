// kvqrs:requires common.wgsl
//
// mse.wgsl: the row norm of the norm-and-direction (MSE) stage (docs/kernels.md section 5; docs/kernels.md
// section 5, step 1), also used for the QJL residual norm ||r|| (section 6). The rest of the
// MSE stage is composed on the host from the other kernels, all on the device in one
// submission: encode = norms -> hadamard.forward -> lloyd_max.encode (divided by the norm);
// decode = lloyd_max.decode -> hadamard.inverse (times the stored norm).
//
// The Rust path accumulates x_i^2 in float64 (eight strided accumulators, docs section 8) and
// rounds sqrt once to float32. WGSL has no f64, so this shader scales the row by 2^-e, with
// 2^e the binade of max|x_i| (exact: a power of two), accumulates (x_i 2^-e)^2 in float32 in
// the same eight-accumulator order, and returns sqrt(sum) * 2^e. The scaling removes overflow
// (a finite row never overflows unless its norm does); the float32 sum and the WGSL sqrt
// (not required to be correctly rounded) make the norm differ from the Rust path's by a few
// float32 ulps (stated tolerance in tests/gpu/test_gpu_mse.py), which moves a code only for a
// coordinate within ~1e-6 of a Lloyd-Max boundary.
//
// `ls_scales` is the least-squares row scale (docs/kernels.md section 5, scale
// "least_squares"): with r the decoded direction (lloyd_max.decode -> hadamard.inverse with
// scale 1, composed on the host), s = dot(x, r) / dot(r, r), both float32 dot products in the
// eight-accumulator order of section 8 (the Rust path's order: bit-identical where the driver
// does not contract a * b + c to FMA, lavapipe included), then one float32 division (WGSL:
// within 2.5 ulp); s = 0 when dot(x, r) <= 0 (a zero row).
//
// `pn_scales` is the norm-preserving row scale (scale "preserve_norm"): x holds the rows'
// norms (one per row, from `norms`), s = norm / sqrt(dot(r, r)) with dot(r, r) as above, one
// WGSL sqrt and division (each within 2.5 ulp); s = norm when dot(r, r) = 0.
//
// Bindings (group 0):
//   0  uniform  Params { items: u32, dim: u32 }
//   1  storage, read        x: array<f32>          rows * dim
//   2  storage, read_write  out_norms: array<f32>  rows (inf when the norm or scale overflows float32)
//   3  storage, read        dir: array<f32>        rows * dim (`ls_scales`, `pn_scales`)
// (`pn_scales`: binding 1 holds one norm per row.)
//
// Entry points and grid: `norms`, `ls_scales` and `pn_scales`, one invocation per row
// (items = rows).

struct Params {
    items: u32,
    dim: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out_norms: array<f32>;
@group(0) @binding(3) var<storage, read> dir: array<f32>;

@compute @workgroup_size(64)
fn norms(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = item_index(wid, nwg, lid);
    if (row >= params.items) {
        return;
    }
    let base = row * params.dim;
    var top = 0.0;
    for (var i = 0u; i < params.dim; i = i + 1u) {
        top = max(top, abs(x[base + i]));
    }
    if (top == 0.0) {
        out_norms[row] = 0.0;
        return;
    }
    // 2^-e applied in two halves: WGSL's ldexp is defined only for exponents up to 128, and
    // e ranges over -148 .. 128.
    let e = frexp(top).exp;
    let e1 = e / 2;
    let e2 = e - e1;
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (var i = 0u; i < params.dim; i = i + 1u) {
        let v = ldexp(ldexp(x[base + i], -e1), -e2);
        acc[i & 7u] = acc[i & 7u] + v * v;
    }
    out_norms[row] = ldexp(ldexp(sqrt(combine8(acc)), e1), e2);
}

@compute @workgroup_size(64)
fn ls_scales(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = item_index(wid, nwg, lid);
    if (row >= params.items) {
        return;
    }
    let base = row * params.dim;
    var num = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    var den = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (var i = 0u; i < params.dim; i = i + 1u) {
        let r = dir[base + i];
        num[i & 7u] = num[i & 7u] + x[base + i] * r;
        den[i & 7u] = den[i & 7u] + r * r;
    }
    let n = combine8(num);
    let q = combine8(den);
    var s = 0.0;
    if (n > 0.0 && q > 0.0) {
        s = n / q;
    }
    out_norms[row] = s;
}

@compute @workgroup_size(64)
fn pn_scales(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = item_index(wid, nwg, lid);
    if (row >= params.items) {
        return;
    }
    let base = row * params.dim;
    var den = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (var i = 0u; i < params.dim; i = i + 1u) {
        let r = dir[base + i];
        den[i & 7u] = den[i & 7u] + r * r;
    }
    let q = combine8(den);
    var s = x[row];
    if (q > 0.0) {
        s = s / sqrt(q);
    }
    out_norms[row] = s;
}
