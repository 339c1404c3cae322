"""What a new user meets first: the ``kvqrs eval`` options (rows checked before the model loads,
defaults in ``--help``, a quick run that keeps a full run's report), ``load``'s dtype names,
the GGUF progress bar, the torch thread helpers, and seed-mismatch errors that name the seeds
the user gave. None of these tests loads the real model."""

from __future__ import annotations

import dataclasses

import kvqrs
import numpy as np
import pytest
from kvqrs import KvqrsError
from kvqrs import format as fmt
from kvqrs.cli import main
from kvqrs.schemes import KVCodec

# -- seed mismatches ----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["kqv", "qkqv", "block"])
def test_seed_mismatch_names_the_codec_seeds(scheme):
    x = np.random.default_rng(0).standard_normal((2, 8, 64)).astype(np.float32)
    a, b = KVCodec(scheme, 4, 64, seed=11), KVCodec(scheme, 4, 64, seed=12)
    ck, cv = a.encode_keys(x), a.encode_values(x)
    calls = {
        "decode_keys": lambda: b.decode_keys(ck),
        "decode_values": lambda: b.decode_values(cv),
        "scores": lambda: b.scores(x[:, :1], ck),
        "attention": lambda: b.attention(x[:, :1], ck, cv),
        "format.loads": lambda: fmt.loads(fmt.dumps(ck), b),
    }
    for name, call in calls.items():
        with pytest.raises(KvqrsError) as e:
            call()
        msg = str(e.value)
        assert "seed=11" in msg and "seed=12" in msg, (name, msg)
        derived = [v for k, v in ck.params.items() if "seed" in k]
        assert derived and not any(str(v) in msg for v in derived), (name, msg)  # no internal derived seeds
    assert fmt.loads(fmt.dumps(ck)).seed == 11  # the container keeps the codec seed


def test_seed_free_schemes_still_decode_under_another_seed():
    x = np.random.default_rng(1).standard_normal((1, 32, 64)).astype(np.float32)
    ck = KVCodec("kivi", 4, 64, seed=1).encode_keys(x)
    np.testing.assert_array_equal(KVCodec("kivi", 4, 64, seed=2).decode_keys(ck), KVCodec("kivi", 4, 64, seed=1).decode_keys(ck))


# -- kvqrs eval options -------------------------------------------------------------------------


def test_eval_refuses_unknown_rows_before_loading_the_model(text_file, no_model, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--data", text_file, "--rows", "kqvv", "--threads", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'kqvv'" in err and "'kqv k4 v4'" in err and "'kivi k2'" in err and "'dense'" in err


def test_eval_refuses_bad_matched_bits_before_loading_the_model(text_file, no_model, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--protocol", "llama", "--data", text_file, "--matched-bits", "4", "x@256", "--threads", "1"])
    assert e.value.code == 2 and "--matched-bits: expected BITS or BITS@GROUP (e.g. 4 or 4@256), got 'x@256'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--protocol", "llama"], ["--task", "needle"]])
