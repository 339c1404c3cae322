//! The path of the bit-packing primitive (pack and unpack), chosen apart from the float
//! kernels' [`Isa`]: BMI2 `pext`/`pdep` are one fast instruction on Intel and AMD Zen 3+, but
//! microcode (tens of cycles) on AMD Zen/Zen 2 and Hygon, where shifts on 64-bit words win.
//! Every path gives the bytes of the scalar reference.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use super::cpu::cpu;
#[cfg(target_arch = "x86_64")]
use super::x86::bmi2;
use super::{scalar, shift, Isa};
use crate::error::{KvqError, Result};

/// A path of the pack primitive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PackPath {
    /// The portable byte-at-a-time reference.
    Scalar,
    /// x86_64 BMI2 `pext` (pack) and `pdep` (unpack), eight codes an instruction.
    Bmi2,
    /// Shift-and-mask steps on 64-bit words, eight codes a word (no BMI2 needed).
    Shift,
}

impl PackPath {
    /// Every path, in the order of `PackPath::index`.
    pub const ALL: [PackPath; 3] = [PackPath::Scalar, PackPath::Bmi2, PackPath::Shift];

    /// Lower-case name: `scalar`, `bmi2`, `shift`.
    pub fn name(self) -> &'static str {
        match self {
            PackPath::Scalar => "scalar",
            PackPath::Bmi2 => "bmi2",
            PackPath::Shift => "shift",
        }
    }

    /// Parses a name as printed by [`PackPath::name`] (case-insensitive).
    pub fn from_name(name: &str) -> Option<PackPath> {
        PackPath::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(name.trim()))
    }

    fn index(self) -> u8 {
        match self {
            PackPath::Scalar => 0,
            PackPath::Bmi2 => 1,
            PackPath::Shift => 2,
        }
    }

    /// Whether this CPU can run the path: BMI2 needs the instructions, the others run anywhere.
    pub fn is_supported(self) -> bool {
        self != PackPath::Bmi2 || (cfg!(target_arch = "x86_64") && cpu().has("bmi2"))
    }

    /// The paths this CPU supports.
    pub fn available() -> Vec<PackPath> {
        PackPath::ALL
            .into_iter()
            .filter(|p| p.is_supported())
            .collect()
    }

    /// `Ok(self)` if supported, else an error saying why and naming the supported paths.
    pub fn checked(self) -> Result<PackPath> {
        if self.is_supported() {
            return Ok(self);
        }
        Err(KvqError::UnsupportedPackPath {
            requested: self.name().to_string(),
            why: "this CPU has no BMI2".to_string(),
            available: names(&PackPath::available()),
        })
    }
}

fn names(paths: &[PackPath]) -> String {
    paths
        .iter()
        .map(|p| p.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A path and why it was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackChoice {
    /// The path.
    pub path: PackPath,
    /// One line on why, e.g. `AMD family 0x17 runs pext/pdep in microcode`.
    pub reason: String,
}

impl PackChoice {
    fn new(path: PackPath, reason: impl Into<String>) -> Self {
        Self {
            path,
            reason: reason.into(),
        }
    }
}

/// What the rule sees of a CPU.
#[derive(Debug, Clone, Copy)]
pub struct PackFacts<'a> {
    /// The cpuid vendor string.
    pub vendor: &'a str,
    /// The display family.
    pub family: u32,
    /// Whether BMI2 is present.
    pub bmi2: bool,
    /// Whether a SIMD [`Isa`] runs the kernels (the pack path only applies under one).
    pub simd: bool,
}

/// The rule's verdict: a path, or a short timing of BMI2 against shifts at first use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PackRule {
    /// Use this path.
    Use(PackChoice),
    /// Time BMI2 against shifts and keep the faster: BMI2 is native here (or the vendor is
    /// one the rule does not know), and shifts can still be as fast (measured on an Intel
    /// Xeon: shifts 1.0x to 1.8x BMI2's speed at 2 to 4 bits).
    Time,
}

/// The dispatch rule, a pure function of the CPU's facts (docs/kernels.md section 10).
pub fn pack_rule(f: PackFacts<'_>) -> PackRule {
    let use_ = |p, r: String| PackRule::Use(PackChoice::new(p, r));
    let fam = f.family;
    if !f.simd {
        return use_(
            PackPath::Scalar,
            "no SIMD path: the scalar reference".into(),
        );
    }
    if !f.bmi2 {
        return use_(PackPath::Shift, "no BMI2: shifts on 64-bit words".into());
    }
    match f.vendor {
        "AuthenticAMD" | "HygonGenuine" if fam <= 0x18 => use_(
            PackPath::Shift,
            format!(
                "{} family {fam:#x} runs pext/pdep in microcode",
                if f.vendor == "HygonGenuine" {
                    "Hygon"
                } else {
                    "AMD"
                }
            ),
        ),
        _ => PackRule::Time,
    }
}

