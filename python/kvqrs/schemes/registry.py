"""The scheme registry: every scheme of docs/schemes.md by name, with how its coders are built
and what it can do, declared once.

:class:`~kvqrs.schemes.KVCodec` builds its coders through :func:`build_coder`, and the name
lists the rest of the package checks against (``KEY_SCHEMES``, ``VALUE_SCHEMES``,
``MSE_VALUE_SCHEMES``, ``LOG_NORM_VALUE_SCHEMES``, ``HEADQ_BASES``, ``PAGED_SCHEMES``) are
derived from :data:`REGISTRY` (:func:`names`). Adding a scheme is one :class:`SchemeSpec` entry
here (or :func:`register` at run time), its coder (:class:`~kvqrs.schemes.base.Coder`, whose
``layout`` declares what it stores) and its kernels (docs/architecture.md, "Adding a scheme").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .._arrays import KvqrsError
from ..kernels.mse import check_scale
from ..kernels.rng import philox4x32_10
from .a2 import A2ValueCoder
from .backend import Backend
from .base import Coder
from .block import BlockCoder
from .headq import HeadQCoder
from .kivi import KIVICoder
from .matched import MAX_WIDTH, MatchedCalibration, MatchedCoder, MatchedValueCoder, random_calibration
from .matched_tokens import MatchedTokenCoder
from .mse import MSECoder, MSEQJLCoder, norm_params
from .width_classes import WidthClassCoder

# Sub-seed tags: every random object of a codec comes from its one seed (docs/kernels.md 1).
_KEY_ROTATION, _KEY_QJL, _VALUE_ROTATION, _VALUE_QJL, _RANDOM_BASIS = range(1, 6)


def derive_seed(seed: int, tag: int) -> int:
    """Sub-seed ``tag`` of ``seed``: the first two words of Philox4x32-10 at counter
    ``(tag, 0, 0xFFFFFFFF, 0)`` under key ``seed`` (a stream no kernel uses)."""
    w = philox4x32_10([tag, 0, 0xFFFFFFFF, 0], [seed & 0xFFFFFFFF, seed >> 32])
    return int(w[0]) | (int(w[1]) << 32)


@dataclass(frozen=True)
class CoderSettings:
    """What a scheme's coder is built from: a :class:`~kvqrs.schemes.KVCodec`'s settings for
    one side of the cache.

    Attributes:
        scheme: the scheme's name (recorded in every tensor its coder encodes).
        kind: ``"keys"`` or ``"values"``.
        bits: bits per coordinate (the side's budget, 1..8).
        head_dim: d.
        seed: the codec's seed; :attr:`rotation_seed` and :attr:`qjl_seed` derive this side's.
        group: tokens per KIVI key group and per log8 norm exponent, channels per value group,
            coordinates per ``block`` block.
        backend: the kernels' compute path.
        calibration: what a calibrated scheme was fitted to: a
            :class:`~kvqrs.schemes.matched.MatchedCalibration` (``matched``) or the side-code
            basis ``(d, r)`` / ``(kv_heads, d, r)`` (``headq``); None before calibration.
        scale, norms: what each token's MSE stage stores and how (values; keys take the
            defaults ``"norm"`` and ``"float"``).
        base: the base key coder HeadQ adds its side code to.
        side_bits, sign: HeadQ's side-code bits and sign (-1: the wrong-sign control).
    """

    scheme: str
    kind: str
    bits: int
    head_dim: int
    seed: int
    group: int
    backend: Backend
    calibration: Any = None
    scale: str = "norm"
    norms: str = "float"
    base: Coder | None = None
    side_bits: int = 4
    sign: int = 1

    @property
    def rotation_seed(self) -> int:
        """This side's rotation seed (the keys' and the values' differ)."""
        return derive_seed(self.seed, _KEY_ROTATION if self.kind == "keys" else _VALUE_ROTATION)

    @property
    def qjl_seed(self) -> int:
        """This side's QJL sketch seed."""
        return derive_seed(self.seed, _KEY_QJL if self.kind == "keys" else _VALUE_QJL)


