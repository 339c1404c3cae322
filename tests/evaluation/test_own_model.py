"""``kvqrs eval`` / ``kvqrs calibrate`` on the user's own model (``--model``): a tiny random Llama
(hidden 64, 2 layers) with SmolLM2's tokenizer, saved as a transformers folder and as a GGUF
file; and the models refused before any work starts, with the reason."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.evaluation import model as model_mod  # noqa: E402

from tests.process_helpers import cli_refusal  # noqa: E402

# The same float32 weights read from the folder and from the GGUF file (float32 tensors): the
# same forward, so the same perplexity up to summation order.
SAME_MODEL_RTOL = 1e-6
WORDS = "the a river stone city people north old light water year king song road field market winter house over under".split()


pytestmark = pytest.mark.usefixtures("isolated_attention_state")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(folder, gguf file, text file)``: a tiny random Llama with SmolLM2's tokenizer."""
    try:
        source = model_mod.model_dir() / model_mod.GGUF_FILE
    except KvqrsError as e:
        pytest.skip(f"SmolLM2's tokenizer not available: {e}")
    root = tmp_path_factory.mktemp("own")
    tok = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    folder = root / "tiny-llama"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    from tests.gguf_helpers import write_llama_gguf

    gguf = write_llama_gguf(model, root / "tiny-llama.gguf", source)
    rng = random.Random(0)
    text = root / "text.txt"
    sentence = lambda: " ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + "."  # noqa: E731
    text.write_text("\n\n".join(" ".join(sentence() for _ in range(12)) for _ in range(40)))
    return folder, gguf, text