def test_eval_refuses_an_unwritable_report_folder_before_loading_the_model(text_file, no_model, capsys, argv, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        main(["eval", "--data", text_file, "--threads", "1", "--out", str(blocker / "reports"), *argv])
    assert e.value.code == 2 and "--out: cannot create the report folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["--channel", "both"], ["--protocol", "llama", "--channel", "keys"], ["--task", "needle", "--channel", "both"]]
)
def test_eval_refuses_a_channel_without_calibration_files(text_file, no_model, capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--data", text_file, "--threads", "1", *argv])
    assert e.value.code == 2 and "--channel: applies to --protocol llama with --calibration files" in capsys.readouterr().err


def test_eval_refuses_a_calibration_file_of_no_preset_before_loading_the_model(text_file, tmp_path, no_model, capsys):
    """The default rows take `kvqrs calibrate --preset NAME` files, each adding its preset's row."""
    from kvqrs.hf import save_matched
    from kvqrs.schemes.matched import random_calibration

    path = save_matched(tmp_path / "c.npz", {0: random_calibration(16, 3, 0)}, {"group": 16})
    with pytest.raises(SystemExit) as e:
        main(["eval", "--data", text_file, "--threads", "1", "--calibration", str(path)])
    assert e.value.code == 2 and "was not fitted for a preset" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "1.5"], "more than the narrowest widths' 2.0 bits"),
        (["--budget", "3", "--key-widths", "3", "4"], "more than the narrowest widths' 3.0 bits"),
        (["--budget", "2.7", "--key-widths", "2.5", "4", "--value-widths", "3"], "more than the narrowest widths' 2.75 bits"),
        (["--budget", "3", "--key-widths", "2.5", "3.5"], "--value-widths: needed when no --key-widths is a whole number"),
        (["--budget", "3", "--value-widths", "0", "3"], "--value-widths: expected integer bits in 1..8"),
        (["--budget", "9", "--key-widths", "9"], "--key-widths: expected 0 < width <= 8 bits"),
        (["--preset", "4bit", "--budget", "3"], "--preset: sets --budget itself"),
        (["--preset", "4bit", "--group", "64", "--sink-tokens", "2"], "--preset: sets --group, --sink-tokens itself"),
        (["--budget", "4", "--probe-windows", "0"], "--probe-windows: expected at least 1 with --budget"),
        (["--windows", "0"], "--windows: expected at least 1"),
        (["--sink-tokens", "-1"], "--sink-tokens: expected 0 or more"),
        (
            ["--sink-tokens", "0", "--sink-dtype", "float16"],
            "--sink-dtype: float16 sets how sink tokens are stored, but --sink-tokens is 0",
        ),
        (["--bits", "0"], "--bits: expected 0 < bits <= 8"),
        (["--group", "0"], "--group: the matched scheme packs codes along tokens, so a multiple of 8 tokens, got 0"),
        (["--group", "7"], "a multiple of 8 tokens, got 7"),
        (["--preset", "3bit", "--value-norms", "log8"], "--preset: sets --value-norms itself"),
        (["--preset", "2bit", "--value-scale", "norm"], "--preset: sets --value-scale itself"),
        (["--ctx", "2"], "--ctx: expected at least 4 tokens (4, and --sink-tokens + 2), got 2"),
        (["--ctx", "3"], "--ctx: expected at least 4 tokens (4, and --sink-tokens + 2), got 3"),  # refused after loading before
        (["--ctx", "5", "--sink-tokens", "4"], "--ctx: expected at least 6 tokens (4, and --sink-tokens + 2), got 5"),
        (["--preset", "5bit"], "expected one of ['2bit', '3bit', '4bit']"),
        (["--preset", "4bit", "--samples", "0"], "--samples: expected at least 1, got 0"),
        (["--uniform-layers", "--key-scales", "tokens"], "--uniform-layers: allocates a --budget; give one"),
        (["--uniform-layers", "--budget", "4.25"], "--uniform-layers: one slot size per token needs --key-scales tokens"),
        (
            ["--uniform-layers", "--budget", "4.25", "--key-scales", "tokens", "--value-norms", "log8"],
            "--uniform-layers: log8 value norms are coded per chunk",
        ),
        (["--uniform-layers", "--preset", "4bit", "--key-scales", "tokens"], "--uniform-layers: a preset allocates its --key-widths"),
        (
            ["--uniform-layers", "--budget", "4.25", "--key-scales", "tokens", "--value-classes"],
            "--uniform-layers: value width classes give each token of a chunk its own size",
        ),
        (
            ["--uniform-layers", "--budget", "4.25", "--key-scales", "tokens", "--key-widths", "3", "4"],
            "--uniform-layers: the key widths follow from the bytes each --value-widths leaves",
        ),
        (
            ["--uniform-layers", "--budget", "3", "--key-scales", "tokens", "--value-widths", "3", "4"],
            "more than the narrowest widths' 3 bits",
        ),
    ],
)
def test_calibrate_refuses_impossible_budgets_before_loading_the_model(text_file, no_model, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--data", text_file, *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_eval_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 2;" in out  # --calibration-windows
    assert "(default: 0)" in out  # --residual-length
    assert "reports/eval; with --quick: reports/eval-quick" in out  # --out


@pytest.mark.parametrize(("argv", "folder"), [(["--quick"], "reports/eval-quick"), ([], "reports/eval"), (["--out", "x"], "x")])
def test_eval_quick_writes_its_own_report_folder(argv, folder, text_file, monkeypatch):
    torch = pytest.importorskip("torch")
    from kvqrs.evaluation import model as model_mod
    from kvqrs.evaluation import model_eval, model_report

    written = []
    monkeypatch.setattr(model_mod, "load", lambda *a, **k: (object(), object()))
    monkeypatch.setattr(model_mod, "describe", lambda *a, **k: {"summary": "a stub model"})
    monkeypatch.setattr(model_eval, "run_eval", lambda *a, **k: {})
    monkeypatch.setattr(model_report, "write", lambda result, out, seconds: written.append(str(out)) or out)
    monkeypatch.setattr(model_report, "summary", lambda result, seconds: "")
    threads = torch.get_num_threads()
    try:
        assert main(["eval", "--data", text_file, "--threads", "1", *argv]) == 0
    finally:
        torch.set_num_threads(threads)
    assert written == [folder]


# -- the model loader ---------------------------------------------------------------------------


def test_load_accepts_torch_dtypes_and_short_names():
    torch = pytest.importorskip("torch")
    from kvqrs.evaluation.model import load, model_dtype

    assert model_dtype(torch.bfloat16) is torch.bfloat16
    assert model_dtype("bf16") is torch.bfloat16 and model_dtype("fp16") is torch.float16
    assert model_dtype("float32") is torch.float32 and model_dtype("BFloat16") is torch.bfloat16
    for bad in ("int8", torch.int8, 3, None):
        with pytest.raises(KvqrsError, match="bf16") as e:
            load(bad)
        assert repr(bad) in str(e.value)


def test_no_progress_hides_the_gguf_conversion_bar(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvqrs.evaluation import model as model_mod
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    class Fake:  # a tokenizer of 10 tokens and a model embedding 10
        def eval(self):
            return self

        def __len__(self):
            return 10

        def get_input_embeddings(self):
            return torch.nn.Embedding(10, 1)

    def fake_from_pretrained(*a, **k):
        for _ in gguf_utils.tqdm(range(50), desc="Converting and de-quantizing GGUF tensors...", mininterval=0):
            pass
        return Fake()

    bar = gguf_utils.tqdm
    monkeypatch.setattr(model_mod, "model_dir", lambda: "folder")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    model_mod.load(progress=True)
    assert "Converting and de-quantizing" in capsys.readouterr().err
    model_mod.load(progress=False)
    assert "Converting and de-quantizing" not in capsys.readouterr().err
    assert gguf_utils.tqdm is bar  # restored after the load


# -- torch threads ------------------------------------------------------------------------------


def test_fastest_threads_times_and_sets_the_thread_count():
    torch = pytest.importorskip("torch")
    from kvqrs.hf import fastest_threads, set_num_threads

    model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 100))
    before = torch.get_num_threads()
    try:
        n, timings = fastest_threads(model, torch.randint(0, 100, (1, 64)))
        assert n in timings and 1 in timings and all(t > 0 for t in timings.values())
        assert torch.get_num_threads() == n and timings[n] == min(timings.values())
        assert set_num_threads(1) == n and torch.get_num_threads() == 1
        with pytest.raises(KvqrsError, match="n: expected an integer >= 1"):
            set_num_threads(0)
        with pytest.raises(KvqrsError, match="input_ids"):
            fastest_threads(model, torch.zeros((1, 0), dtype=torch.long))
    finally:
        torch.set_num_threads(before)


