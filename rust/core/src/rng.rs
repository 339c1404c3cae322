//! The one seeded generator of kvqrs: Philox4x32-10 used as a counter-based stream
//! (docs/kernels.md section 1). Only 32-bit integer operations are needed, so a WGSL shader can
//! reproduce every word exactly; Gaussians go through float64 Box-Muller and round to float32.

use crate::error::{KvqError, Result};

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Stream tag of the rotation sign vector.
pub const STREAM_ROTATION_SIGNS: u32 = 1;
/// Stream tag of the QJL Gaussian matrix.
pub const STREAM_QJL_MATRIX: u32 = 2;
/// Stream tag of the random orthonormal basis (HeadQ control).
pub const STREAM_RANDOM_BASIS: u32 = 3;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// Philox4x32 with 10 rounds (Salmon et al., SC'11; Random123 constants).
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Word `index` of stream `stream` under `seed`.
#[inline]
pub fn word(seed: u64, stream: u32, index: u64) -> u32 {
    let block = index / 4;
    let lane = (index % 4) as usize;
    let counter = [block as u32, (block >> 32) as u32, stream, 0];
    philox4x32_10(counter, [seed as u32, (seed >> 32) as u32])[lane]
}

/// Fills `out` with the words `start .. start + out.len()` of a stream, one Philox call per
/// block of four words.
pub fn fill_words(seed: u64, stream: u32, start: u64, out: &mut [u32]) {
    let key = [seed as u32, (seed >> 32) as u32];
    let mut i = 0usize;
    while i < out.len() {
        let index = start + i as u64;
        let block = index / 4;
        let block_words = philox4x32_10([block as u32, (block >> 32) as u32, stream, 0], key);
        let mut lane = (index % 4) as usize;
        while lane < 4 && i < out.len() {
            out[i] = block_words[lane];
            lane += 1;
            i += 1;
        }
    }
}

/// The rotation sign vector: `+1` where the word's top bit is 0, `-1` otherwise.
pub fn rotation_signs(seed: u64, dim: usize) -> Vec<f32> {
    let mut words = vec![0u32; dim];
    fill_words(seed, STREAM_ROTATION_SIGNS, 0, &mut words);
    words
        .iter()
        .map(|w| if w >> 31 == 0 { 1.0 } else { -1.0 })
        .collect()
}

/// Box-Muller on two words, evaluated in float64 and rounded to float32.
#[inline]
pub fn box_muller(w1: u32, w2: u32) -> f32 {
    const TWO_M24: f64 = 1.0 / 16_777_216.0;
    let u1 = (f64::from(w1 >> 8) + 0.5) * TWO_M24;
    let u2 = f64::from(w2 >> 8) * TWO_M24;
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// Gaussian entries `0 .. count` of a stream (entry `e` uses words `2e` and `2e + 1`).
pub fn gaussians(seed: u64, stream: u32, count: usize) -> Vec<f32> {
    let mut words = vec![0u32; 2 * count];
    fill_words(seed, stream, 0, &mut words);
    words
        .chunks_exact(2)
        .map(|w| box_muller(w[0], w[1]))
        .collect()
}

/// The QJL matrix `S` (m x dim, row-major) of i.i.d. N(0, 1) entries.
pub fn qjl_matrix(seed: u64, m: usize, dim: usize) -> Vec<f32> {
    gaussians(seed, STREAM_QJL_MATRIX, m * dim)
}

/// A seeded random orthonormal basis (head_dim x rank, row-major float32): Gaussian entries of
/// stream 3 orthonormalised by modified Gram-Schmidt in float64.
pub fn random_orthonormal_basis(seed: u64, head_dim: usize, rank: usize) -> Result<Vec<f32>> {
    crate::kernels::check_row_len("head_dim", head_dim)?;
    crate::kernels::check_matrix("head_dim * rank", head_dim, rank)?;
    if rank == 0 || rank > head_dim {
        return Err(KvqError::InvalidDimension {
            arg: "rank",
            expected: format!("1 <= rank <= head_dim = {head_dim}"),
            actual: rank as i64,
        });
    }
    let g = gaussians(seed, STREAM_RANDOM_BASIS, head_dim * rank);
    // Column-major float64 copy: columns are what Gram-Schmidt works on.
    let mut cols: Vec<Vec<f64>> = (0..rank)
        .map(|j| (0..head_dim).map(|i| f64::from(g[i * rank + j])).collect())
        .collect();
    for j in 0..rank {
        let (done, rest) = cols.split_at_mut(j);
        let col = &mut rest[0];
        for prev in done.iter() {
            let proj: f64 = prev.iter().zip(col.iter()).map(|(a, b)| a * b).sum();
            col.iter_mut().zip(prev).for_each(|(c, p)| *c -= proj * p);
        }
        let norm = col.iter().map(|v| v * v).sum::<f64>().sqrt();
        col.iter_mut().for_each(|c| *c /= norm);
    }
    let mut out = vec![0.0f32; head_dim * rank];
    for (j, col) in cols.iter().enumerate() {
        for (i, v) in col.iter().enumerate() {
            out[i * rank + j] = *v as f32;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
    }

    #[test]
    fn fill_words_matches_word() {
        let mut out = vec![0u32; 11];
        fill_words(42, 7, 3, &mut out);
        for (i, w) in out.iter().enumerate() {
            assert_eq!(*w, word(42, 7, 3 + i as u64));
        }
    }

    #[test]
    fn gaussians_have_unit_variance() {
        let g = gaussians(1, STREAM_QJL_MATRIX, 200_000);
        let mean = g.iter().map(|&v| f64::from(v)).sum::<f64>() / g.len() as f64;
        let var = g
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / g.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }

    #[test]
    fn random_basis_is_orthonormal() {
        let (d, r) = (40, 6);
        let u = random_orthonormal_basis(9, d, r).unwrap();
        for a in 0..r {
            for b in 0..r {
                let s: f64 = (0..d)
                    .map(|i| f64::from(u[i * r + a]) * f64::from(u[i * r + b]))
                    .sum();
                let want = if a == b { 1.0 } else { 0.0 };
                assert!((s - want).abs() < 1e-6);
            }
        }
    }
}
