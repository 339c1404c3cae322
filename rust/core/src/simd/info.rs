//! What the dispatch chose, per primitive, and why: for benchmark machine lines and reports.

use super::cpu::{cpu, Cpu};
use super::pack_path::{pack_choice_for, PackPath};
use super::{active, force_scalar, is_overridden, Isa};

/// One primitive's path and the reason for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Primitive {
    /// `pack`, `unpack` or `float kernels` (WHT, Lloyd-Max search and lookup, dot products).
    pub name: &'static str,
    /// The path's name (a [`PackPath`] or an [`Isa`] name).
    pub path: &'static str,
    /// Why this path.
    pub reason: String,
}

/// The CPU, the active [`Isa`], the supported paths and each primitive's choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimdInfo {
    /// This CPU.
    pub cpu: &'static Cpu,
    /// The active instruction-set path.
    pub isa: Isa,
    /// The instruction-set paths this CPU supports.
    pub isas: Vec<Isa>,
    /// The pack paths this CPU supports.
    pub pack_paths: Vec<PackPath>,
    /// Pack, unpack and the float kernels, in that order.
    pub primitives: Vec<Primitive>,
}

/// The dispatch state now (it follows [`super::set_active`] and [`super::set_pack_path`]).
pub fn info() -> SimdInfo {
    let isa = active();
    let pack = pack_choice_for(isa);
    let float_reason = if is_overridden() {
        "set_isa".to_string()
    } else if force_scalar() {
        "KVQRS_FORCE_SCALAR is set".to_string()
    } else {
        format!(
            "the fastest of {} on this CPU",
            isa_names(&Isa::available())
        )
    };
    let primitive = |name, path, reason: &str| Primitive {
        name,
        path,
        reason: reason.to_string(),
    };
    SimdInfo {
        cpu: cpu(),
        isa,
        isas: Isa::available(),
        pack_paths: PackPath::available(),
        primitives: vec![
            primitive("pack", pack.path.name(), &pack.reason),
            primitive("unpack", pack.path.name(), &pack.reason),
            primitive("float kernels", isa.name(), &float_reason),
        ],
    }
}

fn isa_names(isas: &[Isa]) -> String {
    isas.iter().map(|i| i.name()).collect::<Vec<_>>().join(", ")
}

/// One line: `GenuineIntel fam 0x6 model 0xa7 | isa avx512 | pack/unpack shift (timed at first
/// use: ...) | float kernels avx512 (...)` (pack and unpack named apart when their
/// paths differ).
pub fn summary() -> String {
    let i = info();
    let head = format!(
        "{} fam {:#x} model {:#x} | isa {}",
        i.cpu.vendor,
        i.cpu.family,
        i.cpu.model,
        i.isa.name()
    );
    let (pack, unpack) = (&i.primitives[0], &i.primitives[1]);
    let same = pack.path == unpack.path && pack.reason == unpack.reason;
    let parts = i.primitives.iter().filter_map(|p| match p.name {
        "unpack" if same => None,
        "pack" if same => Some(format!("pack/unpack {} ({})", p.path, p.reason)),
        name => Some(format!("{name} {} ({})", p.path, p.reason)),
    });
    std::iter::once(head)
        .chain(parts)
        .collect::<Vec<_>>()
        .join(" | ")
}