def _cli(args, cwd, monkeypatch, capsys) -> str:
    """Run ``kvqrs ARGS`` in this process (exit status 0); returns its stdout."""
    from kvqrs import cli

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    try:
        assert cli.main([*args, "--no-progress", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def _eval_quick(path, text, out, cwd, monkeypatch, capsys) -> tuple[dict, str]:
    args = ["eval", "--quick", "--model", str(path), "--data", str(text), "--rows", "kqv k4", "--window", "32"]
    stdout = _cli([*args, "--windows", "1", "--calibration-windows", "1", "--out", str(out)], cwd, monkeypatch, capsys)
    return json.loads((out / "eval.json").read_text()), stdout


def test_cli_eval_quick_on_a_model_folder_and_its_gguf(tiny, tmp_path, monkeypatch, capsys):
    folder, gguf, text = tiny
    res, stdout = _eval_quick(folder, text, tmp_path / "folder", tmp_path, monkeypatch, capsys)
    assert res["model"] == {
        "name": "tiny-llama",
        "dtype": "float32",
        "layer_types": ["full_attention"] * 2,
        "summary": "tiny-llama (float32); 2 layers, all full_attention",
    }
    assert "model: tiny-llama (float32); 2 layers, all full_attention" in stdout
    assert "# kvqrs eval: tiny-llama (float32); 2 layers, all full_attention" in (tmp_path / "folder" / "eval.md").read_text()
    assert [r["row"] for r in res["rows"]] == ["dense", "kqv k4", "kqv k4 v4"]
    assert all(np.isfinite(r["ppl"]) for r in res["rows"])
    from_gguf, _ = _eval_quick(gguf, text, tmp_path / "gguf", tmp_path, monkeypatch, capsys)
    assert from_gguf["model"]["summary"] == "tiny-llama.gguf (dequantized to float32); 2 layers, all full_attention"
    dense = [r["ppl"] for r in (res["rows"][0], from_gguf["rows"][0])]
    assert dense[0] == pytest.approx(dense[1], rel=SAME_MODEL_RTOL)


def test_cli_llama_protocol_and_needle_on_a_model_folder(tiny, tmp_path, monkeypatch, capsys):
    folder, _, text = tiny
    common = ["--model", str(folder), "--data", str(text), "--quick"]
    _cli(
        ["eval", "--protocol", "llama", *common, "--ctx", "64", "--chunks", "1", "--matched-bits", "4", "--out", "ll"],
        tmp_path,
        monkeypatch,
        capsys,
    )
    md = (tmp_path / "ll" / "llama.md").read_text()
    assert md.startswith("Model: tiny-llama (float32); 2 layers, all full_attention")
    assert "matched" in md and "llama.cpp's own rows" not in md  # those were measured on SmolLM2
    _cli(
        ["eval", "--task", "needle", *common, "--contexts", "200", "--depths", "0.5", "--trials", "1", "--rows", "kqv", "--out", "nd"],
        tmp_path,
        monkeypatch,
        capsys,
    )
    assert json.loads((tmp_path / "nd" / "needle.json").read_text())["model"]["name"] == "tiny-llama"
    assert "# kvqrs eval --task needle: tiny-llama (float32)" in (tmp_path / "nd" / "needle.md").read_text()


def test_cli_calibrate_a_model_folder(tiny, tmp_path, monkeypatch, capsys):
    from kvqrs.hf import load_matched
    from kvqrs.hf.calibration import calibration_meta

    folder, _, text = tiny
    args = [
        "calibrate",
        "--model",
        str(folder),
        "--dtype",
        "bfloat16",
        "--data",
        str(text),
        "--ctx",
        "32",
        "--windows",
        "1",
        "--group",
        "8",
    ]
    stdout = _cli([*args, "--out", "cal.npz"], tmp_path, monkeypatch, capsys)
    assert "model: tiny-llama (bfloat16); 2 layers, all full_attention" in stdout
    assert "group 8, 1 window of 32 tokens; wrote" in stdout
    assert sorted(load_matched(tmp_path / "cal.npz")) == [0, 1]
    assert calibration_meta(tmp_path / "cal.npz")["model"] == "tiny-llama (bfloat16); 2 layers, all full_attention"
    # The file on another model (SmolLM2: 30 layers, head_dim 64) is refused once it loads, by name.
    from kvqrs import cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval", "--protocol", "llama", "--quick", "--calibration", "cal.npz", "--no-progress", "--threads", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "calibration: made for a model of 2 layers (indices 0..1), head_dim 32" in err and "has 30 layers, head_dim 64" in err


def _save_config(folder, cfg):
    folder.mkdir()
    cfg.save_pretrained(folder)  # the config alone: a refused model is never loaded
    return folder


SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=100)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: d / "nope", "does not exist"),
        (lambda d: d, "has no config.json"),
        (lambda d: (d / "w.bin").write_bytes(b"x") and d / "w.bin", "not a .gguf file"),
        (lambda d: "nobody/no-such-model", "nor a hub id in the local Hugging Face cache"),
        (lambda d: _save_config(d / "bert", transformers.BertConfig(**SMALL, intermediate_size=64)), "not a causal decoder"),
        (
            lambda d: _save_config(d / "mamba", transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100)),
            "attention interface",
        ),
    ],
    ids=["missing", "no-config", "not-gguf", "hub-id", "bert", "mamba"],
)
@pytest.mark.parametrize("command", [["eval", "--quick"], ["eval", "--protocol", "llama"], ["eval", "--task", "needle"], ["calibrate"]])
def test_models_the_cache_cannot_serve_are_refused_before_loading(tmp_path, monkeypatch, capsys, make, match, command):
    spec = make(tmp_path)
    err = cli_refusal([*command, "--model", str(spec), "--data", __file__, "--out", str(tmp_path / "o")], tmp_path, monkeypatch, capsys)
    assert f"kvqrs {command[0]}: error: --model:" in err and match in err


