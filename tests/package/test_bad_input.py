"""Wrong inputs on the newer surfaces (calibration files and presets, saved caches, the command
line's arguments, the vLLM environment) raise :class:`kvqrs.KvqrsError` naming the argument,
what was expected and what came, before any work starts, never a traceback of another type or
a wrong result."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvqrs import KvqrsError

# -- the vLLM environment ------------------------------------------------------------------------


def test_vllm_environment_refuses_a_scheme_that_is_not_a_string():
    from kvqrs.vllm.settings import environment

    with pytest.raises(KvqrsError, match="^scheme: expected a scheme name .*got None"):
        environment(None, 4)
    with pytest.raises(KvqrsError, match="^bits: expected an integer, got '4'"):
        environment("kqv", "4")


@pytest.mark.parametrize("raw", ["4_0", "\u0664", "４"])
def test_vllm_bits_accept_only_ascii_digits(raw):
    from kvqrs.vllm.settings import config_from_env

    with pytest.raises(KvqrsError, match=f"^KVQRS_BITS: expected an integer of ASCII digits, got {raw.strip()!r}"):
        config_from_env({"KVQRS_SCHEME": "kqv", "KVQRS_BITS": raw})
    assert config_from_env({"KVQRS_SCHEME": "kqv", "KVQRS_BITS": " 3 "}).key_bits == 3


def test_vllm_calibration_file_is_for_matched_and_must_be_one(tmp_path):
    from kvqrs.vllm.settings import config_from_env

    with pytest.raises(KvqrsError, match="^KVQRS_CALIBRATION: a calibration file serves KVQRS_SCHEME=matched, not 'kqv'"):
        config_from_env({"KVQRS_SCHEME": "kqv", "KVQRS_CALIBRATION": str(tmp_path / "cal.npz")})
    with pytest.raises(KvqrsError, match="^KVQRS_CALIBRATION='.*cal.npz': .*no such file"):
        config_from_env({"KVQRS_SCHEME": "matched", "KVQRS_CALIBRATION": str(tmp_path / "cal.npz")})
    (tmp_path / "bad.npz").write_bytes(b"not a calibration")
    with pytest.raises(KvqrsError, match="^KVQRS_CALIBRATION='.*bad.npz': calibration: "):
        config_from_env({"KVQRS_SCHEME": "matched", "KVQRS_CALIBRATION": str(tmp_path / "bad.npz")})
    with pytest.raises(KvqrsError, match="^KVQRS_\\*: .*the matched scheme needs one"):
        config_from_env({"KVQRS_SCHEME": "matched"})


# -- calibration files and presets ---------------------------------------------------------------


def _calibration(layers: int = 2, d: int = 16) -> dict:
    from kvqrs.schemes.matched import random_calibration

    return {i: random_calibration(d, 3, i) for i in range(layers)}


def _preset_file(tmp_path, name: str, **meta):
    from kvqrs.hf import save_matched

    from tests.schemes.test_matched import preset_meta

    return save_matched(tmp_path / f"{name}.npz", _calibration(), {**preset_meta(name), **meta})


def test_preset_refuses_a_file_made_for_another_preset(tmp_path):
    from kvqrs.hf import QuantConfig

    f = _preset_file(tmp_path, "4bit")
    assert QuantConfig.preset("4bit", f).key_bits == 4
    with pytest.raises(KvqrsError, match=r"^calibration: '.*4bit.npz' was made for preset '4bit', not '3bit'; make it with"):
        QuantConfig.preset("3bit", f)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"group": 128}, "group '256' (the config's: '128')"),
        ({"value_norms": "float"}, "value_norms 'log8' (the config's: 'float')"),
        ({"sink_dtype": "bfloat16"}, "sink_dtype 'float16' (the config's: 'bfloat16')"),
        ({"value_scale": "norm"}, "value_scale 'preserve_norm' (the config's: 'norm')"),
        ({"sink_tokens": 2}, "sink_tokens '1' (the config's: '2')"),
    ],
)
def test_preset_compares_overrides_against_the_file(tmp_path, override, message):
    from kvqrs.hf import QuantConfig

    f = _preset_file(tmp_path, "4bit")
    with pytest.raises(KvqrsError, match=r"^calibration: '.*' was made with " + re.escape(message)):
        QuantConfig.preset("4bit", f, **override)
    assert QuantConfig.preset("4bit", f, residual_length=16, seed=3).residual_length == 16  # settings the widths do not depend on


def test_preset_compares_a_budget_file_by_its_budget_and_widths(tmp_path):
    """A --budget file without a preset name is the preset's when its budget and widths are;
    one that records no budget or widths (older, or written by hand) is refused by name."""
    from kvqrs.hf import QuantConfig, save_matched

    from tests.schemes.test_matched import preset_meta

    meta = preset_meta("3bit")
    del meta["preset"]
    assert QuantConfig.preset("3bit", save_matched(tmp_path / "a.npz", _calibration(), meta)).key_bits == 3
    with pytest.raises(KvqrsError, match=r"was made with budget '3.25' \(the config's: '2.5'\), key_widths"):
        QuantConfig.preset("2bit", save_matched(tmp_path / "b.npz", _calibration(), {**meta, "group": 128}))
    old = {k: v for k, v in meta.items() if k not in ("key_widths", "value_widths")}
    with pytest.raises(KvqrsError, match=r"does not record its key_widths, value_widths; make it with `kvqrs calibrate --preset 3bit`"):
        QuantConfig.preset("3bit", save_matched(tmp_path / "c.npz", _calibration(), old))


@pytest.mark.parametrize("override", ["key_scheme", "value_bits", "calibration", "no_such_field"])
def test_preset_refuses_overrides_of_what_it_sets(override):
    from kvqrs.hf import QuantConfig

    with pytest.raises(KvqrsError, match=rf"^preset: overrides: expected QuantConfig fields other than .* got \['{override}'\]"):
        QuantConfig.preset("4bit", _calibration(d=64), **{override: "kv"})


def _damaged(tmp_path, blob: bytes):
    f = tmp_path / "damaged.npz"
    f.write_bytes(blob)
    return f


def test_damaged_calibration_file_raises_kvqrs_error(tmp_path, text_file, no_model, capsys):
    from kvqrs.cli import main
    from kvqrs.hf import QuantConfig, load_matched

    blob = _preset_file(tmp_path, "4bit").read_bytes()
    flipped = bytearray(blob)
    flipped[100] ^= 1  # inside the first entry's data: a CRC mismatch
    for damaged in (blob[: len(blob) // 2], blob[:-30], bytes(flipped)):
        f = _damaged(tmp_path, damaged)
        with pytest.raises(KvqrsError, match=r"^calibration: cannot read '.*damaged.npz': a damaged archive \("):
            load_matched(f)
        with pytest.raises(KvqrsError, match="a damaged archive"):
            QuantConfig.preset("4bit", f)
        with pytest.raises(SystemExit) as e:
            main(["eval", "--protocol", "llama", "--data", text_file, "--threads", "1", "--calibration", str(f)])
        assert e.value.code == 2 and "a damaged archive" in capsys.readouterr().err


@given(st.data())
def test_altered_calibration_bytes_load_or_raise_kvqrs_error(data):
    from kvqrs.hf import load_matched, save_matched

    blob = bytearray(save_matched(io.BytesIO(), _calibration(1, 8), {"preset": "4bit"}).getvalue())
    for _ in range(data.draw(st.integers(1, 3))):
        blob[data.draw(st.integers(0, len(blob) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    blob = blob[: data.draw(st.integers(1, len(blob)))]
    try:
        load_matched(io.BytesIO(bytes(blob)))
    except KvqrsError:
        pass


def _archive(tmp_path, **replace):
    """A calibration file with some entries replaced (None: removed)."""
    from kvqrs.hf import save_matched

    with np.load(save_matched(tmp_path / "ok.npz", _calibration())) as z:
        entries = {k: z[k] for k in z.files}
    entries.update(replace)
    np.savez(tmp_path / "edited.npz", **{k: v for k, v in entries.items() if v is not None})
    return tmp_path / "edited.npz"


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        ({"vbits_1": np.array([3, 4], np.uint8)}, r"layer 1: entry 'vbits_1': expected a 0-dimensional numeric array, got shape \(2,\)"),
        ({"mean_0": np.zeros((3, 16, 2), np.float32)}, r"layer 0: entry 'mean_0': expected a 2-dimensional"),
        ({"vmean_1": None}, r"layer 1: entry 'vmean_1' is missing"),
        ({"vbits_0": np.array(3.5)}, r"layer 0: value_bits: expected None or an integer width"),
    ],
)
def test_calibration_entry_of_a_bad_shape_is_named(tmp_path, replace, message):
    from kvqrs.hf import load_matched

    with pytest.raises(KvqrsError, match=r"^calibration: '.*edited.npz', " + message):
        load_matched(_archive(tmp_path, **replace))


@pytest.mark.parametrize("layer", ["-1", "\u0661", "1_0", "x"])
def test_calibration_layer_keys_must_be_ascii_digits(tmp_path, layer):
    from kvqrs.hf import load_matched

    cal = _calibration(1)[0]
    f = _archive(tmp_path, **{f"widths_{layer}": cal.keys.widths, f"mean_{layer}": cal.keys.mean})
    with pytest.raises(KvqrsError, match=rf"has entry '(widths|mean)_{layer}'; expected .*<layer> with a layer number of ASCII digits"):
        load_matched(f)


# -- the command line: arguments checked before the work -----------------------------------------


def _refused(argv, capsys) -> str:
    from kvqrs.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--head-dims", "-4"], "--head-dims: expected head dimensions of at least 2, got -4"),
        (["--bits", "0"], "--bits: expected bit widths in 1..8, got 0"),
    ],
)
def test_selfcheck_refuses_bad_grid_values(capsys, argv, message):
    assert message in _refused(["selfcheck", "--vectors", "10", *argv], capsys)


@pytest.mark.parametrize(
    ("seed", "message"),
    [("-1", "expected an integer in 0 .. 2**64 - 1, got -1"), (str(2**64), f"got {2**64}"), ("1.5", "expected an integer, got '1.5'")],
)
def test_seeds_outside_numpys_range_are_refused_when_parsed(capsys, tmp_path, seed, message):
    """Before the model loads (eval) and before a report file is emptied (needle)."""
    assert "argument --seed: " in (err := _refused(["selfcheck", "--seed", seed], capsys)) and message in err
    out = tmp_path / "needle"
    assert message in _refused(["eval", "--task", "needle", "--quick", "--seed", seed, "--out", str(out)], capsys)
    assert not out.exists()


@pytest.fixture
def no_study(monkeypatch):
    """Fail the test if the study starts."""
    from kvqrs.evaluation import study

    def refuse(*a, **k):
        raise AssertionError("the study ran")

    monkeypatch.setattr(study, "run_study", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schemes", "kqv", "nope"], "--schemes: scheme: expected one of"),
        (["--bits", "2", "9"], "--bits: expected bit widths in 1..8, got 9"),
        (["--head-dims", "64", "-4"], "--head-dims: expected head dimensions of at least 2, got -4"),
        (["--distributions", "cauchy"], "--distributions: distribution: expected one of"),
    ],
)
def test_study_refuses_bad_grid_values_before_the_first_sample(no_study, capsys, tmp_path, argv, message):
    assert message in _refused(["study", "--quick", "--no-progress", "--out", str(tmp_path / "r"), *argv], capsys)


def test_study_refuses_an_unwritable_report_folder_before_the_study(no_study, capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    err = _refused(["study", "--quick", "--no-progress", "--out", str(blocker / "r")], capsys)
    assert "--out: cannot create the report folder" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ctx", "100000"], "--ctx: expected 4 .. 8192 tokens per chunk (the model's context), got 100000"),
        (["--ctx", "2"], "--ctx: expected 4 .. 8192 tokens per chunk"),
        (["--chunks", "-1"], "--chunks: expected a positive number of chunks to evaluate, got -1"),
        (["--chunks", "0"], "--chunks: expected a positive number of chunks to evaluate, got 0"),
        (["--calibration-windows", "0"], "--calibration-windows: expected a positive integer, got 0"),
        (["--matched-bits", "0"], "--matched-bits: expected 0 < BITS <= 8 and GROUP a positive multiple of 8, got '0'"),
        (["--matched-bits", "4@12"], "got '4@12'"),
        (["--matched-bits", "9@256"], "got '9@256'"),
    ],
)
def test_eval_llama_refuses_bad_counts_before_the_model_and_the_report_folder(text_file, no_model, capsys, tmp_path, argv, message):
    out = tmp_path / "report"
    assert message in _refused(["eval", "--protocol", "llama", "--data", text_file, "--threads", "1", "--out", str(out), *argv], capsys)
    assert not out.exists()


def test_eval_refuses_zero_calibration_windows(text_file, no_model, capsys, tmp_path):
    err = _refused(["eval", "--data", text_file, "--threads", "1", "--out", str(tmp_path / "r"), "--calibration-windows", "0"], capsys)
    assert "--calibration-windows: expected a positive integer, got 0" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ctx", "100000000"], "--ctx: expected at most the model's context of 8192 tokens, got 100000000"),
        (["--out", "{blocker}/cal.npz"], "--out: the folder '{blocker}' of '{blocker}/cal.npz' does not exist"),
        (["--out", "{tmp}"], "--out: cannot write '{tmp}' (a folder"),
        # np.savez appends .npz to another name: the file written would not be the one asked for.
        (["--out", "{tmp}/cal.pt"], "--out: a calibration file is a NumPy .npz archive; give a name ending in .npz (not '{tmp}/cal.pt')"),
        (["--out", "{tmp}/cal.NPZ"], "give a name ending in .npz (not '{tmp}/cal.NPZ')"),
    ],
)
def test_calibrate_refuses_its_output_and_context_before_loading_the_model(text_file, no_model, capsys, tmp_path, argv, message):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    argv = [a.format(blocker=blocker, tmp=tmp_path) for a in argv]
    assert message.format(blocker=blocker, tmp=tmp_path) in _refused(["calibrate", "--data", text_file, *argv], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "text.txt"]  # nothing written


# -- saved caches: edited bytes behind valid checksums ----------------------------------------------


def _saved_cache(config=None) -> bytes:
    """A two-layer cache of 13 tokens (a sink, codes, a window, originals kept for a rollback)."""
    import torch
    from kvqrs.hf import QuantConfig, QuantizedKVCache
    from kvqrs.hf.attention import active

    cache = QuantizedKVCache(config or QuantConfig("kqv", 4, "kqv", 4, residual_length=4, sink_tokens=1), 2)
    cache.activate_past_recording()
    g = torch.Generator().manual_seed(0)
    with active(None):
        for layer in range(2):
            cache.update(torch.randn(1, 2, 13, 16, generator=g), torch.randn(1, 2, 13, 16, generator=g), layer)
    return cache.to_bytes()


def _edited(blob: bytes, edit_meta=None, edit_sections=None) -> bytes:
    """``blob`` with its meta JSON and sections edited, the checksums written anew."""
    import json

    from kvqrs import _native

    sections = [list(s) for s in _native.container_read(blob)]
    if edit_meta is not None:
        meta = json.loads(sections[0][3])
        edit_meta(meta)
        text = json.dumps(meta).encode()
        sections[0] = ["meta", 5, [len(text)], text]
    if edit_sections is not None:
        edit_sections({s[0]: s for s in sections[1:]})
    return _native.container_write([tuple(s) for s in sections])


def _set_layer(**fields):
    return lambda meta: meta["layers"][0].update(fields)


def _window_shape(sections):
    sections["L0.window_keys"][2:] = [[1, 2**40, 0, 16], b""]


@pytest.mark.parametrize(
    ("edit_meta", "edit_sections", "message"),
    [
        (lambda m: m.pop("bases"), None, None),  # a clean load: no bases
        (lambda m: m.update(bases=3), None, "meta's bases: expected a bases name or null, got 3"),
        (lambda m: m.update(layers=[1, 2]), None, "layer 0's meta must be an object, got int"),
        (_set_layer(quantized=-8), None, "layer 0's quantized: expected an integer in 0 .. 2^62 - 1, got -8"),
        (_set_layer(quantized=2**40, seen=2**40 + 5), None, "tokens need"),
        (_set_layer(dtype=5), None, "layer 0's dtype: expected one of"),
        (_set_layer(fitted_tokens=-1), None, "fitted_tokens: expected 0 .. seen"),
        (None, _window_shape, "section 'L0.window_keys' is not a (1, 2, tokens, 16) float32 tensor, got shape [1, 1099511627776, 0, 16]"),
        (_set_layer(batch=2**61), None, "section 'L0.window_keys' is not a (2305843009213693952, 2, tokens, 16)"),
    ],
)
def test_edited_cache_meta_raises_kvqrs_error(edit_meta, edit_sections, message):
    from kvqrs.hf import QuantizedKVCache

    data = _edited(_saved_cache(), edit_meta, edit_sections)
    if message is None:
        QuantizedKVCache.from_bytes(data)
        return
    with pytest.raises(KvqrsError, match="^compressed cache: .*" + re.escape(message)):
        QuantizedKVCache.from_bytes(data)


def _nan_at(name: str, dtype=np.float32):
    def edit(sections):
        a = np.frombuffer(sections[name][3], dtype).copy()
        a[-1] = np.inf if name.endswith("values") else np.nan
        sections[name][3] = a.tobytes()

    return edit


@pytest.mark.parametrize("section", ["L0.window_keys", "L1.sink_values", "L0.pending_keys", "L1.store.keys.norms"])
def test_nan_or_inf_in_a_saved_cache_is_refused_naming_the_section(section):
    from kvqrs.hf import QuantizedKVCache

    blob = _saved_cache()
    with pytest.raises(KvqrsError, match=f"^compressed cache: section '{re.escape(section)}' holds a NaN or an infinity"):
        QuantizedKVCache.from_bytes(_edited(blob, edit_sections=_nan_at(section)))


def test_nan_in_an_encoded_tensor_is_refused_naming_the_part():
    from kvqrs import _native
    from kvqrs import format as fmt
    from kvqrs.schemes import KVCodec

    enc = KVCodec("kqv", 4, 16).encode_keys(np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32))
    sections = [list(s) for s in _native.container_read(fmt.dumps(enc))]
    norms = next(s for s in sections if s[0] == "norms")
    norms[3] = np.full(np.frombuffer(norms[3], enc.parts["norms"].dtype).shape, np.nan, enc.parts["norms"].dtype).tobytes()
    with pytest.raises(KvqrsError, match="^compressed cache: part 'norms' holds a NaN or an infinity"):
        fmt.loads(_native.container_write([tuple(s) for s in sections]))


HOSTILE = [None, -1, 0, 2**40, 2**63, 1.5, "x", [], {}, True, [1, 2], float("nan")]


def _json_paths(obj, prefix=()):
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _json_paths(v, (*prefix, k))


@st.composite
def _cache_edits(draw):
    """An edit of saved cache bytes: a meta value set to a hostile one or removed, or a section
    reshaped, given a NaN, another dtype, random bytes, or removed."""

    def edit_meta(meta):
        path = draw(st.sampled_from(list(_json_paths(meta))[1:]))
        parent = meta
        for k in path[:-1]:
            parent = parent[k]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(st.sampled_from(HOSTILE))

    def edit_sections(sections):
        name = draw(st.sampled_from(sorted(sections)))
        _, code, shape, payload = sections[name]
        how = draw(st.sampled_from(["reshape", "huge", "nan", "dtype", "bytes", "drop"]))
        if how == "reshape":
            shape = list(reversed(shape))
        elif how == "huge" and shape:
            shape, payload = [0] * (len(shape) - 1) + [2**40], b""
        elif how == "nan" and code in (1, 2, 3, 6) and payload:
            payload = (
                payload[: -{1: 2, 2: 4, 3: 8, 6: 2}[code]]
                + {1: b"\x00\x7e", 2: b"\x00\x00\xc0\x7f", 3: b"\x00" * 6 + b"\xf0\x7f", 6: b"\xc0\x7f"}[code]
            )
        elif how == "dtype":
            code, shape = (0, [len(payload)]) if code else (1, [len(payload) // 2]) if len(payload) % 2 == 0 else (code, shape)
        elif how == "bytes":
            payload = draw(st.binary(min_size=len(payload), max_size=len(payload)))
        elif how == "drop":
            sections[name][0] = "dropped." + name
        sections[name][1:] = [code, shape, payload]

    return edit_meta if draw(st.booleans()) else None, edit_sections if draw(st.booleans()) else None


_FUZZ_BLOBS: dict = {}


@settings(max_examples=100)  # a few seconds
@given(st.sampled_from(["kqv", "matched"]), _cache_edits())
def test_cache_format_fuzzer_finds_only_kvqrs_errors(kind, edits):
    """Saved cache bytes with their meta and sections edited and valid checksums written anew
    either load or raise KvqrsError (beside tests/schemes/test_format.py's byte flips)."""
    from kvqrs.hf import QuantConfig, QuantizedKVCache

    if kind not in _FUZZ_BLOBS:
        cfg = QuantConfig("matched", 3, "matched", 3, residual_length=2, group=8, calibration="random", sink_tokens=1)
        _FUZZ_BLOBS[kind] = _saved_cache(None if kind == "kqv" else cfg)
    try:
        data = _edited(_FUZZ_BLOBS[kind], *edits)
    except KvqrsError:
        return  # the container refused the edit itself (a payload of the wrong length)
    try:
        QuantizedKVCache.from_bytes(data)
    except KvqrsError:
        pass


# -- past recording without a crop ----------------------------------------------------------------


@pytest.mark.parametrize("depth", [None, 6])
def test_past_recording_keeps_only_the_originals_the_next_crop_can_need(depth):
    """After activate_past_recording and no crop, 49 tokens fed one forward at a time keep the
    originals of at most the latest forward (or ``recurrent_states_to_keep`` tokens) plus a
    chunk, not of every token coded since; a crop that deep still restores the fresh state."""
    import torch
    from kvqrs.hf import QuantConfig, QuantizedKVCache

    cfg = QuantConfig("kivi", 4, "kivi", 4, residual_length=4, group=8)
    k = torch.randn(1, 2, 49, 16, generator=torch.Generator().manual_seed(0))
    v = k.flip(-1)
    qc = QuantizedKVCache(cfg, 1)
    qc.activate_past_recording(**({} if depth is None else {"recurrent_states_to_keep": depth}))
    qc.update(k[..., :9, :], v[..., :9, :], 0)
    for t in range(9, 49):
        qc.update(k[..., t : t + 1, :], v[..., t : t + 1, :], 0)
    layer = qc.layers[0]
    assert layer.pending_k.shape[-2] <= (depth or 1) + cfg.chunk - 1
    qc.crop(-(depth or 1))
    fresh = QuantizedKVCache(cfg, 1)
    fresh.update(k[..., : 49 - (depth or 1), :], v[..., : 49 - (depth or 1), :], 0)
    for a, b in zip(qc.layers[0].materialize(), fresh.layers[0].materialize()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_missing_or_unreadable_files_are_named_not_called_damaged(tmp_path):
    from kvqrs.hf import QuantConfig, QuantizedKVCache

    with pytest.raises(KvqrsError, match=r"cannot read '.*nope\.npz': no such file$"):
        QuantConfig.preset("4bit", str(tmp_path / "nope.npz"))
    with pytest.raises(KvqrsError, match=r"cannot read '.*': Is a directory$"):
        QuantConfig.preset("4bit", str(tmp_path))
    with pytest.raises(KvqrsError, match=r"^path: cannot read the saved cache '.*missing\.kvqc': No such file"):
        QuantizedKVCache.load(tmp_path / "missing.kvqc")