def test_version_is_the_release():
    assert kvqrs.__version__ == "0.2.0"


def test_calibrate_preset_measures_and_records_its_value_scale(text_file, tmp_path, monkeypatch):
    """`kvqrs calibrate --preset` passes the preset's value scale to the sensitivity measurement
    and records it (and its other settings) in the file, so its eval row and
    `QuantConfig.preset` use it."""
    pytest.importorskip("torch")
    from kvqrs.evaluation import llama_protocol as lp
    from kvqrs.evaluation import model as model_mod
    from kvqrs.hf import calibration
    from kvqrs.hf.calibration import calibration_meta
    from kvqrs.hf.config import PRESETS
    from kvqrs.schemes.matched import random_calibration

    seen = {}

    def allocate(
        model,
        fit,
        probe,
        budget,
        kw,
        vw,
        group,
        sinks,
        norms,
        sink_dtype,
        scale,
        classes,
        sensitivity,
        samples,
        progress,
        key_scales,
        uniform_layers,
    ):
        seen.update(
            budget=budget, norms=norms, scale=scale, classes=classes, sensitivity=sensitivity, samples=samples, key_scales=key_scales
        )
        seen.update(uniform_layers=uniform_layers, vw=vw)
        return {0: dataclasses.replace(random_calibration(16, 3, 0), value_bits=3)}

    monkeypatch.setattr(model_mod, "load", lambda *a, **k: (object(), object()))
    monkeypatch.setattr(model_mod, "describe", lambda *a, **k: {"summary": "a stub model"})
    monkeypatch.setattr(lp, "llama_chunks", lambda tok, text, ctx, n: [None] * n)
    monkeypatch.setattr(calibration, "allocate_matched", allocate)
    out = tmp_path / "c.npz"
    assert main(["calibrate", "--data", text_file, "--preset", "3bit", "--no-progress", "--out", str(out)]) == 0
    p = PRESETS["3bit"]
    expect = {"budget": p["budget"], "norms": p["value_norms"], "scale": p["value_scale"], "classes": False}
    defaults = {"sensitivity": "fisher", "samples": 8, "key_scales": "groups", "uniform_layers": False, "vw": tuple(p["value_widths"])}
    assert seen == {**expect, **defaults}  # the second-order estimate by default
    meta = calibration_meta(out)
    assert meta["value_scale"] == p["value_scale"] and meta["preset"] == "3bit"
    assert "uniform_layers" not in meta and "key_widths" in meta
    assert lp.file_row(out).config.value_scale == p["value_scale"]
    # --uniform-layers: passed on and recorded; the key widths follow from the value widths, so none are recorded.
    out = tmp_path / "u.npz"
    argv = ["--budget", "4.25", "--key-scales", "tokens", "--uniform-layers", "--value-widths", "3", "4", "5", "--sink-tokens", "0"]
    assert main(["calibrate", "--data", text_file, *argv, "--no-progress", "--out", str(out)]) == 0
    assert seen["uniform_layers"] is True and seen["key_scales"] == "tokens" and seen["vw"] == (3, 4, 5)
    meta = calibration_meta(out)
    assert meta["uniform_layers"] == "true" and meta["value_widths"] == "3 4 5" and "key_widths" not in meta