@dataclass(frozen=True)
class SideSpec:
    """How a scheme codes one side (keys or values) of the cache.

    Attributes:
        build: the coder for a codec's settings; None where nothing is coded (values kept in
            full precision, HeadQ keys before their basis). Raises :class:`KvqrsError` for
            settings the coder refuses. What its coder stores (each part's shape, dtype, token
            rate and alignment) the coder's ``layout`` declares
            (:meth:`KVCodec.fixed_per_token <kvqrs.schemes.KVCodec.fixed_per_token>`,
            :meth:`KVCodec.align <kvqrs.schemes.KVCodec.align>` and
            :meth:`KVCodec.nbytes <kvqrs.schemes.KVCodec.nbytes>` read it).
        fused: its coder has a fused read path (``Coder.fused``: ``attention_rows`` for
            :func:`kvqrs.kernels.decode_attention`), with the default settings.
        unpaged: why vLLM's paged cache (:mod:`kvqrs.vllm.layout`) cannot store this side, in
            the words of its refusal; None where it can (then its declared layout is fixed per
            token).
        paged_with: for a side that ``unpaged`` refuses unless its calibration gives it a fixed
            size per token (``matched``): why a config's ``calibration`` (``{layer:
            MatchedCalibration}``, a string or None) still does not, in the words of the
            refusal, or None when it does (the paged cache then stores this side).
        min_bits: the fewest bits per coordinate it takes (2 where a QJL residual takes one);
            its coder refuses fewer, saying why.
        max_bits: the most bits per coordinate it takes; :func:`build_coder` refuses more.
        coded: False for a side kept in full precision (``none`` values: ``build`` gives None
            and attention reads the values as :class:`~kvqrs.kernels.attention.DenseRows`).
    """

    build: Callable[[CoderSettings], Coder | None]
    fused: bool
    unpaged: str | None = None
    paged_with: Callable[[Any], str | None] | None = None
    min_bits: int = 1
    max_bits: int = 8
    coded: bool = True

    def bits(self, wanted: int) -> int:
        """``wanted`` brought into ``min_bits .. max_bits``: the width a sweep over every scheme
        at ``wanted`` bits builds this side at."""
        return min(max(wanted, self.min_bits), self.max_bits)


@dataclass(frozen=True)
class SchemeSpec:
    """One scheme: its coders and its capabilities.

    Attributes:
        name: what ``KVCodec(scheme=...)`` and ``QuantConfig`` take.
        description: one line for docs and listings.
        keys, values: how it codes each side; None for a side it does not code (``headq``
            codes keys only, ``a2`` and ``none`` values only).
        mse_values: its values go through the MSE stage (``value_scale`` applies).
        log_norms: that stage may store log-coded norms (``value_norms="log8"``).
        headq_base: its place among the base key schemes HeadQ builds on (0: the default),
            None where HeadQ cannot build on it.
        control: for a scheme that needs a calibration, the codec keywords of its seeded
            uncalibrated control, ``control(head_dim, bits, seed) -> {keyword: value}``
            (HeadQ's random basis, matched's random calibration); None for a scheme that needs
            none.
    """

    name: str
    description: str
    keys: SideSpec | None = None
    values: SideSpec | None = None
    mse_values: bool = False
    log_norms: bool = False
    headq_base: int | None = None
    control: Callable[[int, int, int], dict[str, Any]] | None = None

    def side(self, kind: str) -> SideSpec | None:
        """``keys`` or ``values`` by name."""
        return self.keys if kind == "keys" else self.values

    @property
    def paged(self) -> bool:
        """vLLM's paged cache stores every side this scheme codes."""
        return all(s.unpaged is None for s in (self.keys, self.values) if s is not None)

    @property
    def paged_calibrated(self) -> bool:
        """vLLM's paged cache stores every side this scheme codes, some given a calibration
        that fixes their size per token (:attr:`SideSpec.paged_with`); :attr:`paged` ones
        with any settings."""
        return all(s.unpaged is None or s.paged_with is not None for s in (self.keys, self.values) if s is not None)

    @property
    def needs_calibration(self) -> bool:
        """Its coders need a calibration (:attr:`control` stands in for one)."""
        return self.control is not None

    def control_kwargs(self, head_dim: int, bits: int, seed: int) -> dict[str, Any]:
        """The codec keywords of :attr:`control` (none for a scheme that needs no calibration):
        ``KVCodec(name, bits, head_dim, seed=seed, **spec.control_kwargs(head_dim, bits, seed))``
        encodes."""
        return {} if self.control is None else self.control(head_dim, bits, seed)


