"""HeadQ calibration: per layer and KV head, the rank-r PCA basis (top eigenvectors of the
uncentred second moment) of the post-RoPE queries of the heads in that group, from a
calibration text disjoint from the evaluation text (docs/kernels.md section 7). Saved and loaded as ``.npz``."""

from __future__ import annotations

import io
import pathlib
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .._arrays import KvqrsError, check_bits, check_positive_int
from ..kernels import headq_basis
from ..schemes.width_classes import unit_weights
from ..torch import to_numpy
from .attention import AttentionState, active, register

FORMAT = "kvqrs-headq-bases-v1"


class _QueryRecorder(AttentionState):
    """Attention state that records queries and lets attention run unchanged."""

    def __init__(self) -> None:
        self.queries: dict[int, list[np.ndarray]] = {}

    def attend(self, module, query, key, value, attention_mask, scaling):
        q = to_numpy(query, "query")  # (batch, q_heads, len, d)
        kv_heads = key.shape[1]
        g = q.shape[1] // kv_heads
        # Heads h*g .. h*g+g-1 read KV head h: stack their queries per group.
        grouped = q.reshape(q.shape[0], kv_heads, g, q.shape[2], q.shape[3]).transpose(1, 0, 2, 3, 4)
        self.queries.setdefault(module.layer_idx, []).append(grouped.reshape(kv_heads, -1, q.shape[3]).copy())
        return None


def calibrate(model: torch.nn.Module, windows: Iterable[torch.Tensor], rank: int = 4) -> dict[int, np.ndarray]:
    """Run ``model`` (``attn_implementation="kvqrs"``) over calibration token windows and fit
    the bases. Returns ``{layer: float32 (kv_heads, head_dim, rank)}``."""
    register()
    rec = _QueryRecorder()
    with torch.no_grad(), active(rec):
        for ids in windows:
            model(ids)
    if not rec.queries:
        raise KvqrsError("calibration: no queries were recorded (is the model using attn_implementation='kvqrs'?)")
    return {
        layer: np.stack([headq_basis(h, rank) for h in np.concatenate(chunks, axis=1)]) for layer, chunks in sorted(rec.queries.items())
    }


def save_bases(path: str | pathlib.Path, bases: dict[int, np.ndarray], meta: dict | None = None) -> pathlib.Path:
    """Write bases to ``path`` (.npz) with a format tag and optional metadata strings."""
    p = pathlib.Path(path)
    arrays = {f"layer_{k}": np.asarray(v, dtype=np.float32) for k, v in bases.items()}
    extra = {f"meta_{k}": np.array(str(v)) for k, v in (meta or {}).items()}
    np.savez(p, format=np.array(FORMAT), **arrays, **extra)
    return p if p.suffix == ".npz" else p.with_name(p.name + ".npz")


def load_bases(path: str | pathlib.Path) -> dict[int, np.ndarray]:
    """Read bases written by :func:`save_bases`; raises :class:`KvqrsError` on another file."""
    try:
        with np.load(pathlib.Path(path), allow_pickle=False) as z:
            if "format" not in z or str(z["format"]) != FORMAT:
                raise KvqrsError(f"bases: {str(path)!r} is not a kvqrs HeadQ basis file ({FORMAT})")
            return {int(k[6:]): z[k] for k in z.files if k.startswith("layer_")}
    except (OSError, ValueError) as e:
        raise KvqrsError(f"bases: cannot read {str(path)!r}: {e}") from None


