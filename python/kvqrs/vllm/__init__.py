"""kvqrs as a vLLM KV-cache backend (docs/vllm.md).

vLLM loads :func:`register` through the ``vllm.general_plugins`` entry point in every process
it starts. With ``KVQRS_SCHEME`` set (:mod:`.settings`), kvqrs' attention backend
(:mod:`.backend`) takes the place of vLLM's CPU attention: the paged KV cache holds every KV
head's tokens as kvqrs codes of a fixed byte size (:mod:`.layout`) and attention reads them
through the block table in Rust. Without it, vLLM runs unchanged.

Example::

    import os
    from kvqrs.vllm import environment
    os.environ.update(environment("kqv", 4))      # before vLLM starts its engine
    from vllm import LLM
    llm = LLM("path/to/hf-model", enforce_eager=True)
"""

from __future__ import annotations

from ..schemes.registry import names
from .layout import SlotLayout, refuse_reason
from .settings import config_from_env, enabled, environment

BACKEND = "kvqrs.vllm.backend.KvqrsAttentionBackend"

__all__ = ["BACKEND", "PAGED_SCHEMES", "SlotLayout", "config_from_env", "enabled", "environment", "refuse_reason", "register"]


PAGED_SCHEMES: tuple[str, ...]  # the registry's, derived from it when read


def __getattr__(name: str) -> tuple[str, ...]:
    if name == "PAGED_SCHEMES":
        return names(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """vLLM general plugin: when ``KVQRS_SCHEME`` is set, check the ``KVQRS_*`` settings (a clear
    KvqrsError at start-up for ones a paged cache cannot hold) and register kvqrs' backend for
    the CPU platform's attention (``AttentionBackendEnum.CPU_ATTN``); otherwise do nothing."""
    if not enabled():
        return
    config_from_env()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