# -- the coders of each scheme, from a codec's settings ------------------------------------------
def _mse(s: CoderSettings) -> MSECoder:
    return MSECoder(s.head_dim, s.bits, None, s.scheme, s.kind, s.backend, s.scale, s.norms, s.group)


def _rotated_mse(s: CoderSettings) -> MSECoder:
    return MSECoder(s.head_dim, s.bits, s.rotation_seed, s.scheme, s.kind, s.backend)


def _mse_qjl(s: CoderSettings) -> MSEQJLCoder:
    return MSEQJLCoder(s.head_dim, s.bits, s.rotation_seed, s.qjl_seed, s.scheme, s.kind, s.backend, s.scale)


def _kivi(s: CoderSettings) -> KIVICoder:
    return KIVICoder(s.head_dim, s.bits, s.group, s.kind == "keys", s.scheme, s.kind, s.backend)


def _block(s: CoderSettings) -> BlockCoder:
    return BlockCoder(s.head_dim, s.bits, s.rotation_seed, s.group, s.scheme, s.kind, s.backend)


def _headq(s: CoderSettings) -> HeadQCoder | None:
    if s.calibration is None:
        return None
    return HeadQCoder(s.base, s.calibration, s.side_bits, s.sign, s.scheme)


def _a2(s: CoderSettings) -> A2ValueCoder:
    return A2ValueCoder(s.head_dim, s.bits, s.rotation_seed, s.scheme, s.backend)


def _matched_calibration(calibration: Any, side: str) -> MatchedCalibration:
    if not isinstance(calibration, MatchedCalibration):
        raise KvqrsError(
            f"calibration: the matched {side} need a MatchedCalibration (kvqrs.hf.calibrate_matched or "
            f"kvqrs.schemes.matched.fit_basis), got {type(calibration).__name__}"
        )
    return calibration


def _matched_keys(s: CoderSettings) -> MatchedCoder:
    basis = _matched_calibration(s.calibration, "keys").keys
    if basis.deviations is not None:  # calibrated with per-token scales: a fixed size per token
        return MatchedTokenCoder(s.head_dim, basis, s.scheme, "keys", s.backend)
    return MatchedCoder(s.head_dim, basis, s.group, s.scheme, "keys", s.backend)


def _matched_values(s: CoderSettings) -> Coder:
    """Transform-coded values (a calibration with a value basis: its widths, not ``bits``), values
    in width classes, or the mean-centred MSE stage at ``bits`` or the layer's calibrated width."""
    cal = _matched_calibration(s.calibration, "values")
    if cal.values is not None:
        check_value_stage(s.scheme, s.scale, s.norms, s.group, True, "transform-coded matched values")
        return MatchedCoder(s.head_dim, cal.values, s.group, s.scheme, "values", s.backend)
    stored = {"norms": s.norms, "norm_group": s.group}
    if cal.value_classes is not None:
        chunk = sum(c for _, c in cal.value_classes)
        if chunk != s.group:
            raise KvqrsError(f"value_classes: the calibration's classes fill chunks of {chunk} tokens, the config's group is {s.group}")
        stage = lambda b: MSECoder(s.head_dim, b, s.rotation_seed, s.scheme, "values", s.backend, s.scale, **stored)  # noqa: E731
        return WidthClassCoder(cal.value_classes, s.group, cal.value_mean, stage)
    width = s.bits if cal.value_bits is None else cal.value_bits  # a per-layer allocation overrides the config
    return MatchedValueCoder(s.head_dim, width, s.rotation_seed, cal.value_mean, s.scheme, "values", s.backend, s.scale, **stored)