/// Times BMI2 against shifts on a small buffer (a few microseconds) and keeps the faster.
fn timed_choice() -> PackChoice {
    let rates = [PackPath::Bmi2, PackPath::Shift].map(|p| (p, pack_rate(p)));
    let [(a, ra), (b, rb)] = rates;
    let (best, _) = if ra >= rb { (a, ra) } else { (b, rb) };
    PackChoice::new(
        best,
        format!(
            "timed at first use: {} {:.2} GB/s vs {} {:.2} GB/s",
            b.name(),
            rb,
            a.name(),
            ra
        ),
    )
}

/// Codes per second (in GB/s of code bytes) of a 3-bit pack and unpack of 4096 codes, the
/// best of a few runs.
fn pack_rate(path: PackPath) -> f64 {
    const N: usize = 4096;
    let codes: Vec<u8> = (0..N).map(|i| (i * 5 % 8) as u8).collect();
    let mut packed = vec![0u8; N * 3 / 8];
    let mut back = vec![0u8; N];
    let best = (0..5)
        .map(|_| {
            let t = Instant::now();
            pack_row_on(path, std::hint::black_box(&codes), 3, &mut packed);
            unpack_row_on(path, std::hint::black_box(&packed), 3, &mut back);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    (2 * N) as f64 / best.max(1e-9) / 1e9
}

/// The default path with its reason: scalar under `KVQRS_FORCE_SCALAR`, else the one named
/// by `KVQRS_PACK_PATH` (read once), else [`pack_rule`] on this CPU (timing it if the rule
/// asks).
pub fn default_pack_choice() -> &'static PackChoice {
    static DEFAULT: OnceLock<PackChoice> = OnceLock::new();
    DEFAULT.get_or_init(|| {
        if super::force_scalar() {
            return PackChoice::new(PackPath::Scalar, "KVQRS_FORCE_SCALAR is set");
        }
        let env = std::env::var("KVQRS_PACK_PATH").unwrap_or_default();
        let mut choice = cpu_choice();
        if env.trim().is_empty() {
            return choice;
        }
        match PackPath::from_name(&env).map(PackPath::checked) {
            Some(Ok(p)) => PackChoice::new(p, format!("KVQRS_PACK_PATH={}", p.name())),
            Some(Err(e)) => {
                choice.reason = format!("{}; KVQRS_PACK_PATH ignored: {e}", choice.reason);
                choice
            }
            None => {
                choice.reason = format!(
                    "{}; KVQRS_PACK_PATH={env:?} ignored: expected one of scalar, bmi2, shift",
                    choice.reason
                );
                choice
            }
        }
    })
}

/// [`pack_rule`] on this CPU.
fn cpu_choice() -> PackChoice {
    let c = cpu();
    let facts = PackFacts {
        vendor: &c.vendor,
        family: c.family,
        bmi2: PackPath::Bmi2.is_supported(),
        simd: Isa::best() != Isa::Scalar,
    };
    match pack_rule(facts) {
        PackRule::Use(choice) => choice,
        PackRule::Time => timed_choice(),
    }
}

/// 0 = no override, else `PackPath::index() + 1`.
static OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// Overrides the pack path for the whole process (`None` restores the default). Errors,
/// leaving the setting unchanged, if the CPU does not support `path`.
pub fn set_pack_path(path: Option<PackPath>) -> Result<()> {
    let v = match path {
        Some(p) => p.checked()?.index() + 1,
        None => 0,
    };
    OVERRIDE.store(v, Ordering::Relaxed);
    Ok(())
}

fn overridden() -> Option<PackPath> {
    match OVERRIDE.load(Ordering::Relaxed) {
        0 => None,
        i => Some(PackPath::ALL[usize::from(i - 1)]),
    }
}

/// The pack path kernels on `isa` use: the override of [`set_pack_path`], else scalar on the
/// scalar `isa` (the reference everywhere), else the default.
pub fn pack_path_for(isa: Isa) -> PackPath {
    match overridden() {
        Some(p) => p,
        None if isa == Isa::Scalar => PackPath::Scalar,
        None => default_pack_choice().path,
    }
}

/// [`pack_path_for`] with its reason.
pub fn pack_choice_for(isa: Isa) -> PackChoice {
    match overridden() {
        Some(p) => PackChoice::new(p, "set_pack_path"),
        None if isa == Isa::Scalar => {
            PackChoice::new(PackPath::Scalar, "isa scalar: the scalar reference")
        }
        None => default_pack_choice().clone(),
    }
}

/// Packs one row on `path`, which must be supported ([`PackPath::checked`]).
pub(crate) fn pack_row_on(path: PackPath, codes: &[u8], bits: u32, out: &mut [u8]) {
    match path {
        // SAFETY: a supported `PackPath::Bmi2` means this CPU has BMI2.
        #[cfg(target_arch = "x86_64")]
        PackPath::Bmi2 => unsafe { bmi2::pack_row(codes, bits, out) },
        PackPath::Shift => shift::pack_row(codes, bits, out),
        _ => scalar::pack_row(codes, bits, out),
    }
}

/// Unpacks one row on `path`, which must be supported.
pub(crate) fn unpack_row_on(path: PackPath, packed: &[u8], bits: u32, out: &mut [u8]) {
    match path {
        // SAFETY: a supported `PackPath::Bmi2` means this CPU has BMI2.
        #[cfg(target_arch = "x86_64")]
        PackPath::Bmi2 => unsafe { bmi2::unpack_row(packed, bits, out) },
        PackPath::Shift => shift::unpack_row(packed, bits, out),
        _ => scalar::unpack_row(packed, bits, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(vendor: &str, family: u32, bmi2: bool) -> PackRule {
        pack_rule(PackFacts {
            vendor,
            family,
            bmi2,
            simd: true,
        })
    }

    fn chosen(vendor: &str, family: u32, bmi2: bool) -> (PackPath, String) {
        match rule(vendor, family, bmi2) {
            PackRule::Use(c) => (c.path, c.reason),
            PackRule::Time => panic!("{vendor} {family:#x}: expected a fixed path"),
        }
    }

    #[test]
    fn the_rule_follows_vendor_and_family() {
        let zen2 = chosen("AuthenticAMD", 0x17, true);
        let want = "AMD family 0x17 runs pext/pdep in microcode";
        assert_eq!(zen2, (PackPath::Shift, want.into()));
        let hygon = chosen("HygonGenuine", 0x18, true);
        let want = "Hygon family 0x18 runs pext/pdep in microcode";
        assert_eq!(hygon, (PackPath::Shift, want.into()));
        // Native BMI2 (Intel, AMD Zen 3 and later) or an unknown vendor: timed.
        assert_eq!(rule("GenuineIntel", 6, true), PackRule::Time);
        for fam in [0x19, 0x1a] {
            assert_eq!(rule("AuthenticAMD", fam, true), PackRule::Time);
        }
        assert_eq!(rule("CentaurHauls", 7, true), PackRule::Time);
        assert_eq!(rule("unknown", 0, true), PackRule::Time);
        for vendor in ["GenuineIntel", "AuthenticAMD", "unknown"] {
            assert_eq!(chosen(vendor, 0x19, false).0, PackPath::Shift);
        }
        let no_simd = PackFacts {
            vendor: "GenuineIntel",
            family: 6,
            bmi2: true,
            simd: false,
        };
        assert!(matches!(pack_rule(no_simd), PackRule::Use(c) if c.path == PackPath::Scalar));
    }

    #[test]
    fn timing_picks_a_supported_path_and_says_so() {
        if !PackPath::Bmi2.is_supported() {
            return;
        }
        let c = timed_choice();
        assert!(matches!(c.path, PackPath::Bmi2 | PackPath::Shift));
        assert!(
            c.reason.starts_with("timed at first use: shift "),
            "{}",
            c.reason
        );
        assert!(c.reason.contains(" GB/s vs bmi2 "), "{}", c.reason);
    }

    #[test]
    fn names_round_trip_and_bmi2_needs_the_instructions() {
        for p in PackPath::ALL {
            assert_eq!(PackPath::from_name(p.name()), Some(p));
            assert_eq!(p.checked().is_ok(), p.is_supported());
        }
        assert_eq!(PackPath::from_name(" SHIFT "), Some(PackPath::Shift));
        assert_eq!(PackPath::from_name("pext"), None);
        assert!(PackPath::Scalar.is_supported() && PackPath::Shift.is_supported());
        let err = PackPath::Bmi2.checked();
        if let Err(e) = err {
            assert!(e.to_string().contains("no BMI2"), "{e}");
        }
        assert_eq!(pack_path_for(Isa::Scalar), PackPath::Scalar);
    }
}
