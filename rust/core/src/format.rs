//! The compressed-cache container of docs/format.md: a versioned, self-describing byte format.
//!
//! ```text
//! file    = magic "KVQRSCC\0" | version u16 | section count u32 | section*     (little endian)
//! section = name length u8 | name (UTF-8) | dtype u8 | ndim u8 | shape u64 * ndim
//!           | payload length u64 | payload | CRC-32 (IEEE) of all the section's bytes before it
//! ```
//!
//! The reader trusts nothing: every length is checked against the bytes left and against the
//! shape and dtype before anything is allocated, names must be unique UTF-8, and a checksum
//! mismatch, a truncation or trailing bytes are errors (never a panic, never a partial result).
//! What the sections mean (scheme, parameters, code planes) is the Python layer's business: it
//! writes a `meta` section of UTF-8 JSON first and checks it on load.

use crate::error::{KvqError, Result};

/// First eight bytes of every container.
pub const MAGIC: &[u8; 8] = b"KVQRSCC\0";
/// Format version written (and the only one read).
pub const VERSION: u16 = 1;
/// Limits that keep a hostile header from asking for absurd work.
pub const MAX_SECTIONS: u32 = 4096;
pub const MAX_NDIM: u8 = 16;
pub const MAX_NAME_LEN: u8 = 128;

/// Element type of a section's payload: the core's one dtype ([`crate::dtype::Dtype`]), its
/// code the byte written.
pub use crate::dtype::Dtype;

/// One named, typed, shaped byte payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Section {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub payload: Vec<u8>,
}

fn corrupt(what: String) -> KvqError {
    KvqError::CorruptData { what }
}

/// Payload bytes implied by a shape and dtype, or an error if that overflows.
fn expected_len(shape: &[u64], dtype: Dtype) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.itemsize() as u64, |acc, &n| acc.checked_mul(n))
}

