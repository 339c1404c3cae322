//! The one dtype enum of kvqrs-core, with each dtype's container code, byte size and name.

/// The element type of a stored array: a layer store's part, a paged slot's part, stored
/// scalars, a container section (its code is the byte docs/format.md writes). Dtypes cross
/// the binding by their NumPy names ([`Dtype::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    U8 = 0,
    F16 = 1,
    F32 = 2,
    F64 = 3,
    I64 = 4,
    /// UTF-8 text (the metadata), one byte per element.
    Utf8 = 5,
    /// bfloat16, two bytes per element.
    Bf16 = 6,
}

impl Dtype {
    /// The dtype of a stored code, or None.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Dtype::U8,
            1 => Dtype::F16,
            2 => Dtype::F32,
            3 => Dtype::F64,
            4 => Dtype::I64,
            5 => Dtype::Utf8,
            6 => Dtype::Bf16,
            _ => return None,
        })
    }

    /// The NumPy name (`uint8`, `float16`, ...; `utf-8` for text).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::U8 => "uint8",
            Dtype::F16 => "float16",
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
            Dtype::I64 => "int64",
            Dtype::Utf8 => "utf-8",
            Dtype::Bf16 => "bfloat16",
        }
    }

    /// Every dtype, by code.
    pub const ALL: [Dtype; 7] = [
        Dtype::U8,
        Dtype::F16,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::Utf8,
        Dtype::Bf16,
    ];

    /// The dtype of a NumPy name ([`Dtype::name`]), or None.
    pub fn from_name(name: &str) -> Option<Self> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element.
    pub fn itemsize(self) -> usize {
        match self {
            Dtype::U8 | Dtype::Utf8 => 1,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 => 8,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for code in 0..=6u8 {
            let d = Dtype::from_code(code).unwrap();
            assert_eq!(d as u8, code);
            assert_eq!(Dtype::from_name(d.name()), Some(d));
        }
        assert_eq!(Dtype::from_code(7), None);
        assert!(Dtype::ALL.iter().enumerate().all(|(i, &d)| d as usize == i));
        assert_eq!(Dtype::from_name("int8"), None);
        assert_eq!((Dtype::F16.itemsize(), Dtype::Bf16.name()), (2, "bfloat16"));
    }
}
