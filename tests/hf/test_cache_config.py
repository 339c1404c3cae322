"""``QuantConfig``: every setting checked when the config is made and when it is set, naming it;
codecs rebuilt for a replaced or changed config; equality by value, pickles and copies; the
value-stage, log-norm and sink-dtype settings refused as the codec refuses them, before anything
is stored; a cache's settings are its own, and generation leaves a shared config unchanged."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import QuantConfig, QuantizedKVCache  # noqa: E402
from kvqrs.schemes import KVCodec  # noqa: E402

from tests.hf.cache_cases import TEXT, _layers  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_attention_state")


@pytest.mark.parametrize("field, value", [("residual_length", 2.5), ("seed", "1"), ("group", True), ("rank", 4.0)])
def test_quant_config_integer_fields(field, value):
    with pytest.raises(KvqrsError, match=field):
        QuantConfig("kqv", 3, **{field: value})


def test_replaced_config_builds_its_own_codecs():
    import dataclasses

    cfg = QuantConfig("kqv", 4, "kqv", 4)
    assert cfg.codec(0, 64).bits == 4
    # A config made by dataclasses.replace must not inherit the original's cached codecs.
    other = dataclasses.replace(cfg, key_bits=2, value_bits=2)
    assert other.codec(0, 64).bits == 2
    assert other.codec(0, 64).value_bits == 2
    assert cfg.codec(0, 64).bits == 4
    # The codecs are no field: a config rebuilt from its fields is the same config.
    assert QuantConfig(**dataclasses.asdict(cfg)) == cfg


@pytest.mark.parametrize(
    "field,value",
    [
        ("group", 0),
        ("group", -32),
        ("rank", 0),
        ("seed", -1),
        ("seed", 2**70),
        ("side_bits", 9),
        ("sign", 5),
        ("sign", True),
        ("headq_base", "nope"),
        ("fused", "yes"),
        ("a2_uniform", "no"),
        ("value_transform", 1),
    ],
)
def test_configs_refuse_settings_no_codec_can_use(field, value):
    """Every setting is checked when the config is made (and when it is set), naming it, not
    at the first codec build or never."""
    with pytest.raises(KvqrsError, match=f"^{field}: expected"):
        QuantConfig("kivi", 4, "kivi", 4, **{field: value})
    cfg = QuantConfig("kivi", 4, "kivi", 4)
    with pytest.raises(KvqrsError, match=f"^{field}: expected"):
        setattr(cfg, field, value)


def test_configs_holding_arrays_compare_by_value():
    """HeadQ bases and matched calibrations hold NumPy arrays: `==` compares them by value (it
    raised on the ambiguous truth value of an array)."""
    import dataclasses

    from kvqrs.schemes.matched import random_calibration

    basis = np.eye(64, 4, dtype=np.float32)
    a = QuantConfig("headq", 4, "kqv", 4, bases={0: basis})
    assert a == QuantConfig("headq", 4, "kqv", 4, bases={0: basis.copy()})
    assert a != dataclasses.replace(a, bases={0: 2 * basis}) and a != dataclasses.replace(a, bases={0: basis.astype(np.float64)})
    m = QuantConfig("matched", 3, "matched", 3, calibration={0: random_calibration(64, 3, 1)})
    assert m == QuantConfig("matched", 3, "matched", 3, calibration={0: random_calibration(64, 3, 1)})
    assert m != dataclasses.replace(m, calibration={0: random_calibration(64, 3, 2)}) and m != "matched"


def test_setting_a_field_validates_it_and_drops_the_built_codecs():
    """A field set on a config whose codecs were built takes effect (the codecs are rebuilt
    from the new settings); a setting the config refuses raises and leaves the old one."""
    cfg = QuantConfig("kqv", 4, "kqv", 4)
    before = cfg.codec(0, 64)
    cfg.key_bits = 2
    after = cfg.codec(0, 64)
    assert after is not before and after.encode_keys(np.zeros((1, 3, 64), np.float32)).params["bits"] == 2
    with pytest.raises(KvqrsError, match="key_bits"):
        cfg.key_bits = 99
    assert cfg.key_bits == 2 and cfg.codec(0, 64) is after
    with pytest.raises(KvqrsError, match="sink_dtype"):
        cfg.sink_dtype = "float16"  # no sinks to store in it
    assert cfg.sink_dtype is None


def test_configs_with_built_codecs_pickle_and_copy():
    import copy
    import pickle

    cfg = QuantConfig("kqv", 4, "kqv", 3, residual_length=8)
    codec = cfg.codec(0, 64)
    for other in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg), copy.copy(cfg)):
        assert other == cfg
        built = other.codec(0, 64)
        assert built is not codec and (built.bits, built.value_bits) == (4, 3)
    assert cfg.codec(0, 64) is codec


def test_generate_does_not_mutate_a_shared_config(model32):
    import dataclasses

    model, tok = model32
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :12]
    cfg = QuantConfig("kqv", 3, "kqv", 3, residual_length=4)
    before = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "_codecs"}
    outs = []
    for _ in range(2):  # two caches share one config, one after the other
        cache = QuantizedKVCache(cfg, _layers(model))
        with torch.no_grad():
            outs.append(model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False))
        assert cache.layers[0].quantized > 0  # the generation really went through this cache
    assert {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "_codecs"} == before
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"value_scale": "lsq"}, r"value_scale: expected one of \('norm', 'least_squares', 'preserve_norm'\)"),
        ({"value_scheme": "kivi", "value_scale": "least_squares"}, "not to value_scheme='kivi'"),
        ({"value_scheme": None, "value_scale": "least_squares"}, "not to value_scheme=None"),
        (
            {"value_scheme": "matched", "calibration": "prefill", "value_transform": True, "value_scale": "least_squares"},
            "not to value_transform=True",
        ),
    ],
)
def test_value_scale_config_is_validated(kwargs, pattern):
    with pytest.raises(KvqrsError, match=pattern):
        QuantConfig(kwargs.pop("key_scheme", "matched" if kwargs.get("value_scheme") == "matched" else "kqv"), 3, **kwargs)


def test_a_cache_keeps_its_settings_when_the_callers_config_changes():
    """The cache codes with a copy of the config it was given: setting a field of the caller's
    config afterwards changes new caches only; the cache's own config refuses changes."""
    cfg = QuantConfig("kv", 4, "kv", 4)
    changed, kept = QuantizedKVCache(cfg, 1), QuantizedKVCache(QuantConfig("kv", 4, "kv", 4), 1)
    gen = torch.Generator().manual_seed(3)
    steps = [(torch.randn(1, 2, n, 64, generator=gen), torch.randn(1, 2, n, 64, generator=gen)) for n in (10, 1, 1)]
    changed.update(*steps[0], 0)
    cfg.key_bits = 2
    kept.update(*steps[0], 0)
    for k, v in steps[1:]:
        changed.update(k, v, 0)
        kept.update(k, v, 0)
    assert changed.to_bytes() == kept.to_bytes() and changed.config.key_bits == 4
    with pytest.raises(KvqrsError, match="belongs to a QuantizedKVCache"):
        changed.config.key_bits = 2
    assert QuantizedKVCache(cfg, 1).config.key_bits == 2