class _KVQRecorder(AttentionState):
    """Attention state that records per layer the queries grouped per KV head, the keys and the
    values of every window (positions ``skip..``), and lets attention run unchanged."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.q: dict[int, list[np.ndarray]] = {}
        self.k: dict[int, list[np.ndarray]] = {}
        self.v: dict[int, list[np.ndarray]] = {}

    def attend(self, module, query, key, value, attention_mask, scaling):
        s = self.skip
        kv_heads, d = key.shape[1], key.shape[3]
        q = to_numpy(query, "query")[0, :, s:]  # (q_heads, len, d)
        g = q.shape[0] // kv_heads
        self.q.setdefault(module.layer_idx, []).append(q.reshape(kv_heads, g * q.shape[1], d).copy())
        self.k.setdefault(module.layer_idx, []).append(to_numpy(key, "keys")[0, :, s:].copy())
        self.v.setdefault(module.layer_idx, []).append(to_numpy(value, "values")[0, :, s:].copy())
        return None


def record_matched(model, windows: Iterable[torch.Tensor], skip: int = 0, progress: bool = False) -> dict:
    """Run ``model`` over calibration windows and collect what the ``matched`` calibration
    needs, per layer: ``(query second moment (kv_heads, d, d), keys (kv_heads, n, d), values
    (kv_heads, n, d))``, positions ``skip..`` of each window (the sink tokens a cache keeps in
    full precision are never coded, so they are left out of the statistics). ``progress``: a
    progress bar (tqdm) over the windows."""
    from tqdm import tqdm

    register()
    rec = _KVQRecorder(int(skip))
    with torch.no_grad(), active(rec):
        for ids in tqdm(list(windows), desc="statistics", unit="window", disable=not progress):
            if ids.shape[-1] < skip + 2:
                raise KvqrsError(f"windows: expected windows of at least skip + 2 = {skip + 2} tokens, got {ids.shape[-1]}")
            model(ids)
    if not rec.k:
        raise KvqrsError("calibration: no attention call was recorded (is the model using attn_implementation='kvqrs'?)")
    from ..schemes.matched import second_moment

    out = {}
    for layer in sorted(rec.k):
        q = np.concatenate(rec.q[layer], axis=1).astype(np.float64)
        out[layer] = (
            second_moment(q),
            np.concatenate(rec.k[layer], axis=1),
            np.concatenate(rec.v[layer], axis=1),
        )
    return out


def fit_matched(stats: dict, key_bits: float, group: int, key_scales: str = "groups") -> dict:
    """``{layer: MatchedCalibration}`` from :func:`record_matched`'s statistics: keys by
    :func:`kvqrs.schemes.matched.fit_basis` weighted by the queries' second moment (the
    score-space error weight) at ``key_bits`` average code bits and scale groups of ``group``
    tokens (``key_scales="tokens"``: a float16 scale per token instead, a fixed size per
    token); values by their mean per KV head."""
    from ..schemes.matched import MatchedCalibration, fit_basis

    return {
        layer: MatchedCalibration(fit_basis(k, key_bits, group, w, scales=key_scales), v.mean(axis=1)) for layer, (w, k, v) in stats.items()
    }


def fit_matched_widths(stats: dict, widths: Iterable[float], group: int, progress: bool = False, key_scales: str = "groups") -> dict:
    """``{a: fit_matched(stats, a, group, key_scales)}`` for every average key width ``a`` of
    ``widths``, each layer's transform and distortions fitted once
    (:func:`kvqrs.schemes.matched.fit_bases`); ``progress``: a progress bar (tqdm) over the layers."""
    from tqdm import tqdm

    from ..schemes.matched import MatchedCalibration, fit_bases

    widths = tuple(widths)
    out: dict = {a: {} for a in widths}
    for layer, (w, k, v) in tqdm(stats.items(), desc="fit", unit="layer", disable=not progress):
        for a, basis in zip(widths, fit_bases(k, widths, group, w, scales=key_scales)):
            out[a][layer] = MatchedCalibration(basis, v.mean(axis=1))
    return out


def calibrate_matched(
    model, windows: Iterable[torch.Tensor], key_bits: float, group: int = 128, skip: int = 0, key_scales: str = "groups"
) -> dict:
    """Fit the ``matched`` scheme's per-layer calibration on calibration token windows
    (:func:`record_matched` then :func:`fit_matched`).

    Args:
        model: a transformers model loaded with ``attn_implementation="kvqrs"``.
        windows: ``(1, len)`` token tensors from a calibration text (never the evaluation text).
        key_bits: average key code bits per coordinate (0 < key_bits <= 8).
        group: tokens per key scale group.
        skip: leading positions of each window left out (the attention sinks).
        key_scales: ``"groups"`` (each key coordinate in KIVI groups of ``group`` tokens) or
            ``"tokens"`` (a float16 scale per key token, a fixed size per token:
            :mod:`kvqrs.schemes.matched_tokens`).

    Returns:
        ``{layer: MatchedCalibration}``.

    Raises:
        KvqrsError: no attention call was recorded, a window shorter than ``skip + 2``, or an
            unknown ``key_scales``.
    """
    return fit_matched(record_matched(model, windows, skip), key_bits, group, key_scales)


class _OnlyLayer(AttentionState):
    """Attention state that lets one fake-quant plan serve a single layer (the others dense)."""

    def __init__(self, plan, layer: int) -> None:
        self.plan, self.layer = plan, layer

    def attend(self, module, *args):
        return self.plan.attend(module, *args) if module.layer_idx == self.layer else None


def layer_sensitivity(model, windows: list[torch.Tensor], configs: list, progress: bool = False) -> np.ndarray:
    """KL of the next-token distribution (mean over the second half of each window, as the
    llama.cpp protocol scores) when one layer alone is coded, for every layer and config.

    Args:
        model: a transformers model loaded with ``attn_implementation="kvqrs"``.
        windows: ``(1, len)`` token tensors from the calibration text.
        configs: :class:`~kvqrs.hf.QuantConfig` options (every key and value read quantized
            after the sinks, as in a prefilled cache).
        progress: a progress bar (tqdm) over the layers x configs forwards.

    Returns:
        float64 ``(layers, len(configs))``.
    """
    from .attention import FakeQuant

    def log_probs(state) -> torch.Tensor:
        out = []
        for ids in windows:
            n = ids.shape[-1]
            with torch.no_grad(), active(state):
                out.append(torch.log_softmax(model(ids).logits[0, n // 2 : n - 1].double(), dim=-1))
        return torch.cat(out)

    register()
    dense = log_probs(None)
    layers = model.config.num_hidden_layers
    kl = np.zeros((layers, len(configs)))
    bar = _progress(layers * len(configs), "sensitivity", progress)
    for j, cfg in enumerate(configs):
        for layer in range(layers):
            lp = log_probs(_OnlyLayer(FakeQuant(cfg, one_shot=True), layer))
            kl[layer, j] = float((dense.exp() * (dense - lp)).sum(-1).clamp_min(0).mean())
            bar.update(1)
    bar.close()
    return kl


class _StateRecorder(AttentionState):
    """Attention state that keeps each layer's query, keys and values as attention reads them
    (tensors in the autograd graph) and lets attention run unchanged."""

    def __init__(self) -> None:
        self.states: dict[int, tuple] = {}

    def attend(self, module, query, key, value, attention_mask, scaling):
        self.states[module.layer_idx] = (query, key, value, scaling, module.num_key_value_groups)
        return None


def _coding_errors(cfg, layer: int, query, key, value, scaling, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_used - k, v_used - v)`` of one layer under ``cfg`` in a prefilled cache (every token
    after the sinks read quantized, the sinks rounded to ``sink_dtype``): float32
    ``(batch, kv_heads, len, d)`` each, zero where a side stays in full precision."""
    from .attention import causal_importance, decoded_keys, decoded_values

    with torch.no_grad():
        query, key, value = query.detach(), key.detach(), value.detach()
        if cfg.key_scheme == "headq":
            raise KvqrsError("configs: the sensitivity proxy reads coded keys and values; HeadQ's score-space correction is neither")
        codec = cfg.codec(layer, query.shape[-1])
        k_used, v_used = cfg.round_sinks(key), cfg.round_sinks(value)
        sink = cfg.sink_tokens
        if cfg.quantizes_keys:
            k_used = decoded_keys(codec, k_used, sink)[1]
        if codec.values is not None:
            weights = None
            if codec.needs_weights:
                from transformers.integrations.sdpa_attention import repeat_kv

                logits = (query @ repeat_kv(key, groups).transpose(2, 3)) * scaling
                weights = causal_importance(logits, sink, groups)[..., sink:]
            v_used = decoded_values(codec, v_used, sink, weights)
        return (k_used - key).float(), (v_used - value).float()


