"""The ``KVQRS_*`` environment that selects kvqrs' vLLM backend and its quantization settings.

vLLM builds its engine in other processes, which inherit the environment: set these before
``vllm.LLM(...)`` (or ``vllm serve``) starts, e.g. with ``os.environ.update(environment("kqv", 4))``.

========================  ======================================================  ===========
variable                  meaning                                                 default
========================  ======================================================  ===========
``KVQRS_SCHEME``          key scheme (``kv``, ``kqv``, ``qkqv``, ``block``,        unset: vLLM's
                          ``matched``); setting it turns the backend on            own backend
``KVQRS_CALIBRATION``     ``matched``: the calibration file (``kvqrs calibrate     unset
                          --key-scales tokens --sink-tokens 0``, best with
                          ``--uniform-layers``: one slot size); its recorded
                          value norms, value scale, sinks and group apply
``KVQRS_BITS``            key bits n (1..8; ``qkqv`` and ``kqv`` values: >= 2)     4
``KVQRS_VALUE_SCHEME``    value scheme                                            the key scheme
``KVQRS_VALUE_BITS``      value bits                                              the key bits
``KVQRS_SEED``            seed of every rotation and sketch                        0
``KVQRS_GROUP``           coordinates per group of the ``block`` scheme            32
========================  ======================================================  ===========
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Mapping

from .._arrays import KvqrsError
from ..hf.config import QuantConfig
from .layout import refuse_reason

VARIABLES = ("KVQRS_SCHEME", "KVQRS_BITS", "KVQRS_VALUE_SCHEME", "KVQRS_VALUE_BITS", "KVQRS_SEED", "KVQRS_GROUP", "KVQRS_CALIBRATION")


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVQRS_SCHEME`` asks for the kvqrs backend."""
    return bool((os.environ if env is None else env).get("KVQRS_SCHEME", "").strip())


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    # int() also reads "4_0" as 40 and non-ASCII digits as numbers: only ASCII digits count.
    if not re.fullmatch(r"-?[0-9]+", raw):
        raise KvqrsError(f"{name}: expected an integer of ASCII digits, got {raw!r}")
    return int(raw)


def config_from_env(env: Mapping[str, str] | None = None) -> QuantConfig:
    """The :class:`~kvqrs.hf.QuantConfig` the ``KVQRS_*`` variables describe.

    Raises:
        KvqrsError: ``KVQRS_SCHEME`` unset, a value that is not an integer, a calibration file
            that cannot be read or is given to a scheme without one, or settings a paged cache
            cannot hold (naming the scheme and why).
    """
    env = os.environ if env is None else env
    scheme = env.get("KVQRS_SCHEME", "").strip()
    if not scheme:
        raise KvqrsError("KVQRS_SCHEME: not set; set it to one of kv, kqv, qkqv, block, matched to use kvqrs' vLLM backend")
    bits = _int(env, "KVQRS_BITS", 4)
    calibrated = _calibrated(env, scheme)
    try:
        config = QuantConfig(
            scheme,
            bits,
            env.get("KVQRS_VALUE_SCHEME", "").strip() or scheme,
            _int(env, "KVQRS_VALUE_BITS", bits),
            seed=_int(env, "KVQRS_SEED", 0),
            **calibrated,
        )
    except KvqrsError as e:
        raise KvqrsError(f"KVQRS_*: {e}") from None
    reason = refuse_reason(config)
    if reason is not None:
        raise KvqrsError(f"KVQRS_*: {reason}")
    return config


def _calibrated(env: Mapping[str, str], scheme: str) -> dict:
    """The ``KVQRS_CALIBRATION`` file's calibration, whose recorded value norms, value scale,
    sinks, sink dtype and group the config takes (:class:`~kvqrs.hf.QuantConfig` applies what
    a file read by ``load_matched`` records), or ``KVQRS_GROUP`` alone."""
    path = env.get("KVQRS_CALIBRATION", "").strip()
    if not path:
        return {"group": _int(env, "KVQRS_GROUP", 32)}
    if scheme != "matched":
        raise KvqrsError(f"KVQRS_CALIBRATION: a calibration file serves KVQRS_SCHEME=matched, not {scheme!r}")
    from ..hf.calibration import load_matched

    try:
        return {"calibration": load_matched(path)}
    except (KvqrsError, OSError) as e:  # the file named by the variable: say which variable
        raise KvqrsError(f"KVQRS_CALIBRATION={path!r}: {e}") from e


def environment(
    scheme: str,
    bits: int,
    value_scheme: str | None = None,
    value_bits: int | None = None,
    seed: int = 0,
    group: int = 32,
    calibration: str | os.PathLike | None = None,
) -> dict[str, str]:
    """The ``KVQRS_*`` variables for these settings (checked at once), to put in ``os.environ``
    before vLLM starts; ``calibration``: the ``matched`` scheme's calibration file."""
    for name, value in (("scheme", scheme), ("value_scheme", value_scheme)):
        if not (isinstance(value, str) or (value is None and name == "value_scheme")):
            raise KvqrsError(f"{name}: expected a scheme name (a string), got {value!r}")
    for name, value in (("bits", bits), ("value_bits", value_bits), ("seed", seed), ("group", group)):
        if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) or (value is None and name == "value_bits")):
            raise KvqrsError(f"{name}: expected an integer, got {value!r}")
    env = {
        "KVQRS_SCHEME": scheme,
        "KVQRS_BITS": str(bits),
        "KVQRS_VALUE_SCHEME": value_scheme or scheme,
        "KVQRS_VALUE_BITS": str(bits if value_bits is None else value_bits),
        "KVQRS_SEED": str(seed),
        "KVQRS_GROUP": str(group),
    }
    if calibration is not None:
        env["KVQRS_CALIBRATION"] = os.fspath(calibration)
    config_from_env(env)
    return env