def test_configs_the_codec_refuses_raise_before_anything_is_stored():
    """A QJL stage needs 2 bits (refused when the config is built); a calibration fitted for
    another head_dim is refused by the first update before it stores a token."""
    from kvqrs.schemes.matched import random_calibration

    with pytest.raises(KvqrsError, match="value_bits: expected >= 2 for kqv values"):
        QuantConfig("kqv", 4, "kqv", 1)
    with pytest.raises(KvqrsError, match="key_bits: expected >= 2 for qkqv keys"):
        QuantConfig("qkqv", 1)
    # Per-channel codes join a cache a group at a time: a group must fill whole bytes.
    with pytest.raises(KvqrsError, match="group x key_bits must be a multiple of 8"):
        QuantConfig("kivi", 3, "kivi", 3, group=4)
    with pytest.raises(KvqrsError, match="group x key_bits must be a multiple of 8"):
        QuantConfig("headq", 3, "kivi", 3, group=12, bases="random")
    with pytest.raises(KvqrsError, match="group must be a multiple of 8"):
        QuantConfig("matched", 3, "matched", 3, group=12, calibration="random")
    cfg = QuantConfig("matched", 3, "matched", 3, group=8, residual_length=2, calibration={0: random_calibration(8, 3, 0)})
    cache = QuantizedKVCache(cfg, 1)
    with pytest.raises(KvqrsError, match="fitted for head_dim 8, codec head_dim is 16"):
        cache.update(torch.randn(1, 1, 20, 16), torch.randn(1, 1, 20, 16), 0)
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0