def fisher_sensitivity(
    model, windows: list[torch.Tensor], configs: list, samples: int = 8, seed: int = 0, progress: bool = False
) -> np.ndarray:
    """The KL of :func:`layer_sensitivity` (the next-token distribution's, mean over the second
    half of each window, one layer coded alone) by its second-order expansion, for every layer
    and config from one forward and ``samples`` backward passes per window: time linear in
    layers x tokens (the measured one re-runs the model for each layer and config).

    For a small change ``delta`` of a layer's keys and values, ``KL(p || p_hat) = 1/2 delta^T
    G delta + O(delta^3)`` with ``G = E_y[g g^T]`` the Fisher information of the model's output
    distribution, ``g = grad log p(y)`` (``y`` drawn from the model) taken at the keys and values
    attention reads. Each sample draws every scored position's next token from the dense model,
    back-propagates their summed log-probability once, and scores every option of every layer
    from its coding error ``delta`` (each option coded once, in a prefilled cache's schedule).
    The errors of different tokens are taken as uncorrelated (the expansion's cross terms between
    token positions, whose mean over the codes' rounding is zero, are left out), so the estimate
    is ``1/2 mean_samples sum_(head, token) (g . delta)^2`` per scored position: measured against
    :func:`layer_sensitivity` in docs/evaluation.md.

    Args:
        model: a transformers model loaded with ``attn_implementation="kvqrs"``.
        windows: ``(1, len)`` token tensors from the calibration text (len >= 4).
        configs: :class:`~kvqrs.hf.QuantConfig` options without score-space corrections (every
            key and value read quantized after the sinks, as in a prefilled cache).
        samples: sampled output vectors per window (the estimate's noise falls as
            ``1 / sqrt(samples x tokens)``); seed: the sampling generator's seed.
        progress: show a progress bar (tqdm) over windows and samples.

    Returns:
        float64 ``(layers, len(configs))``.

    Raises:
        KvqrsError: samples < 1, a window shorter than 4 tokens, a HeadQ config, or no attention
            call was recorded.
    """
    from .attention import sdpa_prefill

    samples = check_positive_int(samples, "samples")
    register()
    layers = model.config.num_hidden_layers
    acc = np.zeros((layers, len(configs)))
    positions = 0
    gen = torch.Generator().manual_seed(int(seed))
    bar = _progress(len(windows) * (samples + 1), "sensitivity", progress)
    for ids in windows:
        n = ids.shape[-1]
        if n < 4:
            raise KvqrsError(f"windows: expected windows of at least 4 tokens, got {n}")
        rec = _StateRecorder()
        with torch.enable_grad(), active(rec), sdpa_prefill():
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            lp = torch.log_softmax(model(inputs_embeds=embeds, use_cache=False).logits[0, n // 2 : n - 1].float(), dim=-1)
        if len(rec.states) != layers:
            raise KvqrsError("calibration: not every layer's attention was recorded (is the model using attn_implementation='kvqrs'?)")
        order = sorted(rec.states)
        errors = [[_coding_errors(cfg, layer, *rec.states[layer]) for cfg in configs] for layer in order]
        inputs = [t for layer in order for t in rec.states[layer][1:3]]
        draws = torch.multinomial(lp.detach().exp(), samples, replacement=True, generator=gen)  # (scored, samples)
        bar.update(1)
        for m in range(samples):
            picked = lp.gather(1, draws[:, m : m + 1]).sum()
            grads = torch.autograd.grad(picked, inputs, retain_graph=m < samples - 1)
            with torch.no_grad():
                for i in range(layers):
                    gk, gv = grads[2 * i].float(), grads[2 * i + 1].float()
                    for j, (dk, dv) in enumerate(errors[i]):
                        acc[i, j] += float((((gk * dk).sum(-1) + (gv * dv).sum(-1)) ** 2).sum())
            bar.update(1)
        positions += lp.shape[0]
    bar.close()
    return acc / (2 * samples * positions)


def _progress(total: int, desc: str, enabled: bool):
    """A tqdm bar over ``total`` steps (disabled: counts silently)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled)


def allocate_matched(
    model,
    windows: list[torch.Tensor],
    probe: list[torch.Tensor],
    budget: float,
    key_widths: tuple[float, ...] = (2, 3, 4, 5),
    value_widths: tuple[int, ...] | None = None,
    group: int = 128,
    sink_tokens: int = 1,
    value_norms: str = "float",
    sink_dtype: str | None = None,
    value_scale: str = "norm",
    value_classes: bool = False,
    sensitivity: str = "fisher",
    samples: int = 8,
    progress: bool = False,
    key_scales: str = "groups",
    uniform_layers: bool = False,
) -> dict:
    """A ``matched`` calibration whose per-layer key and value widths come from measured
    sensitivity.

    The layers are fitted at every key width ``a`` of ``key_widths`` (average key code bits,
    key scale groups of ``group`` tokens). The KL of coding each layer's keys alone at each
    key width, and its values alone at each value width, is estimated on the ``probe`` windows
    by its second-order expansion (:func:`fisher_sensitivity`, ``sensitivity="fisher"``: one
    forward and ``samples`` backward passes per window) or measured
    (:func:`layer_sensitivity`, ``"measured"``: a forward per layer, option and window); the bits per element of each side's choice are counted on the
    calibration keys and values of one window (codes, scales, norms, and the sinks in the
    model's dtype). Small distortions add up, so a layer's option ``(a, b)`` costs
    ``KL_keys(a) + KL_values(b)`` at the mean of the two sides' bits, and
    :func:`~kvqrs.schemes.matched.allocate_layers` picks one pair per layer within ``budget``
    (keys and values of one layer need not weigh alike).

    Args:
        model: a transformers model loaded with ``attn_implementation="kvqrs"``.
        windows: calibration windows the statistics are fitted on; probe: other windows of the
            calibration text the sensitivities are measured on (never the evaluation text).
        budget: average stored bits per element of keys and values.
        key_widths: candidate average key code bits (fractions allowed: the widths are
            water-filled over coordinates); value_widths: candidate value bits (integers 1..8;
            default the integer key widths); group: tokens per key scale group (the config's
            ``group``); sink_tokens: the full-precision leading tokens; value_norms: how value
            tokens store their norms (``QuantConfig.value_norms``), measured and counted so;
            sink_dtype: the sinks' storage (``QuantConfig.sink_dtype``), counted so;
            value_scale: what value tokens store per token (``QuantConfig.value_scale``),
            measured so; value_classes: values in per-token width classes
            (:func:`fit_value_classes`, fitted on ``windows`` at each value width), measured
            and counted so.
        sensitivity: ``"fisher"`` or ``"measured"`` (above); samples: the Fisher estimate's
            sampled outputs per probe window; progress: show progress bars (tqdm).
        key_scales: how keys store their scales (:func:`calibrate_matched`), measured and
            counted so.
        uniform_layers: every layer stores the same bytes per token and KV head (one slot
            size, what a vLLM cache gives every layer): ``floor(budget * 2 * d / 8)`` bytes of
            keys and values of a coded token (the sinks, full precision, are stored apart and
            not counted). For each value width ``b`` of ``value_widths``, the keys get the
            bytes the values leave (their float16 scale and their codes), and their widths are
            water-filled over the coordinates within that byte budget
            (:func:`~kvqrs.schemes.matched.fit_bases_bytes`: each run of equal width padded to
            whole bytes); each layer then takes the value width whose key and value KL is the
            least (a value width that leaves the keys no code byte, or more than ``d``, is no
            candidate). ``key_widths`` is not used; needs ``key_scales="tokens"`` and per-token
            values (no ``value_classes``).

    Returns:
        ``{layer: MatchedCalibration}`` with ``value_bits`` set per layer.

    Raises:
        KvqrsError: no candidate widths, a value width that is not an integer in 1..8, the
            budget below the narrowest widths, an unknown ``sensitivity``, no attention
            call was recorded; with ``uniform_layers``: ``key_scales`` other than
            ``"tokens"``, ``value_classes``, or a budget that leaves the keys no code byte at
            any value width.
    """
    import dataclasses
    import itertools

    from ..schemes.matched import allocate_layers
    from .config import QuantConfig

    kw = tuple(float(a) for a in key_widths)
    vw = default_value_widths(kw) if value_widths is None else tuple(value_widths)
    if not kw or not vw:
        raise KvqrsError(f"widths: expected candidate key and value widths, got keys {key_widths} and values {value_widths}")
    if any(isinstance(b, float) and b != int(b) or not 1 <= b <= 8 for b in vw):
        raise KvqrsError(f"value_widths: expected integer bits in 1..8, got {vw}")
    if sensitivity not in ("fisher", "measured"):
        raise KvqrsError(f"sensitivity: expected 'fisher' or 'measured', got {sensitivity!r}")
    if uniform_layers:
        if key_scales != "tokens":
            raise KvqrsError(f"uniform_layers: a fixed size per token needs key_scales='tokens', got {key_scales!r}")
        if value_classes:
            raise KvqrsError("uniform_layers: value width classes give each token of a chunk its own size; calibrate without value_classes")
    stats = record_matched(model, windows, sink_tokens, progress=progress)
    if uniform_layers:
        return _allocate_uniform(
            model, probe, stats, budget, vw, group, sink_tokens, value_norms, sink_dtype, value_scale, sensitivity, samples, progress
        )
    fits = fit_matched_widths(stats, kw, group, progress, key_scales)
    common = {"group": group, "sink_tokens": sink_tokens, "sink_dtype": sink_dtype}
    key_cfgs = [QuantConfig("matched", 4, None, **common, calibration=fits[a]) for a in kw]
    # Values alone read only the value mean of a calibration (the same in every fit) and its width.
    plain = {b: {layer: dataclasses.replace(c, value_bits=int(b)) for layer, c in fits[kw[0]].items()} for b in vw}
    fitted_values = (
        {b: fit_value_classes(model, windows, cal, group, sink_tokens, int(b)) for b, cal in plain.items()} if value_classes else plain
    )
    value_cfgs = [
        QuantConfig(
            None, int(b), "matched", int(b), **common, calibration=fitted_values[b], value_norms=value_norms, value_scale=value_scale
        )
        for b in vw
    ]
    if sensitivity == "fisher":
        kl = fisher_sensitivity(model, probe, key_cfgs + value_cfgs, samples, progress=progress)
    else:
        kl = layer_sensitivity(model, probe, key_cfgs + value_cfgs, progress=progress)
    kl_k, kl_v = kl[:, : len(kw)], kl[:, len(kw) :]
    tokens, dtype_bits = windows[0].shape[-1], torch.finfo(model.dtype).bits
    bits_k = option_bits(stats, key_cfgs, tokens, dtype_bits, side="keys")
    bits_v = option_bits(stats, value_cfgs, tokens, dtype_bits, side="values")
    pairs = list(itertools.product(range(len(kw)), range(len(vw))))
    cost = np.stack([kl_k[:, a] + kl_v[:, b] for a, b in pairs], axis=1)
    bits = np.stack([(bits_k[:, a] + bits_v[:, b]) / 2 for a, b in pairs], axis=1)
    pick = allocate_layers(cost, bits, budget)
    out = {}
    for layer, j in zip(sorted(stats), pick.tolist()):
        chosen = fitted_values[vw[pairs[j][1]]][layer]
        out[layer] = dataclasses.replace(fits[kw[pairs[j][0]]][layer], value_bits=chosen.value_bits, value_classes=chosen.value_classes)
    return out


def value_token_bytes(stats: dict, configs: list) -> np.ndarray:
    """Bytes one value token of a KV head stores under each value config (per-token values:
    codes and norm or scale), counted on the recorded calibration values of the first layer
    of :func:`record_matched`'s ``stats``: int ``(len(configs),)``.

    Raises:
        KvqrsError: a config whose values do not store the same bytes for every token."""
    layer = min(stats)
    _, _, v = stats[layer]
    h, n, d = v.shape
    out = []
    for cfg in configs:
        codec = cfg.codec(layer, d)
        nbytes = codec.encode_values(v[None], unit_weights(codec, v[None])).nbytes
        if nbytes % (h * n):
            raise KvqrsError(f"values: {nbytes} bytes for {h} heads x {n} tokens is not a fixed size per token")
        out.append(nbytes // (h * n))
    return np.array(out, dtype=np.int64)


def _allocate_uniform(
    model, probe, stats, budget, vw, group, sink_tokens, value_norms, sink_dtype, value_scale, sensitivity, samples, progress
) -> dict:
    """:func:`allocate_matched` with ``uniform_layers`` (see there), after its checks and
    statistics."""
    from tqdm import tqdm

    from ..schemes.matched import TOKEN_SCALE_BYTES, MatchedBasis, MatchedCalibration, fit_bases_bytes
    from .config import QuantConfig

    _, k0, _ = stats[min(stats)]
    d = k0.shape[-1]
    slot = int(np.floor(float(budget) * 2 * d / 8 + 1e-9))  # bytes of keys and values per token and KV head
    common = {"group": group, "sink_tokens": sink_tokens, "sink_dtype": sink_dtype}

    # Values read only the value mean and width of a calibration: one whose keys code nothing
    # (identity basis, zero widths) counts their bytes.
    def keyless(v: np.ndarray, bits: int) -> MatchedCalibration:
        h = v.shape[0]
        none = MatchedBasis(np.zeros((h, d)), np.broadcast_to(np.eye(d), (h, d, d)), np.zeros(d, np.uint8))
        return MatchedCalibration(none, v.mean(axis=1), value_bits=int(bits))

    plain = {b: {layer: keyless(v, b) for layer, (_, _, v) in stats.items()} for b in vw}
    value_cfgs = [
        QuantConfig(None, int(b), "matched", int(b), **common, calibration=plain[b], value_norms=value_norms, value_scale=value_scale)
        for b in vw
    ]
    key_bytes = slot - value_token_bytes(stats, value_cfgs) - TOKEN_SCALE_BYTES
    keep = [i for i in range(len(vw)) if 0 < key_bytes[i] <= d]
    if not keep:
        raise KvqrsError(
            f"budget: {budget} bits per element is a slot of {slot} bytes per token and KV head, which leaves the keys "
            f"{key_bytes.tolist()} code bytes at value widths {list(vw)}; expected 1 to {d} at one of them"
        )
    vw, value_cfgs, key_bytes = [vw[i] for i in keep], [value_cfgs[i] for i in keep], [int(key_bytes[i]) for i in keep]
    fits: list[dict] = [{} for _ in vw]
    for layer, (w, k, v) in tqdm(stats.items(), desc="fit", unit="layer", disable=not progress):
        for j, basis in enumerate(fit_bases_bytes(k, key_bytes, w)):
            fits[j][layer] = MatchedCalibration(basis, v.mean(axis=1), value_bits=int(vw[j]))
    key_cfgs = [QuantConfig("matched", 4, None, **common, calibration=f) for f in fits]
    if sensitivity == "fisher":
        kl = fisher_sensitivity(model, probe, key_cfgs + value_cfgs, samples, progress=progress)
    else:
        kl = layer_sensitivity(model, probe, key_cfgs + value_cfgs, progress=progress)
    cost = kl[:, : len(vw)] + kl[:, len(vw) :]  # option j: keys in the bytes value width vw[j] leaves
    pick = np.argmin(cost, axis=1)
    return {layer: fits[j][layer] for layer, j in zip(sorted(stats), pick.tolist())}


class _ClassRecorder(AttentionState):
    """Attention state that, per layer, allocates each calibration window's value widths freely
    by causal A^2 importance (:func:`~kvqrs.schemes.a2.allocate_bits` per chunk of ``group``
    tokens after the sinks, at the layer's value width) and counts the widths; attention runs
    unchanged."""

    def __init__(self, calibration: dict, group: int, sink_tokens: int, default_bits: int) -> None:
        self.calibration, self.group, self.sinks, self.default_bits = calibration, group, sink_tokens, default_bits
        self.histograms: dict[int, np.ndarray] = {}

    def bits(self, layer: int) -> int:
        b = self.calibration[layer].value_bits
        return self.default_bits if b is None else b

    def attend(self, module, query, key, value, attention_mask, scaling):
        from transformers.integrations.sdpa_attention import repeat_kv

        from ..schemes.a2 import allocate_bits
        from .attention import causal_importance

        layer, g = module.layer_idx, module.num_key_value_groups
        logits = (query @ repeat_kv(key, g).transpose(2, 3)) * scaling
        w = causal_importance(logits, self.sinks, g)[0, :, self.sinks :]  # (kv_heads, n)
        v = to_numpy(value, "values")[0, :, self.sinks :].astype(np.float64) - self.calibration[layer].value_mean[:, None, :]
        n = (w.shape[-1] // self.group) * self.group
        if n:
            rows = lambda a: a[:, :n].reshape(-1, self.group)  # noqa: E731  (kv_heads * chunks, group)
            widths = allocate_bits(rows(w), rows(np.sum(v**2, axis=-1)), self.bits(layer), value.shape[-1])
            hist = self.histograms.setdefault(layer, np.zeros(9))
            hist += np.bincount(widths.reshape(-1), minlength=9)[:9]
        return None


def fit_value_classes(model, windows: Iterable[torch.Tensor], calibration: dict, group: int, sink_tokens: int = 1, bits: int = 4) -> dict:
    """Give each layer of a ``matched`` calibration per-token value width classes
    (:mod:`kvqrs.schemes.width_classes`) fitted on calibration windows.

    In every window, each KV head's value tokens after the sinks, in chunks of ``group``, get
    the widths that minimise their A^2-weighted distortion at the layer's value width
    (``value_bits``, else ``bits``), from the importances a cache can measure
    (:func:`~kvqrs.hf.attention.causal_importance`); the layer's classes are those widths'
    histogram rounded to a chunk (:func:`~kvqrs.schemes.width_classes.class_counts`). A layer
    whose allocation is one width (1-bit values) keeps its plain value stage.

    Args:
        model: a transformers model loaded with ``attn_implementation="kvqrs"``.
        windows: ``(1, len)`` token tensors of a calibration text, each longer than
            ``sink_tokens + group``.
        calibration: ``{layer: MatchedCalibration}`` with per-token values (no value transform).
        group: tokens per chunk (the config's ``group``); sink_tokens: the full-precision
            leading tokens; bits: the value width of layers without ``value_bits``.

    Returns:
        ``{layer: MatchedCalibration}`` with ``value_bits`` and ``value_classes`` set.

    Raises:
        KvqrsError: transform-coded values, a calibration missing some of the model's layers,
            a group < 1, sink_tokens < 0, bits not an integer in 1..8, no window with a whole
            chunk, or no attention call.
    """
    import dataclasses

    from ..schemes.width_classes import class_counts

    if any(c.values is not None for c in calibration.values()):
        raise KvqrsError("calibration: value classes apply to per-token values, not transform-coded ones")
    group, sink_tokens = check_positive_int(group, "group"), check_positive_int(sink_tokens, "sink_tokens", minimum=0)
    bits = check_bits(bits)
    layers = model.config.num_hidden_layers
    if set(calibration) != set(range(layers)):
        missing = sorted(set(range(layers)) - set(calibration))
        raise KvqrsError(f"calibration: expected a calibration for each of the model's {layers} layers, missing layers {missing}")
    rec = _ClassRecorder(calibration, group, sink_tokens, bits)
    with torch.no_grad(), active(rec):
        for ids in windows:
            model(ids)
    if set(rec.histograms) != set(calibration):
        raise KvqrsError(
            f"windows: expected windows longer than sink_tokens + group = {sink_tokens + group} tokens through the kvqrs attention"
        )
    out = {}
    for layer, cal in calibration.items():
        classes = class_counts(rec.histograms[layer], rec.bits(layer), int(group))
        keep = classes if len(classes) > 1 else None
        out[layer] = dataclasses.replace(cal, value_bits=rec.bits(layer), value_classes=keep)
    return out


def default_value_widths(key_widths) -> tuple[int, ...]:
    """The candidate value widths when none are given: the whole-number key widths, sorted."""
    return tuple(sorted({int(a) for a in key_widths if a == int(a)}))


def option_bits(stats: dict, configs: list, tokens: int, dtype_bits: int, side: str = "both") -> np.ndarray:
    """Stored bits per element of each layer under each config, counted on ``tokens`` tokens
    of the recorded calibration keys and values (:func:`record_matched` statistics, the sinks
    left out of them) plus the configs' sink tokens at ``dtype_bits`` (or their ``sink_dtype``'s): of the keys and values
    averaged (``side="both"``), or of one side (``"keys"``, ``"values"``; that side's sinks).
    Returns float64 ``(layers, len(configs))``; raises :class:`KvqrsError` on another side."""
    if side not in ("both", "keys", "values"):
        raise KvqrsError(f"side: expected 'both', 'keys' or 'values', got {side!r}")
    sides = ("keys", "values") if side == "both" else (side,)
    out = np.zeros((len(stats), len(configs)))
    for i, (layer, (_, k, v)) in enumerate(sorted(stats.items())):
        for j, cfg in enumerate(configs):
            n = tokens - cfg.sink_tokens
            codec = cfg.codec(layer, k.shape[-1])
            coded = 0
            if "keys" in sides:
                coded += 8 * codec.encode_keys(k[None, :, :n]).nbytes
            if "values" in sides:
                coded += 8 * codec.encode_values(v[None, :, :n], unit_weights(codec, v[None, :, :n])).nbytes
            sinks = len(sides) * cfg.sink_bits(dtype_bits) * cfg.sink_tokens * k.shape[0] * k.shape[-1]
            out[i, j] = (coded + sinks) / (len(sides) * k.shape[0] * tokens * k.shape[-1])
    return out


def prefill_calibration(config, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """The ``matched`` calibration a layer fits on its prefill (``calibration="prefill"``).

    Args:
        config: the :class:`~kvqrs.hf.QuantConfig` (its ``key_bits`` average key code bits,
            ``group``, ``sink_tokens``; values transform-coded at ``value_bits`` when
            ``value_transform``).
        query: ``(batch, q_heads, len, d)`` the prefill's post-RoPE queries.
        keys, values: ``(batch, kv_heads, tokens, d)`` the prefill's tokens after the sinks
            (the sinks are never coded).

    Returns:
        :class:`~kvqrs.schemes.matched.MatchedCalibration` fitted by
        :func:`~kvqrs.schemes.matched.fit_layer` in the channel transform (statistics pooled
        over the batch).

    Raises:
        KvqrsError: fewer than two tokens after the sinks.
    """
    from ..schemes.matched import fit_layer, query_moment

    k, v = to_numpy(keys, "keys"), to_numpy(values, "values")
    b, h, n, d = k.shape
    if n < 2:
        raise KvqrsError(
            f"calibration='prefill': the prompt must hold at least 2 tokens after the {config.sink_tokens} sink tokens to fit on, got {n}"
        )
    pool = lambda x: x.transpose(1, 0, 2, 3).reshape(h, b * n, x.shape[-1])  # noqa: E731
    value_bits = (config.value_bits or config.key_bits) if config.value_transform else None
    # The channel transform: a sequence pays its calibration as side information, and a
    # channel permutation, a mean and widths cost a byte or so per channel where an eigenbasis
    # costs d float32 per channel (as much as the codes of a few hundred tokens).
    moment = query_moment(to_numpy(query, "query"), h)
    return fit_layer(moment, pool(k), pool(v), config.key_bits, config.group, value_bits, transform="channels")


MATCHED_FORMAT = "kvqrs-matched-calibration-v1"


def save_matched(path: str | pathlib.Path | io.BytesIO, calibration: dict, meta: dict | None = None) -> pathlib.Path | io.BytesIO:
    """Write a ``matched`` calibration (``{layer: MatchedCalibration}``) to ``path`` (.npz), or
    into a binary file object (a compressed cache embeds it that way), with ``meta``'s values as
    strings (:func:`calibration_meta`). Returns the path written: NumPy appends ``.npz`` to a
    path without that suffix (``kvqrs calibrate --out`` refuses one instead)."""
    arrays = {}
    for layer, c in calibration.items():
        arrays.update({f"mean_{layer}": c.keys.mean, f"widths_{layer}": c.keys.widths, f"vmean_{layer}": c.value_mean})
        if c.keys.deviations is not None:
            arrays[f"kdev_{layer}"] = c.keys.deviations
        perm = c.keys.permutation  # a channel permutation is stored as its indices
        arrays.update({f"basis_{layer}": c.keys.basis} if perm is None else {f"perm_{layer}": perm.astype(np.uint16)})
        if c.values is not None:
            arrays.update({f"vbasis_{layer}": c.values.basis, f"vwidths_{layer}": c.values.widths})
        if c.value_bits is not None:
            arrays[f"vbits_{layer}"] = np.array(c.value_bits, dtype=np.uint8)
        if c.value_classes is not None:
            arrays[f"vclasses_{layer}"] = np.array(c.value_classes, dtype=np.uint16)
    extra = {f"meta_{k}": np.array(str(v)) for k, v in (meta or {}).items()}
    if isinstance(path, io.BytesIO):
        np.savez(path, format=np.array(MATCHED_FORMAT), **arrays, **extra)
        return path
    p = pathlib.Path(path)
    np.savez(p, format=np.array(MATCHED_FORMAT), **arrays, **extra)
    return p if p.suffix == ".npz" else p.with_name(p.name + ".npz")


def calibration_meta(path: str | pathlib.Path) -> dict[str, str]:
    """The metadata strings :func:`save_matched` wrote with a calibration (``kvqrs calibrate``
    records ``group``, ``sink_tokens``, ``value_norms``, ``bits`` or ``budget``, ``key_widths``
    (not with ``--uniform-layers``) and ``value_widths``, and ``sink_dtype``, ``value_scale``,
    ``preset``, ``key_scales``, ``uniform_layers`` when set); also
    :attr:`CalibrationFile.meta` of what :func:`load_matched` returns."""
    return _meta(_read_npz(path, str(path)))


def _meta(entries: dict[str, np.ndarray]) -> dict[str, str]:
    return {k[5:]: str(v) for k, v in entries.items() if k.startswith("meta_")}


class CalibrationFile(dict):
    """A ``matched`` calibration as :func:`load_matched` reads it: ``{layer: MatchedCalibration}``
    (a dict, usable wherever one is), with what the file records about how it was made.

    Attributes:
        meta: ``{name: str}``, the metadata strings of the file (:func:`calibration_meta`).
        path: the file's path as given, or ``"<bytes>"`` for a binary file object.

    :class:`~kvqrs.hf.QuantConfig` applies the settings ``meta`` records
    (:func:`recorded_settings`) to the fields its caller did not pass; ``dict(calibration)``
    drops ``meta`` (a plain dict records nothing).
    """

    def __init__(self, layers: Any = (), meta: dict[str, str] | None = None, path: str = "<dict>") -> None:
        super().__init__(layers)  # dict's own arguments first: copies made by type(d)(items) work
        self.meta = dict(meta or {})
        self.path = path

    def __repr__(self) -> str:
        """The path, layers and bits (every array printed would run to hundreds of thousands of
        characters)."""
        from .config import _summary

        return _summary(self)


def recorded_settings(meta: dict[str, str], name: str = "calibration") -> dict:
    """The :class:`~kvqrs.hf.QuantConfig` settings a calibration file's metadata records: the one
    reading of them, for ``QuantConfig(calibration=load_matched(path))``,
    :meth:`QuantConfig.preset <kvqrs.hf.QuantConfig.preset>`, ``KVQRS_CALIBRATION`` and the
    evaluation's file rows.

    Args:
        meta: ``{name: str}`` (:func:`calibration_meta`, :attr:`CalibrationFile.meta`).
        name: the file, for the error message.

    Returns:
        ``{"group": int, "sink_tokens": int}`` where recorded (``kvqrs calibrate`` always records
        them; absent from files saved by :func:`save_matched` without them), and always
        ``value_norms`` (absent: ``"float"``), ``value_scale`` (absent: ``"norm"``; ``kvqrs
        calibrate`` records it when not ``"norm"``) and ``sink_dtype`` (absent, or with
        ``sink_tokens`` recorded as 0: None, nothing was stored in it).

    Raises:
        KvqrsError: a recorded ``group`` or ``sink_tokens`` that is not an integer.
    """
    out: dict = {}
    for key in ("group", "sink_tokens"):
        if key in meta:
            if not re.fullmatch("[0-9]+", meta[key]):
                raise KvqrsError(f"calibration: {name!r} records {key} {meta[key]!r}; expected an integer of ASCII digits")
            out[key] = int(meta[key])
    out["value_norms"] = meta.get("value_norms", "float")
    out["value_scale"] = meta.get("value_scale", "norm")
    out["sink_dtype"] = meta.get("sink_dtype") if out.get("sink_tokens") != 0 else None
    return out


# Errors of reading a damaged archive: zipfile's (a truncated or altered file), zlib's, NumPy's
# header parser, an unknown compression method (NotImplementedError) and an "encrypted" flag
# (RuntimeError) among them.
_ARCHIVE_ERRORS = (OSError, ValueError, KeyError, EOFError, TypeError, IndexError, OverflowError, NotImplementedError, RuntimeError)


def _read_npz(path: str | pathlib.Path | io.BytesIO, name: str) -> dict[str, np.ndarray]:
    """Every entry of a calibration archive, read at once (a file of a few MB), so that a damaged
    archive is refused here as a whole rather than halfway through building a calibration."""
    import struct
    import zipfile
    import zlib

    try:
        with np.load(path if isinstance(path, io.BytesIO) else pathlib.Path(path), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (*_ARCHIVE_ERRORS, zipfile.BadZipFile, zlib.error, struct.error) as e:
        raise KvqrsError(f"calibration: cannot read {name!r}: {_npz_reason(e)}") from None
    except AttributeError:  # a .npy file: np.load gives one array, not an archive (no context manager)
        raise KvqrsError(f"calibration: cannot read {name!r}: {_npz_reason(TypeError())}") from None


def _npz_reason(e: Exception) -> str:
    """Why ``np.load`` refused a calibration file; NumPy reports a file that is neither ``.npy``
    nor ``.npz`` as pickled data, which ``allow_pickle=False`` refuses."""
    if "pickled" in str(e) or type(e) is TypeError:  # TypeError: a .npy array is no archive
        return "not a NumPy .npz archive (calibration files are written by `kvqrs calibrate` or save_matched)"
    if isinstance(e, FileNotFoundError):
        return "no such file"
    if isinstance(e, OSError) and not isinstance(e, EOFError):  # a folder, no permission, a failing disk
        return f"{e.strerror or type(e).__name__}"
    return f"a damaged archive ({type(e).__name__}: {e})"


def _permutation_basis(perm: np.ndarray) -> np.ndarray:
    """float32 ``(kv_heads, d, d)`` with column ``i`` of head ``h`` the unit vector of channel ``perm[h, i]``."""
    perm = np.asarray(perm, dtype=np.int64)
    if perm.ndim != 2 or any(sorted(p) != list(range(perm.shape[1])) for p in perm.tolist()):
        raise ValueError(f"a channel permutation must be (kv_heads, d) rows of 0..d-1, got shape {perm.shape}")
    h, d = perm.shape
    basis = np.zeros((h, d, d), np.float32)
    basis[np.arange(h)[:, None], perm, np.arange(d)[None, :]] = 1.0
    return basis


def load_matched(path: str | pathlib.Path | io.BytesIO) -> CalibrationFile:
    """Read a calibration written by :func:`save_matched` (a path or a binary file object).

    Returns:
        :class:`CalibrationFile`: ``{layer: MatchedCalibration}`` (layers in increasing order)
        with the file's metadata strings as ``.meta`` (the settings it records apply in
        :class:`~kvqrs.hf.QuantConfig`).

    Raises:
        KvqrsError: another or a damaged file, naming the entry at fault.
    """
    name = "<bytes>" if isinstance(path, io.BytesIO) else str(path)
    z = _read_npz(path, name)
    if "format" not in z or z["format"].shape != () or str(z["format"]) != MATCHED_FORMAT:
        raise KvqrsError(f"calibration: {name!r} is not a kvqrs matched calibration file ({MATCHED_FORMAT})")
    layers = []
    for k in z:
        kind, _, layer = k.partition("_")
        if kind in _LAYER_ENTRIES and not re.fullmatch("[0-9]+", layer):  # "-1", "1_0" or non-ASCII digits name no layer
            raise KvqrsError(f"calibration: {name!r} has entry {k!r}; expected {kind}_<layer> with a layer number of ASCII digits")
        if kind == "widths":
            layers.append(int(layer))
    out = {}
    for i in sorted(layers):
        try:
            out[i] = _layer_calibration(z, i)
        except KvqrsError as e:
            raise KvqrsError(f"calibration: {name!r}, layer {i}: {e}") from None
    return CalibrationFile(out, _meta(z), name)


_LAYER_ENTRIES = ("mean", "widths", "vmean", "basis", "perm", "vbasis", "vwidths", "vbits", "vclasses", "kdev")


def _layer_calibration(z: dict, i: int):
    """One layer's :class:`~kvqrs.schemes.matched.MatchedCalibration` from its archive entries,
    each checked for presence and shape before use (the dataclasses check the rest)."""
    from ..schemes.matched import MatchedBasis, MatchedCalibration

    def entry(kind: str, ndim: int, optional: bool = False):
        key = f"{kind}_{i}"
        if key not in z:
            if optional:
                return None
            raise KvqrsError(f"entry {key!r} is missing")
        a = z[key]
        if a.ndim != ndim or a.dtype.kind not in "uif":
            raise KvqrsError(f"entry {key!r}: expected a {ndim}-dimensional numeric array, got shape {a.shape} dtype {a.dtype}")
        return a

    if f"basis_{i}" in z or f"perm_{i}" not in z:
        basis = entry("basis", 3)
    else:
        try:
            basis = _permutation_basis(entry("perm", 2))
        except ValueError as e:
            raise KvqrsError(f"entry 'perm_{i}': {e}") from None
    vmean = entry("vmean", 2)
    values = MatchedBasis(vmean, entry("vbasis", 3), entry("vwidths", 1)) if f"vbasis_{i}" in z else None
    vbits = entry("vbits", 0, optional=True)
    classes = entry("vclasses", 2, optional=True)
    return MatchedCalibration(
        MatchedBasis(entry("mean", 2), basis, entry("widths", 1), entry("kdev", 2, optional=True)),
        vmean,
        values,
        None if vbits is None else vbits[()],  # a float width is refused, not truncated
        None if classes is None else tuple(map(tuple, classes.tolist())),
    )
