//! Native encoders of a layer store's two sides: a cache flushing tokens out of its
//! full-precision window encodes them and appends the codes in one call
//! ([`LayerStore::encode_append`]), with no per-part objects between the kernels and the
//! store. Each encoder is the kernel composition its Python coder runs on the Rust path
//! (`MSECoder`, `MSEQJLCoder` in python/kvqrs/schemes/mse.py), so the stored bytes are the same.

use crate::error::{KvqError, Result};
use crate::format::Dtype;
use crate::kernels::mse::MseQuantizer;
use crate::kernels::mse_qjl::MseQjlEncoder;
use crate::scalars::ScalarPlane;
use crate::store::{ChunkPart, LayerStore};

/// The encoder of one side (keys or values) of a layer store.
#[derive(Debug, Clone)]
pub enum SideEncoder {
    /// `kv` / `kqv`: packed MSE codes and norms (parts `codes`, `norms`).
    Mse(MseQuantizer),
    /// `kqv` values, `qkqv`: the MSE stage and the QJL sketch of its residual (parts `codes`,
    /// `norms`, `qjl_signs`, `qjl_norms`).
    MseQjl(MseQjlEncoder),
}

/// One encoded part: its name within the side, dtype and C-order bytes.
type EncodedPart = (&'static str, Dtype, Vec<u8>);

fn plane_part(name: &'static str, plane: ScalarPlane) -> EncodedPart {
    match plane {
        ScalarPlane::F16(v) => (
            name,
            Dtype::F16,
            v.iter().flat_map(|h| h.to_le_bytes()).collect(),
        ),
        ScalarPlane::F32(v) => (
            name,
            Dtype::F32,
            v.iter().flat_map(|f| f.to_le_bytes()).collect(),
        ),
    }
}

impl SideEncoder {
    /// Encodes rows of head_dim values; returns the side's parts, in its layout's order, each
    /// holding one entry (row of bytes, or scalar) per input row. Errors as the kernels.
    pub fn encode(&self, x: &[f32]) -> Result<Vec<EncodedPart>> {
        Ok(match self {
            SideEncoder::Mse(q) => {
                let (packed, norms) = q.encode_packed(x)?;
                vec![("codes", Dtype::U8, packed), plane_part("norms", norms)]
            }
            SideEncoder::MseQjl(e) => {
                let c = e.encode(x)?;
                vec![
                    ("codes", Dtype::U8, c.packed),
                    plane_part("norms", c.norms),
                    ("qjl_signs", Dtype::U8, c.sketch.signs),
                    plane_part("qjl_norms", c.sketch.norms),
                ]
            }
        })
    }
}

impl LayerStore {
    /// Encodes `tokens` new tokens of every (batch, head) row, keys `k` and values `v`
    /// (`(batch, kv_heads, tokens, head_dim)` float32, C order), and appends their codes: the
    /// store's parts must be `keys.<part>` and `values.<part>` of the two encoders, one entry
    /// per token. Both sides are encoded before anything is stored, so an error (non-finite
    /// rows, a norm beyond float32, parts that do not match) leaves the store unchanged.
    pub fn encode_append(
        &mut self,
        keys: (&SideEncoder, &[f32]),
        values: (&SideEncoder, &[f32]),
        tokens: usize,
    ) -> Result<()> {
        let mut named: Vec<(String, Dtype, Vec<u8>)> = Vec::new();
        for (side, (enc, x)) in [("keys", keys), ("values", values)] {
            for (name, dtype, bytes) in enc.encode(x)? {
                named.push((format!("{side}.{name}"), dtype, bytes));
            }
        }
        let shapes: Vec<Vec<usize>> = self.specs().map(|s| s.shape(tokens)).collect();
        let mut chunk = Vec::with_capacity(shapes.len());
        for (spec, shape) in self.specs().zip(&shapes) {
            let part = named
                .iter()
                .find(|(n, _, _)| *n == spec.name)
                .ok_or_else(|| KvqError::ShapeMismatch {
                    arg: "encoders",
                    expected: format!("a part {}", spec.name),
                    actual: named
                        .iter()
                        .map(|p| p.0.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
            chunk.push(ChunkPart {
                dtype: part.1,
                shape,
                bytes: &part.2,
            });
        }
        if named.len() != chunk.len() {
            return Err(KvqError::ShapeMismatch {
                arg: "encoders",
                expected: format!("{} parts", chunk.len()),
                actual: format!("{}", named.len()),
            });
        }
        self.append(&chunk, tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::hadamard::padded_dim;
    use crate::store::PartSpec;

    fn spec(name: &str, dtype: Dtype, widen: bool, inner: Vec<usize>) -> PartSpec {
        PartSpec {
            name: name.into(),
            dtype,
            widen,
            outer: vec![2, 3],
            inner,
            num: 1,
            den: 1,
        }
    }

    fn kqv_store(d: usize, kbits: u32, vbits: u32) -> LayerStore {
        let cd = padded_dim(d);
        LayerStore::new(vec![
            spec(
                "keys.codes",
                Dtype::U8,
                false,
                vec![cd * kbits as usize / 8],
            ),
            spec("keys.norms", Dtype::F16, true, vec![]),
            spec(
                "values.codes",
                Dtype::U8,
                false,
                vec![cd * (vbits - 1) as usize / 8],
            ),
            spec("values.norms", Dtype::F16, true, vec![]),
            spec("values.qjl_signs", Dtype::U8, false, vec![cd / 8]),
            spec("values.qjl_norms", Dtype::F16, true, vec![]),
        ])
        .unwrap()
    }

    fn rows(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    /// The token-major chunk of `t` tokens from rows ordered (batch, head, token).
    fn encode_then_append(
        store: &mut LayerStore,
        k: &SideEncoder,
        v: &SideEncoder,
        kx: &[f32],
        vx: &[f32],
        t: usize,
    ) {
        let mut parts = k.encode(kx).unwrap();
        parts.extend(v.encode(vx).unwrap());
        let shapes: Vec<Vec<usize>> = store.specs().map(|s| s.shape(t)).collect();
        let chunk: Vec<ChunkPart> = parts
            .iter()
            .zip(&shapes)
            .map(|((_, dtype, bytes), shape)| ChunkPart {
                dtype: *dtype,
                shape,
                bytes,
            })
            .collect();
        store.append(&chunk, t).unwrap();
    }

    #[test]
    fn encode_append_equals_encoding_then_appending() {
        let d = 64;
        let k = SideEncoder::Mse(MseQuantizer::new(d, 4, Some(5)).unwrap());
        let v = SideEncoder::MseQjl(MseQjlEncoder::new(d, 4, 6, 7).unwrap());
        let (mut a, mut b) = (kqv_store(d, 4, 4), kqv_store(d, 4, 4));
        for (step, t) in [3usize, 1, 1, 4].into_iter().enumerate() {
            let (kx, vx) = (
                rows(6 * t * d, step as u32),
                rows(6 * t * d, 99 + step as u32),
            );
            a.encode_append((&k, &kx), (&v, &vx), t).unwrap();
            encode_then_append(&mut b, &k, &v, &kx, &vx, t);
        }
        assert_eq!(a.tokens(), 9);
        for i in 0..6 {
            assert_eq!(a.part(i), b.part(i));
        }
    }

    #[test]
    fn a_failed_encode_stores_nothing() {
        let d = 64;
        let k = SideEncoder::Mse(MseQuantizer::new(d, 4, Some(5)).unwrap());
        let v = SideEncoder::MseQjl(MseQjlEncoder::new(d, 4, 6, 7).unwrap());
        let mut store = kqv_store(d, 4, 4);
        let kx = rows(6 * d, 1);
        let mut vx = rows(6 * d, 2);
        vx[70] = f32::NAN;
        assert!(store.encode_append((&k, &kx), (&v, &vx), 1).is_err());
        assert_eq!(store.tokens(), 0);
        // Keys and values swapped: the parts do not match the store's.
        assert!(store.encode_append((&v, &kx), (&k, &kx), 1).is_err());
        assert_eq!(store.tokens(), 0);
    }
}