def _full_precision(s: CoderSettings) -> None:
    return None


def _headq_control(head_dim: int, bits: int, seed: int) -> dict[str, Any]:
    return {"basis": "random"}


def _matched_control(head_dim: int, bits: int, seed: int) -> dict[str, Any]:
    # Its widths reach bits + 1: at 8 bits, the 7-bit control (the values take the codec's 8).
    return {"calibration": random_calibration(head_dim, min(bits, MAX_WIDTH - 1), seed)}


_PER_CHANNEL = "share per-channel statistics over groups of tokens"
_MATCHED_KEYS_UNPAGED = (
    "matched keys coded in groups of tokens share per-channel statistics over them: calibrate with "
    "`kvqrs calibrate --key-scales tokens` for a fixed size per token"
)
_MATCHED_VALUES_UNPAGED = (
    "matched values transform-coded (a value basis) or in width classes have no fixed size per token: "
    "calibrate values as the per-token MSE stage around their mean (no value basis, no --value-classes)"
)


def _layer_calibrations(calibration: Any, unpaged: str) -> list[tuple[Any, MatchedCalibration]] | str:
    """The ``(layer, MatchedCalibration)`` pairs of a config's calibration, or why the paged
    cache does not take it (``unpaged`` and what it got)."""
    if isinstance(calibration, dict) and calibration and all(isinstance(c, MatchedCalibration) for c in calibration.values()):
        return list(calibration.items())
    got = repr(calibration) if calibration is None or isinstance(calibration, str) else f"a {type(calibration).__name__}"
    return f"{unpaged} (a paged cache needs a calibration of {{layer: MatchedCalibration}}, got {got})"


def _matched_keys_paged(calibration: Any) -> str | None:
    """Why matched keys of ``calibration`` have no fixed size per token, or None (every layer's
    keys carry per-token scales: :class:`MatchedTokenCoder`)."""
    cals = _layer_calibrations(calibration, _MATCHED_KEYS_UNPAGED)
    if isinstance(cals, str):
        return cals
    grouped = [layer for layer, c in cals if c.keys.deviations is None]
    if grouped:
        return f"matched keys coded in groups of tokens (layer {grouped[0]}): calibrate with `kvqrs calibrate --key-scales tokens` for a fixed size per token"
    return None


def _matched_values_paged(calibration: Any) -> str | None:
    """Why matched values of ``calibration`` have no fixed size per token, or None (every
    layer's values are the per-token MSE stage around the value mean: :class:`MatchedValueCoder`)."""
    cals = _layer_calibrations(calibration, _MATCHED_VALUES_UNPAGED)
    if isinstance(cals, str):
        return cals
    for layer, c in cals:
        if c.values is not None:
            return f"matched values transform-coded in groups of tokens (layer {layer} has a value basis): calibrate values as the per-token MSE stage (no value basis)"
        if c.value_classes is not None:
            return f"matched values in width classes (layer {layer}) give each token of a chunk its own width: calibrate without --value-classes"
    return None


