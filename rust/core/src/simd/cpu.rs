//! The CPU's identity (cpuid vendor, family, model, brand string) and the features the
//! dispatch looks at, read once per process.

use std::sync::OnceLock;

/// What the dispatch knows of this CPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cpu {
    /// The cpuid vendor string (`GenuineIntel`, `AuthenticAMD`, `HygonGenuine`, ...), or
    /// `unknown` off x86_64.
    pub vendor: String,
    /// The display family (base family plus extended family), 0 off x86_64.
    pub family: u32,
    /// The display model (with the extended model for families 6 and 15), 0 off x86_64.
    pub model: u32,
    /// The processor brand string, empty when the CPU has none.
    pub brand: String,
    /// Each feature the kernels use, by its lower-case name, and whether it was detected.
    pub features: Vec<(&'static str, bool)>,
}

impl Cpu {
    /// Whether `feature` (a name of [`Cpu::features`]) was detected.
    pub fn has(&self, feature: &str) -> bool {
        self.features.iter().any(|&(f, on)| on && f == feature)
    }
}

/// This CPU (detected once).
pub fn cpu() -> &'static Cpu {
    static CPU: OnceLock<Cpu> = OnceLock::new();
    CPU.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Cpu {
    use std::arch::x86_64::__cpuid;
    use std::is_x86_feature_detected as has;

    let leaf0 = __cpuid(0);
    let vendor: Vec<u8> = [leaf0.ebx, leaf0.edx, leaf0.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    let eax = if leaf0.eax >= 1 { __cpuid(1).eax } else { 0 };
    let (base_family, base_model) = ((eax >> 8) & 0xf, (eax >> 4) & 0xf);
    let family = if base_family == 0xf {
        base_family + ((eax >> 20) & 0xff)
    } else {
        base_family
    };
    let model = if base_family == 0x6 || base_family == 0xf {
        base_model | (((eax >> 16) & 0xf) << 4)
    } else {
        base_model
    };
    Cpu {
        vendor: String::from_utf8_lossy(&vendor).trim().to_string(),
        family,
        model,
        brand: brand(),
        features: vec![
            ("avx2", has!("avx2")),
            ("bmi2", has!("bmi2")),
            ("avx512f", has!("avx512f")),
            ("avx512bw", has!("avx512bw")),
            ("avx512vl", has!("avx512vl")),
            ("f16c", has!("f16c")),
            ("fma", has!("fma")),
        ],
    }
}

/// The 48-byte brand string of the extended leaves 0x8000_0002..=0x8000_0004.
#[cfg(target_arch = "x86_64")]
fn brand() -> String {
    use std::arch::x86_64::__cpuid;

    if __cpuid(0x8000_0000).eax < 0x8000_0004 {
        return String::new();
    }
    let bytes: Vec<u8> = (0x8000_0002u32..=0x8000_0004)
        .map(__cpuid)
        .flat_map(|r| [r.eax, r.ebx, r.ecx, r.edx])
        .flat_map(u32::to_le_bytes)
        .take_while(|&c| c != 0)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Cpu {
    Cpu {
        vendor: "unknown".to_string(),
        family: 0,
        model: 0,
        brand: String::new(),
        #[cfg(target_arch = "aarch64")]
        features: vec![("neon", std::arch::is_aarch64_feature_detected!("neon"))],
        #[cfg(not(target_arch = "aarch64"))]
        features: Vec::new(),
    }
}
