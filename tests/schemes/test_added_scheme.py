"""Adding a scheme is its registry entry, its coder and its kernels, nothing else (the worked
example of docs/architecture.md, "Adding a scheme").

``tokens16`` codes keys and values in asymmetric uniform groups of 16 channels per token, fixed
whatever the codec's ``group``: a coder of existing kernels (``uniform_encode`` /
``uniform_decode`` through ``KIVICoder``'s per-token layout) and one ``SchemeSpec``. It is
registered here at run time (``registry.register``; a scheme of the package is the same entry in
``registry._SPECS``) and then runs, unchanged, every check of test_registry.py that takes a
scheme, through ``KVCodec``, ``QuantConfig``, the file format, the fused kernel, vLLM's paged
slots and the cache's layer store."""

from __future__ import annotations

import numpy as np
import pytest
from kvqrs.schemes import KVCodec, registry
from kvqrs.schemes.kivi import KIVICoder
from kvqrs.schemes.registry import CoderSettings, SchemeSpec, SideSpec

from . import test_registry as checks

NAME = "tokens16"


# -- the scheme: its coder (existing kernels) and its registry entry ---------------------------
def _tokens16(s: CoderSettings) -> KIVICoder:
    return KIVICoder(s.head_dim, s.bits, 16, False, s.scheme, s.kind, s.backend)  # per token, groups of 16 channels


SPEC = SchemeSpec(
    NAME,
    "asymmetric uniform groups of 16 channels per token, keys and values",
    keys=SideSpec(_tokens16, fused=True),
    values=SideSpec(_tokens16, fused=True),
)


@pytest.fixture(autouse=True)
def registered():
    registry.register(SPEC)
    try:
        yield
    finally:
        registry.unregister(NAME)


# -- every check of test_registry.py that takes a scheme, on it --------------------------------
PER_SIDE = [
    checks.test_coder_declares_the_protocol,
    checks.test_round_trip_bits_and_format,
    checks.test_declared_rates_alignment_and_dtypes_are_what_encodes_store,
    checks.test_fixed_size_per_token_as_declared,
    checks.test_fused_path_as_declared,
    checks.test_bit_range_as_declared,
]
PER_SCHEME = [checks.test_paged_as_declared, checks.test_headq_base_as_declared]
WHOLE_REGISTRY = [
    checks.test_entries_are_named_described_and_consistent,
    checks.test_name_lists_follow_the_registry,
    checks.test_unknown_schemes_are_refused_with_the_lists,
]


@pytest.mark.parametrize("kind", ["keys", "values"])
@pytest.mark.parametrize("check", PER_SIDE, ids=lambda f: f.__name__)
def test_every_side_check(check, kind):
    check(NAME, kind)


@pytest.mark.parametrize("check", PER_SCHEME + WHOLE_REGISTRY, ids=lambda f: f.__name__)
def test_every_scheme_check(check):
    if check in PER_SCHEME:
        check(NAME)
    else:
        check()


@pytest.mark.parametrize("option,value,flag", [("value_scale", "least_squares", "mse_values"), ("value_norms", "log8", "log_norms")])
def test_value_stage_check(option, value, flag):
    checks.test_value_stage_as_declared(NAME, option, value, flag)


def test_it_is_listed_and_taken_everywhere_while_registered():
    from kvqrs.hf import QuantConfig
    from kvqrs.vllm import PAGED_SCHEMES, refuse_reason

    for which in ("KEY_SCHEMES", "VALUE_SCHEMES", "PAGED_SCHEMES"):
        assert NAME in registry.names(which), which
    assert NAME in PAGED_SCHEMES and NAME not in registry.names("HEADQ_BASES")
    config = QuantConfig(NAME, 4, NAME, 4)
    assert config.chunk == 1 and refuse_reason(dataclass_copy(config, residual_length=0)) is None
    codec = KVCodec(NAME, 4, 64, seed=1)
    assert codec.align() == 1 and codec.nbytes("keys", (3, 64)) == 3 * (32 + 2 * 4 * 2)  # codes + 4 groups' scale and zero


def test_the_cache_stores_and_attends_it():
    """A QuantizedKVCache of the scheme: the layer store holds its declared parts, the codes
    decode to the codec's, and the native one-call step reads them (no edit anywhere)."""
    torch = pytest.importorskip("torch")
    from kvqrs.hf import QuantConfig, QuantizedKVCache

    cache = QuantizedKVCache(QuantConfig(NAME, 4, NAME, 4, residual_length=0), 1)
    k, v = (torch.from_numpy(checks.gaussian((1, 2, 20, 32), s)) for s in (1, 2))
    keys, values = cache.update(k, v, 0)
    codec = cache.config.codec(0, 32)
    np.testing.assert_array_equal(keys.numpy(), codec.decode_keys(codec.encode_keys(k.numpy())))
    np.testing.assert_array_equal(values.numpy(), codec.decode_values(codec.encode_values(v.numpy())))
    store = cache.layers[0].store
    assert store.nbytes() == codec.nbytes("keys", (1, 2, 20, 32)) + codec.nbytes("values", (1, 2, 20, 32))
    assert store.can_attend() and store.encodes_natively()


def dataclass_copy(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)