@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        (("kivi", 2, "kqv", 3), {}, "not to value_scheme='kqv'"),
        (("matched", 3, "matched", 3), {"calibration": "prefill", "value_transform": True}, "not to value_transform=True"),
        (("kivi", 2, "kv", 3), {"value_norms": "log"}, r"value_norms: expected one of \('float', 'log8'\)"),
    ],
)
def test_log8_value_norms_replace_a_plain_mse_norm_only(args, kwargs, pattern):
    with pytest.raises(KvqrsError, match=pattern):
        QuantConfig(*args, group=8, value_norms=kwargs.pop("value_norms", "log8"), **kwargs)


def test_log8_value_norms_need_a_group_the_log_code_takes():
    """The log code takes groups of up to 2^20 values: a config (and a codec) with a larger
    group is refused when made, not at its first encode."""
    QuantConfig("kqv", 3, "kv", 3, group=2**20, value_norms="log8")
    with pytest.raises(KvqrsError, match=r"^group: log8 norms .* expected a group in 1\.\.1048576, got 1048577$"):
        QuantConfig("kqv", 3, "kv", 3, group=2**20 + 1, value_norms="log8")
    with pytest.raises(KvqrsError, match=r"^group: expected >= 1, got 0$"):  # no config takes it
        QuantConfig("kqv", 3, "kv", 3, group=0, value_norms="log8")
    with pytest.raises(KvqrsError, match=r"^group: log8 norms"):
        KVCodec("kqv", 3, 64, value_scheme="kv", group=2**20 + 1, value_norms="log8")
    # Float norms have no exponent groups: the group bounds only what uses it.
    QuantConfig("kqv", 3, "kv", 3, group=2**20 + 1)


def test_config_and_codec_refuse_value_stage_settings_alike():
    """QuantConfig refuses, before any codec exists, what its codecs would refuse: the same
    check names the setting and the values it does not apply to."""
    for kwargs in ({"value_scale": "least_squares"}, {"value_norms": "log8"}):
        with pytest.raises(KvqrsError) as config_error:
            QuantConfig("kqv", 3, "kivi", 3, group=8, **kwargs)
        with pytest.raises(KvqrsError) as codec_error:
            KVCodec("kqv", 3, 64, value_scheme="kivi", group=8, **kwargs)
        config_msg, codec_msg = str(config_error.value), str(codec_error.value)
        assert config_msg.endswith("not to value_scheme='kivi'") and codec_msg.endswith("not to 'kivi' values")
        assert config_msg.removesuffix("value_scheme='kivi'") == codec_msg.removesuffix("'kivi' values")


@pytest.mark.parametrize("kwargs", [{}, {"sink_tokens": 0}])
def test_sink_dtype_needs_sinks(kwargs):
    """A sink dtype with no sink tokens would store nothing: refused, naming both settings."""
    with pytest.raises(KvqrsError, match=r"^sink_dtype: 'float16' sets how sink tokens are stored, but sink_tokens is 0"):
        QuantConfig("kqv", 4, "kqv", 4, sink_dtype="float16", **kwargs)
    QuantConfig("kqv", 4, "kqv", 4, sink_dtype="float16", sink_tokens=1)
    QuantConfig("kqv", 4, "kqv", 4, sink_dtype=None, **kwargs)
    # A preset's sink dtype goes with its sinks: overriding them away drops it too.
    from kvqrs.schemes.matched import random_calibration

    cal = {0: random_calibration(64, 4, 0)}
    assert QuantConfig.preset("4bit", cal).sink_dtype == "float16"
    assert QuantConfig.preset("4bit", cal, sink_tokens=0).sink_dtype is None
    with pytest.raises(KvqrsError, match="but sink_tokens is 0"):
        QuantConfig.preset("4bit", cal, sink_tokens=0, sink_dtype="bfloat16")


def _classes_calibration():
    import dataclasses

    from kvqrs.schemes.matched import random_calibration

    return {0: dataclasses.replace(random_calibration(32, 3, 1), value_bits=2, value_classes=((3, 4), (2, 8), (1, 4)))}