_SPECS = (
    SchemeSpec(
        "kv",
        "norm + Lloyd-Max codes of the unrotated direction",
        keys=SideSpec(_mse, fused=True),
        values=SideSpec(_mse, fused=True),
        mse_values=True,
        log_norms=True,
        headq_base=2,
    ),
    SchemeSpec(
        "kqv",
        "rotation + norm + Lloyd-Max codes (keys); values add a 1-bit QJL residual",
        keys=SideSpec(_rotated_mse, fused=True),
        values=SideSpec(_mse_qjl, fused=True, min_bits=2),
        mse_values=True,
        headq_base=1,
    ),
    SchemeSpec(
        "qkqv",
        "rotation + (n-1)-bit Lloyd-Max codes + a 1-bit QJL residual, keys and values",
        keys=SideSpec(_mse_qjl, fused=True, min_bits=2),
        values=SideSpec(_mse_qjl, fused=True, min_bits=2),
        mse_values=True,
    ),
    SchemeSpec(
        "kivi",
        "asymmetric uniform groups: keys per channel over tokens, values per token over channels",
        keys=SideSpec(_kivi, fused=True, unpaged=f"KIVI keys {_PER_CHANNEL}"),
        values=SideSpec(_kivi, fused=True, unpaged="KIVI values are per-token groups, but kvqrs pairs them with per-channel keys only"),
        headq_base=0,
    ),
    SchemeSpec(
        "block",
        "rotation + asymmetric uniform blocks of 32 rotated coordinates (llama.cpp-style)",
        keys=SideSpec(_block, fused=True),
        values=SideSpec(_block, fused=True),
        headq_base=3,
    ),
    SchemeSpec(
        "headq",
        "a base key scheme + a rank-r side code in a basis of calibration queries, applied in score space",
        keys=SideSpec(_headq, fused=True, unpaged="HeadQ needs calibrated bases per layer"),
        control=_headq_control,
    ),
    SchemeSpec(
        "a2",
        "rotated MSE values at per-token widths allocated by attention-squared importance",
        values=SideSpec(_a2, fused=False, unpaged="A^2 gives every token its own width"),
    ),
    SchemeSpec(
        "matched",
        "a calibrated per-layer transform with water-filled widths (keys); mean-centred MSE values",
        keys=SideSpec(_matched_keys, fused=True, unpaged=_MATCHED_KEYS_UNPAGED, paged_with=_matched_keys_paged),
        values=SideSpec(_matched_values, fused=True, unpaged=_MATCHED_VALUES_UNPAGED, paged_with=_matched_values_paged),
        mse_values=True,
        log_norms=True,
        control=_matched_control,
    ),
    SchemeSpec(
        "none",
        "values kept in full precision (key-only quantization)",
        values=SideSpec(_full_precision, fused=True, unpaged="values kept in full precision", coded=False),
    ),
)

_BY_NAME: dict[str, SchemeSpec] = {s.name: s for s in _SPECS}
REGISTRY: Mapping[str, SchemeSpec] = MappingProxyType(_BY_NAME)
"""Every scheme by name, in the order the name lists below keep (a read-only view: :func:`register` adds to it)."""

_LISTS: Mapping[str, Callable[[SchemeSpec], bool]] = {
    "KEY_SCHEMES": lambda s: s.keys is not None,
    "VALUE_SCHEMES": lambda s: s.values is not None,
    "MSE_VALUE_SCHEMES": lambda s: s.mse_values,
    "LOG_NORM_VALUE_SCHEMES": lambda s: s.log_norms,
    "HEADQ_BASES": lambda s: s.headq_base is not None,
    "PAGED_SCHEMES": lambda s: s.paged,
}


def names(which: str) -> tuple[str, ...]:
    """A name list derived from :data:`REGISTRY` now (the module attributes of the same names
    are these, read when accessed; a ``from`` import keeps the list of its time):

    - ``KEY_SCHEMES``, ``VALUE_SCHEMES``: the schemes that code keys, values;
    - ``MSE_VALUE_SCHEMES``: value schemes whose values go through the MSE stage (the ones
      ``value_scale`` applies to);
    - ``LOG_NORM_VALUE_SCHEMES``: value schemes whose MSE stage may store log-coded norms
      (``value_norms="log8"``);
    - ``HEADQ_BASES``: key schemes HeadQ builds on, the default first;
    - ``PAGED_SCHEMES``: schemes whose every token has a fixed stored size that vLLM's paged
      cache stores with any settings (the others say why not: :attr:`SideSpec.unpaged`;
      ``matched`` is stored given a calibration with per-token key scales,
      :attr:`SideSpec.paged_with`).
    """
    picked = tuple(n for n, s in _BY_NAME.items() if _LISTS[which](s))
    return tuple(sorted(picked, key=lambda n: _BY_NAME[n].headq_base)) if which == "HEADQ_BASES" else picked


