"""Wrong inputs on the newer surfaces (calibration files and presets, saved caches, the command
line's arguments, the vLLM environment) raise :class:`kvqrs.KvqrsError` naming the argument,
what was expected and what came, before any work starts, never a traceback of another type or
a wrong result."""

from __future__ import annotations

import pytest
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