@pytest.mark.parametrize(
    "make,chunk",
    [
        (lambda: QuantConfig("kqv", 4, "kqv", 4), 1),
        (lambda: QuantConfig("kivi", 4, "kivi", 4, group=16), 16),  # per-channel key groups
        (lambda: QuantConfig("headq", 4, "kv", 4, headq_base="kivi", bases="random", group=8), 8),
        (lambda: QuantConfig("kv", 4, "kv", 4, value_norms="log8", group=32), 32),  # an exponent per group
        (lambda: QuantConfig("matched", 3, "matched", 3, calibration="prefill", group=24), 24),
        (lambda: QuantConfig("kv", 3, "matched", 3, calibration="prefill", value_transform=True, group=32), 32),
        (lambda: QuantConfig("kv", 3, "matched", 3, calibration=_classes_calibration(), group=16), 16),  # width classes
        (lambda: QuantConfig("kv", 4, "a2", 4), 1),
        (lambda: QuantConfig("kv", 4, None), 1),
    ],
)
def test_chunk_is_the_declared_layouts_alignment(make, chunk):
    """QuantConfig.chunk reads the codec's declared layouts (KVCodec.align): the parts shared by a
    group of tokens, on either side, set it; transform-coded values and width classes too."""
    config = make()
    assert config.chunk == chunk
    if not config.has_value_classes:  # (whose classes fill the group they were fitted for)
        config.group = 2 * config.group  # a changed setting is read again
        assert config.chunk == (1 if chunk == 1 else 2 * chunk)


# -- a calibration file's recorded settings -------------------------------------------------------

RECORDED = {"group": 256, "sink_tokens": 1, "value_norms": "log8", "sink_dtype": "float16", "value_scale": "preserve_norm"}


def _calibration_file(tmp_path, name="cal.npz", layers=2, d=64, **meta):
    from kvqrs.hf import save_matched
    from kvqrs.schemes.matched import random_calibration

    return save_matched(tmp_path / name, {i: random_calibration(d, 3, i) for i in range(layers)}, {**RECORDED, **meta})


def _settings(cfg):
    return {k: getattr(cfg, k) for k in RECORDED}


def test_config_takes_the_settings_its_calibration_file_records(tmp_path):
    """``QuantConfig(calibration=load_matched(path))`` codes as the file was made (its group,
    sinks, sink dtype, value norms and value scale), as ``QuantConfig.preset`` and
    ``KVQRS_CALIBRATION`` do; a field passed explicitly keeps its value."""
    import dataclasses

    from kvqrs.hf import load_matched

    path = _calibration_file(tmp_path)
    cfg = QuantConfig("matched", 4, "matched", 4, calibration=load_matched(path))
    assert _settings(cfg) == RECORDED
    assert cfg.codec(0, 64).value_norms == "log8" and cfg.codec(0, 64).value_scale == "preserve_norm"
    # Passed explicitly (by keyword or position), a setting is the caller's, even the default.
    explicit = QuantConfig("matched", 4, "matched", 4, 0, 1, None, calibration=load_matched(path), group=32, value_scale="norm")
    assert _settings(explicit) == {**RECORDED, "group": 32, "value_scale": "norm", "sink_dtype": None}
    # No sinks asked for: the recorded sink dtype has nothing to store.
    assert _settings(QuantConfig("matched", 4, "matched", 4, sink_tokens=0, calibration=load_matched(path)))["sink_dtype"] is None
    # Keys only, or transform-coded values: no MSE value stage takes the value settings.
    keys_only = QuantConfig("matched", 4, None, calibration=load_matched(path))
    assert _settings(keys_only) == {**RECORDED, "value_norms": "float", "value_scale": "norm"}
    # Set on a built config or replaced, a field is the caller's; a plain dict records nothing.
    cfg.group = 64
    assert cfg.group == 64
    other = _calibration_file(tmp_path, "other.npz", group=128)
    assert dataclasses.replace(cfg, calibration=load_matched(other)).group == 64
    assert _settings(QuantConfig("matched", 4, "matched", 4, calibration=dict(load_matched(path)))) == {
        "group": 32,
        "sink_tokens": 0,
        "value_norms": "float",
        "sink_dtype": None,
        "value_scale": "norm",
    }
    # Copies carry the recorded metadata; a config rebuilt from its fields is the same config.
    import pickle

    assert pickle.loads(pickle.dumps(load_matched(path))).meta == load_matched(path).meta
    assert QuantConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}) == cfg