def __getattr__(name: str) -> tuple[str, ...]:
    if name in _LISTS:
        return names(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(spec: SchemeSpec) -> None:
    """Add ``spec`` to :data:`REGISTRY` at run time (a scheme of the package is an entry of
    ``_SPECS`` above): :class:`~kvqrs.schemes.KVCodec`, ``QuantConfig``, the name lists and
    vLLM's paged cache then take it.

    Raises:
        KvqrsError: a name already registered.
    """
    if spec.name in _BY_NAME:
        raise KvqrsError(f"scheme: {spec.name!r} is registered already")
    _BY_NAME[spec.name] = spec


def unregister(name: str) -> None:
    """Remove a scheme :func:`register` added (the package's own stay).

    Raises:
        KvqrsError: a name not registered at run time.
    """
    if name not in _BY_NAME or any(s.name == name for s in _SPECS):
        raise KvqrsError(f"scheme: {name!r} was not added by register()")
    del _BY_NAME[name]


def check_value_stage(scheme: str | None, scale: Any, norms: Any, group: Any, transform_coded: bool, what: str) -> None:
    """The value stage's settings, checked alike by :class:`KVCodec` and, before any codec is
    built, by ``QuantConfig``: ``value_scale`` and ``value_norms`` known, log8 norms with a
    ``group`` the log code takes, and either setting other than its default only for value
    schemes with that stage and not for transform-coded ``matched`` values (``what`` names
    the caller's values in the error).

    Raises:
        KvqrsError: an unknown setting, a group out of range, or a setting its values lack.
    """
    check_scale(scale, "value_scale")
    norm_params(norms, group, ("value_norms", "group"))
    for option, value, default, schemes, stage in (
        ("value_scale", scale, "norm", names("MSE_VALUE_SCHEMES"), "the MSE value stage"),
        # A QJL residual is computed against the float norm.
        ("value_norms", norms, "float", names("LOG_NORM_VALUE_SCHEMES"), "the MSE value stage without a QJL residual"),
    ):
        if value != default and (scheme not in schemes or transform_coded):
            raise KvqrsError(
                f"{option}: {value!r} applies to {stage} (value schemes {schemes}, matched without transform-coded values), not to {what}"
            )


def build_coder(settings: CoderSettings) -> Coder | None:
    """The coder of ``settings.scheme`` for ``settings.kind``, built by its registry entry
    (None for values kept in full precision and for HeadQ keys without a basis). Values'
    ``scale`` and ``norms`` are checked first (:func:`check_value_stage`).

    Raises:
        KvqrsError: a scheme that does not code that side, more than its ``max_bits``, or
            settings its coder refuses.
    """
    spec = REGISTRY.get(settings.scheme)
    side = None if spec is None else spec.side(settings.kind)
    if settings.kind == "keys":
        if side is None:
            raise KvqrsError(f"scheme: expected one of {names('KEY_SCHEMES')} for keys, got {settings.scheme!r}")
    else:
        if side is None:
            raise KvqrsError(f"value_scheme: expected one of {names('VALUE_SCHEMES')}, got {settings.scheme!r}")
        s = settings
        check_value_stage(s.scheme, s.scale, s.norms, s.group, False, f"{s.scheme!r} values")
    if settings.bits > side.max_bits:
        raise KvqrsError(f"bits: {settings.scheme} {settings.kind} take at most {side.max_bits} bits per coordinate, got {settings.bits}")
    return side.build(settings)
