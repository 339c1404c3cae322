"""What to quantize in a model's KV cache: schemes, bits, the full-precision window and HeadQ
bases, turned into one :class:`kvqrs.schemes.KVCodec` per layer."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._arrays import KvqrsError
from ..schemes import KVCodec


def same_settings(a: Any, b: Any) -> bool:
    """Whether two settings are equal, NumPy arrays (HeadQ bases, calibrations) by type, shape
    and value, inside dicts, sequences and dataclasses (``==`` on arrays is elementwise)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_settings(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_settings, a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same_settings(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return bool(a == b)


@dataclass(eq=False)
class QuantConfig:
    """KV-cache quantization settings for a whole model.

    Attributes:
        key_scheme: ``kv``, ``kqv``, ``qkqv``, ``kivi``, ``block``, ``headq``, or None to keep
            keys in full precision (value-only rows of the fast path).
        key_bits: key budget n.
        value_scheme: value scheme, or None to keep values in full precision (key-only).
        value_bits: value budget (default ``key_bits``).
        residual_length: newest tokens kept in full precision (during prefill too).
        sink_tokens: the first tokens of the sequence kept in full precision for good (attention
            sinks, Xiao et al. 2023, "Efficient Streaming Language Models with Attention
            Sinks"); quantized tokens start after them. The first forward (the prompt) must hold
            at least this many tokens.
        sink_dtype: the dtype the sinks are stored in: None (default) the model's, or
            ``"float16"`` / ``"bfloat16"`` (rounded once when they enter the cache, read back in
            the model's dtype; the fast path rounds them the same way). Needs
            ``sink_tokens >= 1``.
        seed: seed of every rotation and sketch.
        group: KIVI / block group size (KIVI keys flush in chunks of ``group`` tokens, whose
            packed codes must fill whole bytes: ``group * key_bits`` a multiple of 8; the
            ``matched`` scheme's widths go up to 8 bits, so there ``group`` is a multiple of 8).
        headq_base, rank, side_bits, sign: HeadQ settings (see :class:`KVCodec`).
        calibration: for the ``matched`` scheme, ``{layer: MatchedCalibration}``
            (:func:`kvqrs.hf.calibrate_matched`, saved by ``kvqrs calibrate``); ``group`` is then
            its key scale group in tokens. A file read by :func:`kvqrs.hf.load_matched` (a
            :class:`~kvqrs.hf.calibration.CalibrationFile`) brings the settings it was made
            with: ``group``, ``sink_tokens``, ``sink_dtype``, ``value_norms`` and
            ``value_scale`` (:func:`~kvqrs.hf.calibration.recorded_settings`) apply to those
            of these fields the constructor was not given (the value settings where the values
            are ``matched`` without ``value_transform``; a recorded ``sink_dtype`` only with
            sinks), while a field passed explicitly keeps its value (e.g. another
            ``value_scale`` to compare; :meth:`preset` refuses that instead). Set on a built
            config or by ``dataclasses.replace`` (which passes every field), nothing is taken
            from the file; a plain dict records nothing. A recorded setting the config refuses
            raises naming the file. ``"prefill"`` to self-calibrate: each layer fits its
            calibration on the first forward (the prompt: its queries' second moment, its keys
            and values after the sinks, ``key_bits`` average key code bits) and codes every
            later token with it (:func:`kvqrs.schemes.matched.fit_layer`); ``"random"`` for
            the random-basis control.
        value_transform: with ``calibration="prefill"``, transform-code the values too (the
            KLT of the prompt's values, water-filled widths at ``value_bits``); else values get
            the per-token rotated Lloyd-Max stage around the prompt's value mean.
        value_scale: what each value token's MSE stage stores, ``"norm"`` (default),
            ``"least_squares"`` (the least-squares scale of the decoded direction: the same
            bits and decode, a smaller value error) or ``"preserve_norm"`` (the decoded value
            keeps the token's norm: no shrinkage of the attention output's scale;
            :func:`kvqrs.mse_encode`, :class:`~kvqrs.schemes.KVCodec`). Only for
            value schemes with an MSE stage (``kv``, ``kqv``, ``qkqv``, ``matched`` without
            ``value_transform``).
        value_norms: how that scale is stored, ``"float"`` (float16/float32, default) or
            ``"log8"`` (8 bits on a 1/16-octave grid with an exponent byte per ``group``
            tokens, ``group`` at most 2^20: half the bits of a float16 norm, docs/kernels.md
            section 13). Only for
            ``kv`` and ``matched`` values (without ``value_transform``); the cache then flushes
            whole groups of ``group`` tokens (as with KIVI or matched keys).
        bases: HeadQ bases per layer, ``{layer: (kv_heads, d, r)}``, or ``"random"`` for the
            random-basis control.
        a2_uniform: with ``value_scheme="a2"``, give every token the same width (the uniform
            baseline of the A^2 allocation).
        fused: decode steps (at most ``kvqrs.hf.layer.FUSED_MAX_QUERY`` new tokens) attend
            straight from the stored codes (``KVCodec.fused_attention``) and merge the
            full-precision window by log-sum-exp, instead of decoding the whole cache each step.
            Used where the codec has a fused read path, for float32 / float16 / bfloat16 models
            (the kernel computes in float32; a float64 model keeps the float64 decoded path).
        a2_lookahead: with ``value_scheme="a2"``, estimate token j's importance from the queries
            ``j .. j + a2_lookahead - 1`` only: those that read it while it sat in the
            full-precision window, so at most ``residual_length`` (causal: what a cache knows
            when the token leaves the window). None: every query of the window (an oracle that
            uses future queries, an upper bound).
    """

    key_scheme: str | None
    key_bits: int
    value_scheme: str | None = None
    value_bits: int | None = None
    residual_length: int = 0
    sink_tokens: int = 0
    sink_dtype: str | None = None
    seed: int = 0
    group: int = 32
    headq_base: str = "kivi"
    rank: int = 4
    side_bits: int = 4
    sign: int = 1
    bases: Any = None
    a2_uniform: bool = False
    a2_lookahead: int | None = None
    fused: bool = True
    calibration: Any = None
    value_transform: bool = False
    value_scale: str = "norm"
    value_norms: str = "float"

    def __getstate__(self) -> dict:
        # The per-layer codecs are a cache built from the settings (and hold kernel functions
        # that do not pickle): copies and pickles carry the settings only and build their own.
        return {**self.__dict__, "_codecs": {}, "_chunk": None, "_validating": False, "_in_use": False}

    def __repr__(self) -> str:
        # The generated repr printed every array of a calibration or HeadQ bases (hundreds of
        # thousands of characters): those fields are summarised.
        fields = ", ".join(f"{f.name}={_summary(getattr(self, f.name))}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        # Field by field, arrays by value (the generated __eq__ raised on NumPy HeadQ bases).
        return type(other) is type(self) and same_settings(self, other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass with eq

    def __setattr__(self, name: str, value: Any) -> None:
        # Setting a field of a built config validates the new settings (restoring the old value
        # when they are refused) and drops the codecs built from the old ones.
        if name.startswith("_") or "_codecs" not in self.__dict__ or self.__dict__.get("_validating"):
            object.__setattr__(self, name, value)
            return
        if self.__dict__.get("_in_use"):
            raise KvqrsError(
                f"{name}: this config belongs to a QuantizedKVCache, whose codes were made with it; "
                "build a new config (dataclasses.replace) and a new cache"
            )
        old, codecs = self.__dict__.get(name), self._codecs
        object.__setattr__(self, name, value)
        try:
            self._revalidate()
        except KvqrsError:
            object.__setattr__(self, name, old)
            object.__setattr__(self, "_codecs", codecs)  # built from the old, valid settings
            raise

    def in_use_copy(self) -> QuantConfig:
        """A copy of these settings whose fields cannot be set (a cache's own config)."""
        c = copy.copy(self)
        object.__setattr__(c, "_in_use", True)
        return c

    def _revalidate(self) -> None:
        object.__setattr__(self, "_validating", True)
        try:
            self.__post_init__()
        finally:
            object.__setattr__(self, "_validating", False)

    def __post_init__(self) -> None:
        # Per-layer codecs built from the settings, and the chunk read off their layouts: caches,
        # not fields (replace, asdict and copies carry the settings only).
        self._codecs: dict = {}
        self._chunk: int | None = None
        given = self.__dict__.pop("_given", None)  # set by the constructor alone (_recording_init)
        applied = {} if given is None else self._apply_recorded(given)
        try:
            self._check_settings()
        except KvqrsError as e:
            if not applied:
                raise
            raise KvqrsError(f"{e} (taken from calibration file {self.calibration.path!r}: {applied})") from None

    def _apply_recorded(self, given: frozenset) -> dict:
        """Set the fields a :class:`~kvqrs.hf.calibration.CalibrationFile` records and the
        constructor was not ``given`` (see ``calibration``); returns those set."""
        meta = getattr(self.calibration, "meta", None)
        if not isinstance(self.calibration, dict) or meta is None or "matched" not in (self.key_scheme, self.value_scheme):
            return {}
        from .calibration import recorded_settings

        recorded = recorded_settings(meta, self.calibration.path)
        if self.value_scheme != "matched" or self.value_transform:  # no MSE value stage takes them
            recorded.pop("value_norms"), recorded.pop("value_scale")
        sinks = self.sink_tokens if "sink_tokens" in given else recorded.get("sink_tokens", self.sink_tokens)
        if not sinks:
            recorded.pop("sink_dtype")  # nothing to store in it
        applied = {k: v for k, v in recorded.items() if k not in given and getattr(self, k) != v}
        for k, v in applied.items():
            object.__setattr__(self, k, v)
        return applied

    def _check_settings(self) -> None:
        from .._arrays import check_bits, check_seed
        from ..schemes.registry import check_value_stage, names

        if self.key_scheme is not None and self.key_scheme not in names("KEY_SCHEMES"):
            raise KvqrsError(f"key_scheme: expected one of {names('KEY_SCHEMES')} or None, got {self.key_scheme!r}")
        if self.value_scheme is not None and self.value_scheme not in names("VALUE_SCHEMES"):
            raise KvqrsError(f"value_scheme: expected one of {names('VALUE_SCHEMES')} or None, got {self.value_scheme!r}")
        check_bits(self.key_bits, "key_bits")
        if self.value_bits is not None:
            check_bits(self.value_bits, "value_bits")
        # A QJL residual takes one of the bits: (n-1)-bit Lloyd-Max + 1-bit sketch.
        if self.key_scheme == "qkqv" and self.key_bits < 2:
            raise KvqrsError(f"key_bits: expected >= 2 for qkqv keys (a QJL residual takes 1 bit), got {self.key_bits}")
        if self.value_scheme in ("kqv", "qkqv") and (self.value_bits or self.key_bits) < 2:
            raise KvqrsError(
                f"value_bits: expected >= 2 for {self.value_scheme} values (a QJL residual takes 1 bit), got {self.value_bits or self.key_bits}"
            )
        for name in ("residual_length", "sink_tokens", "seed", "group", "rank", "side_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise KvqrsError(f"{name}: expected an integer, got {value!r}")
        for name in ("residual_length", "sink_tokens"):
            if getattr(self, name) < 0:
                raise KvqrsError(f"{name}: expected >= 0, got {getattr(self, name)}")
        check_seed(self.seed, "seed", optional=False)
        for name in ("group", "rank"):
            if getattr(self, name) < 1:
                raise KvqrsError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if not 1 <= self.side_bits <= 8:
            raise KvqrsError(f"side_bits: expected HeadQ side-code bits in 1..8, got {self.side_bits}")
        if isinstance(self.sign, bool) or self.sign not in (1, -1):
            raise KvqrsError(f"sign: expected 1 or -1 (the wrong-sign HeadQ control), got {self.sign!r}")
        if self.headq_base not in names("HEADQ_BASES"):
            raise KvqrsError(f"headq_base: expected one of {names('HEADQ_BASES')}, got {self.headq_base!r}")
        for name in ("a2_uniform", "fused", "value_transform"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise KvqrsError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        # Per-channel codes are packed along tokens and join a cache a group at a time: a group's
        # codes must fill whole bytes.
        if self._kivi_keys and self.group * self.key_bits % 8:
            raise KvqrsError(
                f"group: KIVI keys pack each channel's codes along tokens, so group x key_bits must be a multiple of 8 "
                f"(whole bytes per group), got group {self.group} at {self.key_bits} bits"
            )
        per_channel = self.key_scheme == "matched" or (self.value_scheme == "matched" and self.value_transform)
        if per_channel and self.group % 8:
            raise KvqrsError(
                f"group: the matched scheme packs each coordinate's codes along tokens at widths 1..8, so group must be a "
                f"multiple of 8 (whole bytes per group), got {self.group}"
            )
        if self.calibration is None and "matched" in (self.key_scheme, self.value_scheme):
            raise KvqrsError(
                "calibration: the matched scheme needs one: {layer: MatchedCalibration} (kvqrs.hf.calibrate_matched, or "
                "`kvqrs calibrate` and kvqrs.hf.load_matched), 'prefill' (fitted on the prompt) or 'random' (the control)"
            )
        if isinstance(self.calibration, dict) and not self.calibration:
            raise KvqrsError("calibration: an empty dict; expected {layer: MatchedCalibration} for every layer, 'prefill' or 'random'")
        if isinstance(self.calibration, str):
            if self.calibration not in ("random", "prefill"):
                raise KvqrsError(
                    f"calibration: expected {{layer: MatchedCalibration}}, 'prefill' or 'random', got {self.calibration!r} "
                    "(a calibration file is read by kvqrs.hf.load_matched(path), or QuantConfig.preset(name, path))"
                )
            if "matched" not in (self.key_scheme, self.value_scheme):
                raise KvqrsError(
                    f"calibration: {self.calibration!r} applies to the matched scheme only, not {self.key_scheme!r}/{self.value_scheme!r}"
                )
        # The codec's own check, run before any codec is built (value_transform makes the
        # matched values transform-coded).
        what = "value_transform=True" if self.value_transform else f"value_scheme={self.value_scheme!r}"
        check_value_stage(self.value_scheme, self.value_scale, self.value_norms, self.group, self.value_transform, what)
        if self.sink_dtype not in SINK_DTYPES:
            raise KvqrsError(f"sink_dtype: expected None or one of {tuple(SINK_DTYPES)[1:]}, got {self.sink_dtype!r}")
        if self.sink_dtype is not None and self.sink_tokens == 0:
            raise KvqrsError(
                f"sink_dtype: {self.sink_dtype!r} sets how sink tokens are stored, but sink_tokens is 0 (no sinks); "
                "set sink_tokens >= 1 or sink_dtype=None"
            )
        if self.a2_lookahead is not None and not 1 <= self.a2_lookahead <= self.residual_length:
            raise KvqrsError(
                f"a2_lookahead: expected 1 .. residual_length ({self.residual_length}) so that only queries that "
                f"read a token in full precision weigh it, got {self.a2_lookahead}"
            )

    @property
    def _kivi_keys(self) -> bool:
        """Keys coded per channel in KIVI groups of tokens (``kivi``, HeadQ over ``kivi``)."""
        return self.key_scheme == "kivi" or (self.key_scheme == "headq" and self.headq_base == "kivi")

    @property
    def chunk(self) -> int:
        """Tokens per flush: the fewest tokens at whose multiples every stored part of the keys
        and values can be cut, as the codec's declared layouts state it
        (:meth:`KVCodec.align <kvqrs.schemes.KVCodec.align>`): ``group`` where a part is shared
        by a group of tokens (KIVI and ``matched`` keys per channel, log-coded value norms'
        exponents, width classes), 1 where every token stores its own."""
        chunk = self.__dict__.get("_chunk")
        if chunk is None:
            chunk = self._layout_codec().align()
            object.__setattr__(self, "_chunk", chunk)
        return chunk

    def _layout_codec(self) -> KVCodec:
        """A codec of these settings for the layouts alone: a given calibration's first layer
        (its value width classes, if any), or, not given or not yet fitted, the scheme's seeded
        control (its registry entry's) with transform-coded values when ``value_transform``;
        the token alignment of every layout is the same at any head_dim and layer."""
        from ..schemes.registry import REGISTRY

        given = next(iter(self.calibration.values())) if isinstance(self.calibration, dict) and self.calibration else None
        head_dim = max(64, self.rank) if given is None else given.keys.basis.shape[-1]  # a HeadQ basis of rank columns
        kw: dict[str, Any] = {}
        for scheme, bits in ((self.key_scheme, self.key_bits), (self.value_scheme, self.value_bits or self.key_bits)):
            if scheme is not None:
                kw.update(REGISTRY[scheme].control_kwargs(head_dim, bits, self.seed))
        if "calibration" in kw:  # a layer's own (its value classes, if any), or the control shaped as one fitted
            cal = given if given is not None else kw["calibration"]
            kw["calibration"] = dataclasses.replace(cal, values=cal.keys) if self.value_transform and given is None else cal
        return self._new_codec(head_dim, **kw)

    def _new_codec(self, head_dim: int, **kw: Any) -> KVCodec:
        """A codec of these settings at ``head_dim``; ``kw``: its calibration or HeadQ basis."""
        return KVCodec(
            self.key_scheme or "kv",
            self.key_bits,
            head_dim,
            seed=self.seed,
            value_bits=self.value_bits,
            value_scheme=self.value_scheme or "none",
            group=self.group,
            headq_base=self.headq_base,
            rank=self.rank,
            side_bits=self.side_bits,
            sign=self.sign,
            value_scale=self.value_scale,
            value_norms=self.value_norms,
            **kw,
        )

    def quantized_count(self, seen: int) -> int:
        """Tokens quantized after ``seen`` tokens: whole chunks between the sinks and the
        full-precision window (positions ``quantized_span(seen)``)."""
        return max(0, (seen - self.sink_tokens - self.residual_length) // self.chunk * self.chunk)

    def quantized_span(self, seen: int) -> tuple[int, int]:
        """Positions ``[start, stop)`` held quantized after ``seen`` tokens: the sinks
        (``0 .. sink_tokens - 1``) and the newest ``residual_length`` tokens stay in full
        precision; chunks count from the first token after the sinks."""
        return self.sink_tokens, self.sink_tokens + self.quantized_count(seen)

    def quantized_ends(self, seen) -> np.ndarray:
        """``quantized_span(n)[1]`` for every count ``n`` of the integer array ``seen`` (one
        NumPy expression: a prefill asks it once per query)."""
        seen = np.asarray(seen, dtype=np.int64)
        s, r, c = self.sink_tokens, self.residual_length, self.chunk
        return s + np.maximum(0, (seen - s - r) // c * c)

    def codec(self, layer: int, head_dim: int, fitted: Any = None) -> KVCodec:
        """The (cached) codec of one layer; ``fitted``: the layer's ``matched`` calibration
        fitted on a prefill (``calibration="prefill"``), used instead of the config's (that
        codec is built anew, not cached: the layer that fitted it keeps it)."""
        key = (layer, head_dim)
        if fitted is not None:
            return self._build_codec(layer, head_dim, fitted)
        if key not in self._codecs:
            calibration = self._matched_calibration(layer, head_dim) if "matched" in (self.key_scheme, self.value_scheme) else None
            self._codecs[key] = self._build_codec(layer, head_dim, calibration)
        return self._codecs[key]

    def _build_codec(self, layer: int, head_dim: int, calibration: Any) -> KVCodec:
        basis = None
        if self.key_scheme == "headq":
            if isinstance(self.bases, str):
                basis = self.bases
            elif self.bases is None or layer not in self.bases:
                raise KvqrsError(
                    f"bases: the headq scheme needs a calibrated basis for layer {layer} (see kvqrs.hf.calibrate) or bases='random'"
                )
            else:
                basis = np.asarray(self.bases[layer])
        return self._new_codec(head_dim, basis=basis, calibration=calibration)

    @classmethod
    def preset(cls, name: str, calibration: Any = None, /, **overrides: Any) -> QuantConfig:
        """A recommended configuration per budget (see :data:`PRESETS` and docs/schemes.md for
        the measurements they were chosen from).

        Without a calibration file the preset is calibrated on the prompt: every layer fits its
        ``matched`` calibration on the first forward's queries, keys and values
        (``calibration="prefill"``) at the preset's value bits for keys and values alike (the
        per-layer widths need a file), with the preset's other settings; that is
        ``QuantConfig("matched", b, "matched", b, calibration="prefill", group=..., sink_tokens=...,
        sink_dtype=..., value_norms=..., value_scale=...)`` with ``PRESETS[name]``'s values (its
        stored bits per element, the fitted calibration counted, measured 4.17 / 3.17 / 2.29 at
        head_dim 64 on a long prompt). A file refines it: per-layer key and value widths fitted
        on calibration text (measured in docs/evaluation.md).

        Args:
            name: ``"4bit"``, ``"3bit"`` or ``"2bit"``: the average stored bits per element of
                keys and values, every byte counted (codes, scales, norms, sinks).
            calibration: None (or ``"prefill"``, the same): calibrated on the prompt, as above;
                or ``{layer: MatchedCalibration}`` with the preset's per-layer widths
                (``kvqrs calibrate --preset NAME``, or
                :func:`kvqrs.hf.calibration.allocate_matched` with the preset's ``budget``,
                ``key_widths``, ``value_widths``, ``group``, ``sink_tokens``, ``value_norms``,
                ``sink_dtype`` and ``value_scale``), or the path of that file (a dict read by
                :func:`kvqrs.hf.load_matched` is checked against what its file records, as the
                path would be).
            overrides: other :class:`QuantConfig` fields (``residual_length``, ``seed``, ...;
                not the schemes, bits or calibration the preset sets); ``sink_tokens=0`` without
                a ``sink_dtype`` also drops the preset's sink dtype (there are no sinks to store
                in it). Against a file, the settings its widths depend on (``group``,
                ``sink_tokens``, ``sink_dtype``, ``value_norms``, ``value_scale``) must stay as
                it records them.

        Returns:
            A ``matched`` config with the preset's ``group``, ``sink_tokens``, ``sink_dtype``,
            ``value_norms`` and ``value_scale``; its ``calibration`` is ``"prefill"`` without a
            file, else the file's.

        Raises:
            KvqrsError: an unknown name (the message lists them), an override of a field the
                preset sets or of no field, ``calibration="random"`` (the random-basis control
                is a plain ``QuantConfig``), an empty dict, a file that is not a calibration or
                is damaged, or a calibration file made for another preset, recording another
                budget, key or value widths, or settings other than the config's (the preset's
                with the overrides: group, sink tokens, value norms, sink dtype, value scale),
                or not recording its group, sink tokens, budget and widths (a file of an older
                version: make it again).
        """
        if name not in PRESETS:
            raise KvqrsError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
        # Positional-only, so that a second calibration (or a key_scheme) among the overrides is
        # refused below by name instead of as Python's TypeError.
        if calibration is None and "calibration" in overrides:
            calibration = overrides.pop("calibration")
        if calibration is None:
            calibration = "prefill"  # the same config, asked for by name
        if isinstance(calibration, str) and calibration == "random":
            p = PRESETS[name]
            raise KvqrsError(
                f"preset: {name!r} is calibrated on the prompt (no calibration, or 'prefill') or by a file fitted for it "
                f"(`kvqrs calibrate --preset {name}`), not calibration='random' (the random-basis control: "
                f"QuantConfig('matched', {p['value_bits']}, 'matched', {p['value_bits']}, group={p['group']}, calibration='random'))"
            )
        if not isinstance(calibration, (dict, str, os.PathLike)):
            raise KvqrsError(
                f"preset: calibration: expected a {{layer: MatchedCalibration}} dict or a file path, got {type(calibration).__name__}"
            )
        if isinstance(calibration, dict) and not calibration:
            raise KvqrsError(f"preset: {name!r} got an empty calibration dict; expected {{layer: MatchedCalibration}} for every layer")
        fields = {f.name for f in dataclasses.fields(cls)}
        fixed = ("key_scheme", "key_bits", "value_scheme", "value_bits", "calibration")
        if set(overrides) & set(fixed) or not set(overrides) <= fields:
            bad = sorted(k for k in overrides if k in fixed or k not in fields)
            raise KvqrsError(
                f"preset: overrides: expected QuantConfig fields other than those the preset sets ({', '.join(fixed)}), got {bad}"
            )
        p = PRESETS[name]
        kw = {k: p[k] for k in ("group", "sink_tokens", "sink_dtype", "value_norms", "value_scale")}
        if overrides.get("sink_tokens") == 0 and "sink_dtype" not in overrides:
            kw["sink_dtype"] = None
        kw.update(overrides)
        if not isinstance(calibration, dict) and calibration != "prefill":  # a file ("prefill": fitted on the prompt)
            from .calibration import load_matched

            calibration = load_matched(calibration)  # first: another file is refused as not a calibration
        if isinstance(getattr(calibration, "meta", None), dict):  # a file's, read by load_matched
            _check_preset_file(name, p, calibration.meta, calibration.path, kw)
        return cls("matched", p["value_bits"], "matched", p["value_bits"], calibration=calibration, **kw)

    def _matched_calibration(self, layer: int, head_dim: int):
        """The ``matched`` calibration of ``layer``: fitted (``calibration[layer]``) or the
        seeded random-basis control (``calibration="random"``)."""
        if self.calibration == "prefill":
            raise KvqrsError(
                f"calibration: layer {layer} has not fitted its matched calibration yet (calibration='prefill' fits it on the "
                "first forward through the kvqrs attention, from that forward's queries, keys and values)"
            )
        if isinstance(self.calibration, str):
            if self.calibration != "random":
                raise KvqrsError(f"calibration: expected {{layer: MatchedCalibration}}, 'prefill' or 'random', got {self.calibration!r}")
            from ..schemes.codec import derive_seed
            from ..schemes.matched import random_calibration

            return random_calibration(head_dim, self.key_bits, derive_seed(self.seed, 1000 + layer))
        if not isinstance(self.calibration, dict) or layer not in self.calibration:
            raise KvqrsError(
                f"calibration: the matched scheme needs a calibration for layer {layer} "
                "(kvqrs.hf.calibrate_matched, or `kvqrs calibrate` and kvqrs.hf.load_matched), calibration='prefill' "
                "(fitted on the prompt), or calibration='random'"
            )
        return self.calibration[layer]

    def store_sinks(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sink tokens as the cache stores them (``sink_dtype``; unchanged when None).

        Raises:
            KvqrsError: a sink value beyond the finite range of ``sink_dtype`` (float16 tops
                out at 65504; it would be stored as infinity).
        """
        dtype = SINK_DTYPES[self.sink_dtype]
        if dtype is None or tokens.dtype == dtype:
            return tokens
        out = tokens.to(dtype)
        if tokens.numel() and not torch.isfinite(out).all() and torch.isfinite(tokens).all():
            raise KvqrsError(
                f"sink_dtype: a sink value of magnitude {float(tokens.abs().max()):.4g} is beyond {self.sink_dtype}'s range; "
                "use sink_dtype='bfloat16' or None"
            )
        return out

    def round_sinks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., T, d)`` with its first ``sink_tokens`` positions rounded to ``sink_dtype``
        and back (what the cache reads of them); ``x`` itself when nothing changes."""
        n = min(self.sink_tokens, x.shape[-2])
        if SINK_DTYPES[self.sink_dtype] is None or n == 0:
            return x
        return torch.cat([self.store_sinks(x[..., :n, :]).to(x.dtype), x[..., n:, :]], dim=-2)

    def sink_bits(self, model_bits: int) -> int:
        """Stored bits per sink element: ``sink_dtype``'s, or the model's ``model_bits``."""
        dtype = SINK_DTYPES[self.sink_dtype]
        return model_bits if dtype is None else torch.finfo(dtype).bits

    @property
    def quantizes_keys(self) -> bool:
        return self.key_scheme is not None

    @property
    def has_value_classes(self) -> bool:
        """Whether a layer's calibration codes values in width classes (each token weighed by
        the queries that read it: :func:`kvqrs.hf.attention.causal_importance`)."""
        cal = self.calibration
        return isinstance(cal, dict) and any(getattr(c, "value_classes", None) for c in cal.values())

    def label(self) -> str:
        """Short row label, e.g. ``kqv-k4v4`` or ``headq(kivi)-k2``."""
        k = f"{self.key_scheme}({self.headq_base})" if self.key_scheme == "headq" else self.key_scheme
        if self.key_scheme == "headq" and self.sign < 0:
            k += "[wrong-sign]"
        if self.key_scheme == "headq" and isinstance(self.bases, str):
            k += "[random-basis]"
        v = "" if self.value_scheme is None else f" v:{self.value_scheme}{self.value_bits or self.key_bits}"
        if self.value_scale != "norm":
            v += "[ls-scale]" if self.value_scale == "least_squares" else f"[{self.value_scale}]"
        if self.value_norms != "float":
            v += f"[{self.value_norms}-norms]"
        sinks = f" sinks:{self.sink_tokens}" if self.sink_tokens else ""
        if self.sink_tokens and self.sink_dtype:
            sinks += f"[{self.sink_dtype}]"
        return f"{k} k{self.key_bits}{v}{sinks}"


def _recording_init(init: Any) -> Any:
    """The dataclass constructor, noting which fields its caller passed (``_given``, read once
    by ``__post_init__``): a calibration file's settings apply to the others."""
    names = [f.name for f in dataclasses.fields(QuantConfig) if f.init]

    @functools.wraps(init)
    def __init__(self: QuantConfig, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_given", frozenset(names[: len(args)]).union(kwargs))
        init(self, *args, **kwargs)

    return __init__


QuantConfig.__init__ = _recording_init(QuantConfig.__init__)  # type: ignore[method-assign]


def _span(values: list) -> str:
    """``3`` or ``3..5``: the range of some numbers."""
    lo, hi = min(values), max(values)
    return f"{lo:g}" if lo == hi else f"{lo:g}..{hi:g}"


def _summary(value: Any) -> str:
    """A field of :class:`QuantConfig` in its repr: an array by dtype and shape, a per-layer dict
    (a calibration, HeadQ bases) by its class, layers and bits or shapes; else ``repr``."""
    if isinstance(value, np.ndarray):
        return f"<{value.dtype} array {value.shape}>"
    if not isinstance(value, dict) or not value:
        return repr(value)
    items = list(value.values())
    layers = f"{len(value)} layers" if len(value) != 1 else f"layer {next(iter(value))!r}"
    path = getattr(value, "path", None)
    head = f"{type(value).__name__}{'' if path is None else f' {path!r}'}: {layers}"
    if all(hasattr(getattr(c, "keys", None), "code_bits") for c in items):  # MatchedCalibration per layer
        out = f"{head} of {type(items[0]).__name__}, key code bits {_span([c.keys.code_bits() for c in items])}"
        widths = [c.value_bits for c in items if getattr(c, "value_bits", None) is not None]
        return f"<{out}, value bits {_span(widths) if widths else 'the config'}>"
    shapes = sorted({str(getattr(v, "shape", type(v).__name__)) for v in items})
    return f"<{head}, {' '.join(shapes[:3])}{' ...' if len(shapes) > 3 else ''}>"


def _check_preset_file(name: str, preset: dict, meta: dict, path: Any, settings: dict) -> None:
    """Refuse a calibration file made for another preset, or whose recorded settings differ from
    the config's ``settings`` (the preset's, overrides applied): its widths were allocated for
    them (another budget, widths, group, value norms, sinks or sink dtype count other bits,
    another value scale measured other sensitivities)."""
    fix = f"make it with `kvqrs calibrate --preset {name}`"
    if meta.get("preset", name) != name:
        raise KvqrsError(f"calibration: {str(path)!r} was made for preset {meta['preset']!r}, not {name!r}; {fix}")
    # A --budget file without a preset name is the preset's when the allocation's inputs are.
    allocation = ("budget", "key_widths", "value_widths")
    needed = ("group", "sink_tokens", *allocation)
    missing = [k for k in needed if k not in meta]
    if missing:  # a file of an older version or written by hand: what it was fitted for is unknown
        raise KvqrsError(f"calibration: {str(path)!r} does not record its {', '.join(missing)}; {fix}")
    from .calibration import recorded_settings

    recorded = {k: None if v is None else str(v) for k, v in recorded_settings(meta, str(path)).items()}
    wanted = {k: (None if settings[k] is None else str(settings[k])) for k in recorded}
    recorded.update({k: _numbers(meta[k]) for k in allocation})
    wanted.update({k: _numbers(preset[k]) for k in allocation})
    differ = [f"{k} {recorded[k]!r} (the config's: {wanted[k]!r})" for k in recorded if recorded[k] != wanted[k]]
    if differ:
        raise KvqrsError(
            f"calibration: {str(path)!r} was made with {', '.join(differ)}; {fix}, or leave those settings as the file has them"
        )


def _numbers(value: Any) -> str:
    """A number or numbers (``4.25``, ``(3, 4)``, ``"3.0 4.0"``) as one comparable string."""
    items = value if isinstance(value, (tuple, list)) else str(value).split()
    try:
        return " ".join(str(float(x)) for x in items)
    except ValueError:
        return str(value)


SINK_DTYPES: dict[str | None, Any] = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The storage dtypes of ``QuantConfig.sink_dtype`` (None: the model's)."""

PRESETS: dict[str, dict[str, Any]] = {
    # Per-layer key and value widths among ``key_widths`` (average key code bits) and
    # ``value_widths`` from measured sensitivity within ``budget`` average stored bits per
    # element (every byte counted), on llama.cpp's perplexity protocol (docs/evaluation.md);
    # ``value_bits`` labels the config (each layer's widths override it). Value norms as 8-bit
    # log codes and float16 sinks free bits the widths spend (KL -10% to -17%, measured);
    # norm-preserving value scales remove the decoded values' shrinkage (KL -2% to -12%).
    "4bit": {
        "budget": 4.25,
        "key_widths": (3, 3.5, 4, 4.5, 5),
        "value_widths": (3, 4, 5),
        "group": 256,
        "value_bits": 4,
        "sink_tokens": 1,
        "value_norms": "log8",
        "sink_dtype": "float16",
        "value_scale": "preserve_norm",
    },
    "3bit": {
        "budget": 3.25,
        "key_widths": (2.5, 3, 3.5, 4),
        "value_widths": (2, 3, 4),
        "group": 256,
        "value_bits": 3,
        "sink_tokens": 1,
        "value_norms": "log8",
        "sink_dtype": "float16",
        "value_scale": "preserve_norm",
    },
    "2bit": {
        "budget": 2.5,
        "key_widths": (1.5, 2, 2.5, 3),
        "value_widths": (1, 2, 3),
        "group": 128,
        "value_bits": 2,
        "sink_tokens": 1,
        "value_norms": "log8",
        "sink_dtype": "float16",
        "value_scale": "preserve_norm",
    },
}
"""The recommended presets of :meth:`QuantConfig.preset`."""