@pytest.mark.parametrize(
    "make",
    [
        lambda n: transformers.Gemma2Config(
            **{**SMALL, "vocab_size": n}, intermediate_size=64, head_dim=32, num_key_value_heads=1, sliding_window=16
        ),
        lambda n: transformers.GptOssConfig(
            **{**SMALL, "vocab_size": n},
            intermediate_size=64,
            head_dim=32,
            num_key_value_heads=1,
            sliding_window=16,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
    ],
    ids=["gemma2-softcap", "gpt-oss-sinks"],
)
def test_cli_eval_and_calibrate_models_with_softcap_or_learned_sinks(tiny, tmp_path, monkeypatch, capsys, make):
    """The kvqrs attention computes Gemma-2's logit soft-capping and gpt-oss' learned sink
    logits (tests/hf/test_architectures.py): such a model folder is evaluated and calibrated; its
    dense check runs transformers' eager attention (it has no SDPA path) and agrees."""
    folder, _, text = tiny
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make(len(tok)))
    path = tmp_path / "m"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    res, _ = _eval_quick(path, text, tmp_path / "eval", tmp_path, monkeypatch, capsys)
    check = res["dense_check"]
    assert check["transformers_attention"] == "eager" and check["relative_difference"] < 1e-6
    _cli(
        ["calibrate", "--model", str(path), "--data", str(text), "--ctx", "32", "--windows", "1", "--group", "8", "--out", "c.npz"],
        tmp_path,
        monkeypatch,
        capsys,
    )
    from kvqrs.hf import load_matched

    assert sorted(load_matched(tmp_path / "c.npz")) == [0, 1]


def test_the_default_model_is_smollm2(tiny):
    src = model_mod.source(None)
    assert (src.name, src.gguf_file) == (model_mod.DEFAULT_NAME, model_mod.GGUF_FILE)


def _copy_without(folder, tmp_path, drop) -> str:
    """A copy of the tiny model's folder without the files ``drop(name)`` selects."""
    import shutil

    out = tmp_path / "copy"
    out.mkdir()
    for f in folder.iterdir():
        if not drop(f.name):
            shutil.copy(f, out / f.name)
    return str(out)


def test_a_folder_without_a_tokenizer_is_refused_by_name(tiny, tmp_path):
    folder, _, _ = tiny
    bare = _copy_without(folder, tmp_path, lambda name: name.startswith(("tokenizer", "special_tokens", "vocab", "merges")))
    with pytest.raises(KvqrsError, match=r"no tokenizer could be loaded from 'copy'.*save the model's tokenizer beside it"):
        model_mod.load("float32", progress=False, model=bare)


def test_a_tokenizer_beyond_the_model_vocabulary_is_refused(tiny, tmp_path):
    folder, _, _ = tiny
    small = transformers.LlamaConfig.from_pretrained(folder)
    small.vocab_size = 1000
    torch.manual_seed(0)
    path = tmp_path / "small-vocab"
    transformers.LlamaForCausalLM(small).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(path)
    with pytest.raises(KvqrsError, match=r"has \d+ tokens but the model embeds only 1000"):
        model_mod.load("float32", progress=False, model=str(path))


@pytest.mark.parametrize(
    "command, match",
    [
        (["eval", "--quick", "--window", "64"], "--window: expected at most the model's context of 48 tokens, got 64"),
        (["eval", "--protocol", "llama", "--ctx", "64"], "--ctx: expected 4 .. 48 tokens per chunk (the model's context), got 64"),
        (["eval", "--task", "needle", "--contexts", "64"], "(the model's 48 positions less the answer), got 64"),
        (["calibrate", "--ctx", "64"], "--ctx: expected at most the model's context of 48 tokens, got 64"),
    ],
    ids=["eval-window", "llama-ctx", "needle-contexts", "calibrate-ctx"],
)
def test_lengths_are_checked_against_the_models_own_context(tmp_path, monkeypatch, capsys, command, match):
    folder = _save_config(tmp_path / "short", transformers.LlamaConfig(**SMALL, intermediate_size=64, max_position_embeddings=48))
    assert model_mod.source(str(folder)).context == 48
    err = cli_refusal([*command, "--model", str(folder), "--data", __file__, "--out", str(tmp_path / "o")], tmp_path, monkeypatch, capsys)
    assert match in err
    assert not (tmp_path / "o").exists()  # refused before the report folder