/// Serialize sections; errors on a name that is empty, too long or repeated, or a payload
/// whose length does not match its shape and dtype.
pub fn write(sections: &[Section]) -> Result<Vec<u8>> {
    if sections.len() > MAX_SECTIONS as usize {
        return Err(KvqError::InvalidDimension {
            arg: "sections",
            expected: format!("at most {MAX_SECTIONS} sections"),
            actual: sections.len() as i64,
        });
    }
    let mut out =
        Vec::with_capacity(14 + sections.iter().map(|s| s.payload.len() + 32).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(sections.len() as u32).to_le_bytes());
    let mut seen = std::collections::HashSet::new();
    for s in sections {
        check_name(&s.name, &mut seen).map_err(|what| KvqError::ShapeMismatch {
            arg: "sections",
            expected: "unique names of 1..128 bytes".into(),
            actual: what,
        })?;
        if s.shape.len() > MAX_NDIM as usize {
            return Err(KvqError::InvalidDimension {
                arg: "shape",
                expected: format!("at most {MAX_NDIM} dimensions"),
                actual: s.shape.len() as i64,
            });
        }
        if expected_len(&s.shape, s.dtype) != Some(s.payload.len() as u64) {
            return Err(KvqError::ShapeMismatch {
                arg: "payload",
                expected: format!(
                    "{:?} x {} bytes for section {:?}",
                    s.shape,
                    s.dtype.itemsize(),
                    s.name
                ),
                actual: format!("{} bytes", s.payload.len()),
            });
        }
        let start = out.len();
        out.push(s.name.len() as u8);
        out.extend_from_slice(s.name.as_bytes());
        out.push(s.dtype as u8);
        out.push(s.shape.len() as u8);
        for &n in &s.shape {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(&(s.payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&s.payload);
        let crc = crc32fast::hash(&out[start..]);
        out.extend_from_slice(&crc.to_le_bytes());
    }
    Ok(out)
}

fn check_name(
    name: &str,
    seen: &mut std::collections::HashSet<String>,
) -> std::result::Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN as usize {
        return Err(format!("a name of {} bytes", name.len()));
    }
    if !seen.insert(name.to_owned()) {
        return Err(format!("section {name:?} twice"));
    }
    Ok(())
}

/// A cursor that turns every short read into a "truncated" error.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let left = (self.bytes.len() - self.pos) as u64;
        if n > left {
            return Err(corrupt(format!(
                "truncated: {what} needs {n} bytes at offset {}, {left} left",
                self.pos
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(2, what)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
}

/// Parse and verify a container; every defect is a [`KvqError::CorruptData`] naming it.
pub fn read(bytes: &[u8]) -> Result<Vec<Section>> {
    let mut r = Reader { bytes, pos: 0 };
    if r.take(8, "the magic")? != MAGIC {
        return Err(corrupt("not a kvqrs compressed cache (bad magic)".into()));
    }
    let version = r.u16("the version")?;
    if version != VERSION {
        return Err(corrupt(format!(
            "format version {version}, this build reads version {VERSION}"
        )));
    }
    let count = r.u32("the section count")?;
    if count > MAX_SECTIONS {
        return Err(corrupt(format!(
            "{count} sections (at most {MAX_SECTIONS})"
        )));
    }
    let mut seen = std::collections::HashSet::new();
    let mut sections = Vec::new();
    for i in 0..count {
        let start = r.pos;
        let name_len = r.u8("a section name length")?;
        let name = std::str::from_utf8(r.take(name_len as u64, "a section name")?)
            .map_err(|_| corrupt(format!("section {i}: name is not UTF-8")))?
            .to_owned();
        check_name(&name, &mut seen).map_err(|what| corrupt(format!("section {i}: {what}")))?;
        let code = r.u8("a dtype")?;
        let dtype = Dtype::from_code(code)
            .ok_or_else(|| corrupt(format!("section {name:?}: unknown dtype code {code}")))?;
        let ndim = r.u8("a rank")?;
        if ndim > MAX_NDIM {
            return Err(corrupt(format!(
                "section {name:?}: {ndim} dimensions (at most {MAX_NDIM})"
            )));
        }
        let shape = (0..ndim)
            .map(|_| r.u64("a shape"))
            .collect::<Result<Vec<u64>>>()?;
        let len = r.u64("a payload length")?;
        if expected_len(&shape, dtype) != Some(len) {
            return Err(corrupt(format!("section {name:?}: payload of {len} bytes does not match shape {shape:?} of {}-byte elements", dtype.itemsize())));
        }
        let payload = r.take(len, &format!("section {name:?}"))?;
        let covered = crc32fast::hash(&bytes[start..r.pos]);
        if r.u32("a checksum")? != covered {
            return Err(corrupt(format!(
                "section {name:?}: checksum mismatch (the bytes were altered)"
            )));
        }
        sections.push(Section {
            name,
            dtype,
            shape,
            payload: payload.to_vec(),
        });
    }
    if r.pos != bytes.len() {
        return Err(corrupt(format!(
            "{} trailing bytes after the last section",
            bytes.len() - r.pos
        )));
    }
    Ok(sections)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Section> {
        vec![
            Section {
                name: "meta".into(),
                dtype: Dtype::Utf8,
                shape: vec![2],
                payload: b"{}".to_vec(),
            },
            Section {
                name: "codes".into(),
                dtype: Dtype::U8,
                shape: vec![2, 3],
                payload: vec![1, 2, 3, 4, 5, 6],
            },
            Section {
                name: "norms".into(),
                dtype: Dtype::F32,
                shape: vec![2],
                payload: vec![0; 8],
            },
            Section {
                name: "empty".into(),
                dtype: Dtype::F16,
                shape: vec![0, 5],
                payload: vec![],
            },
        ]
    }

    #[test]
    fn round_trip() {
        let bytes = write(&sample()).unwrap();
        assert_eq!(read(&bytes).unwrap(), sample());
    }

    #[test]
    fn every_truncation_and_every_single_byte_change_is_an_error() {
        let bytes = write(&sample()).unwrap();
        for n in 0..bytes.len() {
            assert!(
                matches!(read(&bytes[..n]), Err(KvqError::CorruptData { .. })),
                "prefix {n}"
            );
        }
        for i in 0..bytes.len() {
            for flip in [1u8, 0x80] {
                let mut b = bytes.clone();
                b[i] ^= flip;
                // A flipped bit must never decode silently into different sections.
                if let Ok(s) = read(&b) {
                    panic!("byte {i} ^ {flip} decoded into {s:?}");
                }
            }
        }
    }

    #[test]
    fn hostile_lengths_do_not_allocate() {
        let mut b = Vec::from(&MAGIC[..]);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&[1, b'x', 0, 1]);
        b.extend_from_slice(&u64::MAX.to_le_bytes()); // shape
        b.extend_from_slice(&u64::MAX.to_le_bytes()); // length
        assert!(matches!(read(&b), Err(KvqError::CorruptData { .. })));
    }

    #[test]
    fn writer_rejects_bad_sections() {
        let mut s = sample();
        s[1].payload.pop();
        assert!(write(&s).is_err());
        let mut s = sample();
        s[2].name = "codes".into();
        assert!(write(&s).is_err());
    }
}
