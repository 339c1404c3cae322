//! Run-time selection of the instruction set used by the hot kernels (docs/kernels.md
//! section 10).
//!
//! The scalar code in `scalar.rs` and `reduce.rs` is the reference; every other path reproduces
//! its bits exactly (same operations, same rounding, same reduction order), so the choice of
//! path never changes a code, a byte or a float. The best path is detected once; the
//! environment variable `KVQRS_FORCE_SCALAR=1` (read once, at first use) makes the scalar path
//! the default, and [`set_active`] overrides the choice for the whole process (tests, benches).
//!
//! The bit-packing primitive has a path of its own ([`PackPath`], `pack_path.rs`), chosen from
//! the CPU's vendor and family; [`info`] reports every primitive's path and why.

mod cpu;
mod info;
#[cfg(target_arch = "aarch64")]
mod neon;
pub(crate) mod ops;
mod pack_path;
pub(crate) mod scalar;
pub(crate) mod shift;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use cpu::{cpu, Cpu};
pub use info::{info, summary, Primitive, SimdInfo};
pub use pack_path::{
    default_pack_choice, pack_choice_for, pack_path_for, pack_rule, set_pack_path, PackChoice,
    PackFacts, PackPath, PackRule,
};

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use crate::error::{KvqError, Result};

/// An instruction-set path of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, the reference every other path must match bit for bit.
    Scalar,
    /// x86_64 AVX2 (with F16C for stored float16 scalars; the bit packing has its own
    /// [`PackPath`]).
    Avx2,
    /// x86_64 AVX-512 F/BW/VL (plus the AVX2 requirements).
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Isa {
    /// Every path, in the order of `Isa::index`.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// Lower-case name: `scalar`, `avx2`, `avx512`, `neon`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// Parses a name as printed by [`Isa::name`] (case-insensitive).
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(name.trim()))
    }

    fn index(self) -> u8 {
        match self {
            Isa::Scalar => 0,
            Isa::Avx2 => 1,
            Isa::Avx512 => 2,
            Isa::Neon => 3,
        }
    }

    /// Whether this CPU can run the path (detected once per process).
    pub fn is_supported(self) -> bool {
        static SUPPORTED: OnceLock<[bool; 4]> = OnceLock::new();
        SUPPORTED.get_or_init(detect)[usize::from(self.index())]
    }

    /// The paths this CPU supports, scalar first, fastest last.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// The fastest supported path.
    pub fn best() -> Isa {
        *Isa::available().last().unwrap_or(&Isa::Scalar)
    }

    /// `Ok(self)` if supported, else an error naming the supported paths.
    pub fn checked(self) -> Result<Isa> {
        if self.is_supported() {
            Ok(self)
        } else {
            Err(KvqError::UnsupportedIsa {
                requested: self.name().to_string(),
                available: Isa::available()
                    .iter()
                    .map(|i| i.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    }
}

fn detect() -> [bool; 4] {
    let mut s = [true, false, false, false];
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c");
        s[1] = avx2;
        s[2] = avx2
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl");
    }
    #[cfg(target_arch = "aarch64")]
    {
        s[3] = std::arch::is_aarch64_feature_detected!("neon");
    }
    s
}

/// The default path: the best one, or scalar when `KVQRS_FORCE_SCALAR` is set to anything but
/// `0` or the empty string (read once).
pub fn default_isa() -> Isa {
    static DEFAULT: OnceLock<Isa> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        if force_scalar() {
            Isa::Scalar
        } else {
            Isa::best()
        }
    })
}

/// Whether `KVQRS_FORCE_SCALAR` is set to anything but the empty string, `0`, `false`, `no` or
/// `off` (any case, spaces around ignored; read once).
pub fn force_scalar() -> bool {
    static FORCED: OnceLock<bool> = OnceLock::new();
    *FORCED.get_or_init(|| {
        std::env::var("KVQRS_FORCE_SCALAR").is_ok_and(|v| {
            let v = v.trim().to_ascii_lowercase();
            !matches!(v.as_str(), "" | "0" | "false" | "no" | "off")
        })
    })
}

/// Whether [`set_active`] overrides the default path now.
pub fn is_overridden() -> bool {
    OVERRIDE.load(Ordering::Relaxed) != 0
}

/// 0 = no override, else `Isa::index() + 1`.
static OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// The path kernels use when none is given explicitly: the override, else [`default_isa`].
pub fn active() -> Isa {
    match OVERRIDE.load(Ordering::Relaxed) {
        0 => default_isa(),
        i => Isa::ALL[usize::from(i - 1)],
    }
}

/// Overrides the path for the whole process (`None` restores the default). Errors, leaving the
/// setting unchanged, if the CPU does not support `isa`.
pub fn set_active(isa: Option<Isa>) -> Result<()> {
    let v = match isa {
        Some(i) => i.checked()?.index() + 1,
        None => 0,
    };
    OVERRIDE.store(v, Ordering::Relaxed);
    Ok(())
}

/// Calls `f(j, h)` for the butterfly pairs `(j.., j + h..)`, one vector of `lanes` at a time,
/// of the transform stages `h = h0, 2 h0, ... < n` (the strides that span whole vectors).
#[inline(always)]
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
fn butterfly_pairs(n: usize, h0: usize, lanes: usize, mut f: impl FnMut(usize, usize)) {
    let mut h = h0;
    while h < n {
        for block in (0..n).step_by(2 * h) {
            for j in (block..block + h).step_by(lanes) {
                f(j, h);
            }
        }
        h *= 2;
    }
}

/// A kernel object's instruction-set choice: pinned by `with_isa`, or following [`active`]
/// at each call (the default, so cached objects see a later [`set_active`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct IsaChoice(Option<Isa>);

impl IsaChoice {
    /// Pins `isa`; errors if this CPU lacks it.
    pub(crate) fn pinned(isa: Isa) -> Result<Self> {
        Ok(Self(Some(isa.checked()?)))
    }

    /// The path to use now.
    pub(crate) fn get(self) -> Isa {
        self.0.unwrap_or_else(active)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_scalar_is_always_available() {
        for i in Isa::ALL {
            assert_eq!(Isa::from_name(i.name()), Some(i));
        }
        assert_eq!(Isa::from_name("AVX2"), Some(Isa::Avx2));
        assert_eq!(Isa::from_name("sse"), None);
        assert_eq!(Isa::available()[0], Isa::Scalar);
        assert!(Isa::available().contains(&Isa::best()));
    }

    #[test]
    fn the_summary_names_the_cpu_and_every_primitive() {
        let line = summary();
        let c = cpu();
        let head = format!(
            "{} fam {:#x} model {:#x} | isa ",
            c.vendor, c.family, c.model
        );
        assert!(line.starts_with(&head), "{line}");
        assert!(
            line.contains("| pack/unpack ") && line.contains("| float kernels "),
            "{line}"
        );
        let names: Vec<_> = info().primitives.iter().map(|p| p.name).collect();
        assert_eq!(names, ["pack", "unpack", "float kernels"]);
    }

    #[test]
    fn unsupported_paths_are_errors() {
        for i in Isa::ALL {
            assert_eq!(i.checked().is_ok(), i.is_supported());
        }
        #[cfg(target_arch = "x86_64")]
        assert!(Isa::Neon.checked().is_err());
    }
}