def test_kvqrs_calibration_reads_the_file_as_the_constructor_does(tmp_path):
    from kvqrs.hf import load_matched, save_matched
    from kvqrs.schemes.matched import MatchedCalibration, fit_basis
    from kvqrs.vllm.settings import config_from_env

    x = np.random.default_rng(0).standard_normal((2, 300, 16)).astype(np.float32)
    cal = {0: MatchedCalibration(fit_basis(x, 3.0, 8, scales="tokens"), x.mean(axis=1))}
    path = save_matched(
        tmp_path / "tokens.npz", cal, {"group": 16, "sink_tokens": 0, "value_norms": "float", "value_scale": "least_squares"}
    )
    env = config_from_env({"KVQRS_SCHEME": "matched", "KVQRS_BITS": "3", "KVQRS_CALIBRATION": str(path), "KVQRS_GROUP": "64"})
    assert env == QuantConfig("matched", 3, "matched", 3, calibration=load_matched(path))
    assert (env.group, env.value_scale) == (16, "least_squares")


def test_recorded_settings_the_config_refuses_name_the_file(tmp_path):
    from kvqrs.hf import load_matched

    bad = _calibration_file(tmp_path, group=12)
    with pytest.raises(
        KvqrsError, match=r"^group: the matched scheme .* got 12 \(taken from calibration file '.*cal.npz': \{'group': 12, "
    ):
        QuantConfig("matched", 4, "matched", 4, calibration=load_matched(bad))
    garbled = _calibration_file(tmp_path, "garbled.npz", sink_tokens="one")
    with pytest.raises(KvqrsError, match=r"^calibration: '.*garbled.npz' records sink_tokens 'one'; expected an integer of ASCII digits$"):
        QuantConfig("matched", 4, "matched", 4, calibration=load_matched(garbled))


def test_preset_checks_a_loaded_file_as_its_path(tmp_path):
    """A dict read by load_matched carries what its file records: the preset refuses one made
    for other settings, as it refuses the path."""
    from kvqrs.hf import load_matched

    from tests.schemes.test_matched import preset_meta

    path = _calibration_file(tmp_path, **preset_meta("3bit"))
    assert QuantConfig.preset("3bit", load_matched(path)).group == QuantConfig.preset("3bit", path).group
    with pytest.raises(KvqrsError, match=r"^calibration: '.*cal.npz' was made for preset '3bit', not '4bit'"):
        QuantConfig.preset("4bit", load_matched(path))


def test_repr_summarises_calibrations_and_bases(tmp_path):
    """The repr names every field, a calibration or HeadQ bases by class, layers and bits or
    shapes, not by their arrays (a 30-layer calibration printed about 380k characters)."""
    from kvqrs.hf import load_matched

    path = _calibration_file(tmp_path, layers=30, d=128)
    text = repr(QuantConfig("matched", 4, "matched", 4, calibration=load_matched(path)))
    assert len(text) < 600, len(text)
    assert f"calibration=<CalibrationFile {str(path)!r}: 30 layers of MatchedCalibration, key code bits 3, value bits the config>" in text
    assert text.startswith("QuantConfig(key_scheme='matched', key_bits=4, value_scheme='matched', value_bits=4, residual_length=0, ")
    assert "group=256" in text and "value_norms='log8'" in text
    assert (
        repr(load_matched(path))
        == f"<CalibrationFile {str(path)!r}: 30 layers of MatchedCalibration, key code bits 3, value bits the config>"
    )
    plain = repr(QuantConfig("matched", 4, "matched", 4, calibration=dict(load_matched(path))))
    assert "calibration=<dict: 30 layers of MatchedCalibration" in plain and len(plain) < 600
    bases = {i: np.zeros((3, 64, 4), np.float32) for i in range(30)}
    text = repr(QuantConfig("headq", 2, "kqv", 2, bases=bases))
    assert "bases=<dict: 30 layers, (3, 64, 4)>" in text and len(text) < 600
    assert "calibration='prefill'" in repr(QuantConfig("matched", 4, "matched", 4, calibration="prefill"))
