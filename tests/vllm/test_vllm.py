"""kvqrs' vLLM backend end to end (CPU, offline, SmolLM2-135M converted once into a Hugging Face
folder): each configuration is one ``python -m kvqrs.vllm.offline`` process (vLLM picks its
backend per process). Needs vLLM: run in the environment of scripts/setup-vllm.sh
(``bash scripts/test-vllm.sh``, the last step of scripts/test.sh); skipped where vLLM is not
installed, unless ``KVQRS_REQUIRE_VLLM=1`` (set by scripts/test-vllm.sh), which makes a missing
vLLM or model an error instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kvqrs import KvqrsError
from kvqrs.vllm.layout import SlotLayout
from kvqrs.vllm.settings import config_from_env

REQUIRED = os.environ.get("KVQRS_REQUIRE_VLLM") == "1"
if REQUIRED:
    import vllm  # noqa: F401  (expected here: an ImportError fails the run)
else:
    pytest.importorskip("vllm")

RUN_TIMEOUT_S = 900
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Anthropology is the study of humans and their societies in the past and present. Its main subdivisions are social "
    "anthropology and cultural anthropology, which describe the workings of societies around the world. Archaeology studies "
    "past cultures through the material remains they left behind. In summary,",
]
# A prompt longer than one 128-token block, for the prefix cache.
LONG = " ".join(PROMPTS[3:] * 4) + " To conclude,"
# SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64.
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
# Every attention call recomputed from the float keys and values with the codec's decode path
# (float64 softmax) against the backend's float32 output from the codes (fused kernel, pages
# merged by log-sum-exp): float32 rounding of outputs of size ~1.
CHECK_ATOL = 1e-4
# One engine serves two tests: the check recomputes each attention call beside the backend's,
# leaving the generated tokens and their log-probabilities as they are.
KQV4_CHECKED = {"kvqrs": {"scheme": "kqv", "bits": 4}, "check": True, "logprobs": 5}
# bf16 runs that fit their 4 prompts in this many cache bytes use it (one dense bf16 engine
# serves the greedy and the capacity tests): 91 blocks of 128 tokens.
BF16_BUDGET = 1 << 28


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from kvqrs.evaluation.model import model_dir
    from kvqrs.vllm.model import hf_folder

    try:
        model_dir()
    except KvqrsError as e:
        if REQUIRED:
            raise
        pytest.skip(f"SmolLM2 model not available: {e}")
    return str(hf_folder())


@pytest.fixture(scope="module")
def run(model_folder, tmp_path_factory):
    """``run(**spec)``: one offline vLLM process; results are cached per spec within the module."""
    done: dict[str, dict] = {}
    folder = tmp_path_factory.mktemp("vllm")

    def go(**spec):
        spec = {"model": model_folder, "prompts": PROMPTS, "max_tokens": 24, "dtype": "float32", "kvqrs": None, **spec}
        key = json.dumps(spec, sort_keys=True)
        if key not in done:
            i = len(done)
            (folder / f"{i}.json").write_text(key)
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVQRS_")}
            env["HF_HUB_OFFLINE"] = "1"
            cmd = [sys.executable, "-m", "kvqrs.vllm.offline", str(folder / f"{i}.json"), str(folder / f"{i}.out")]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
            assert res.returncode == 0, res.stderr[-4000:]
            done[key] = json.loads((folder / f"{i}.out").read_text())
        return done[key]

    return go


def tokens(result, round_=0):
    return [o["token_ids"] for o in result["rounds"][round_]["outputs"]]


def test_the_plugin_replaces_the_cpu_backend(run):
    assert run(kvqrs={"scheme": "block", "bits": 8})["backend"] == "kvqrs.vllm.backend.KvqrsAttentionBackend"
    assert run()["backend"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"  # KVQRS_SCHEME unset: vLLM's own


def test_8_bits_greedy_equals_vllms_dense_cache(run):
    # float32 model: vLLM's own cache holds float32 keys and values; 8-bit blocks (rotated,
    # 32 channels a block) give the same 24 greedy tokens on every prompt of the batch
    assert tokens(run(kvqrs={"scheme": "block", "bits": 8})) == tokens(run())


def test_8_bits_greedy_against_bf16_vllm(run):
    # bf16 model and bf16 vLLM cache (the baseline the CPU platform runs). bf16 keeps 8 bits of
    # mantissa, itself an error of the order of an 8-bit code, so the two runs part at near ties,
    # and where depends on the machine's bf16 arithmetic (measured on two machines: prompts 0 and
    # 2 agree on all 24 tokens, prompt 3 on 23, prompt 1 ("Write a haiku ...") on 5, where one run
    # writes "a reflection" and the other "a place"; and prompts 0-2 in full, prompt 3 on 8; on an
    # Intel Xeon with AVX-512 BF16: prompts 0 and 2 in full, prompt 3 on 23, prompt 1 not even on
    # its first token); the exact comparison is the float32 one above.
    ours = tokens(run(kvqrs={"scheme": "block", "bits": 8}, dtype="bfloat16"))
    base = tokens(run(dtype="bfloat16", kv_cache_bytes=BF16_BUDGET))
    assert sum(o[:5] == b[:5] for o, b in zip(ours, base)) >= 3
    assert sum(o == b for o, b in zip(ours, base)) >= 2


def test_a_batch_of_different_lengths_gives_each_prompt_its_tokens_alone(run):
    # the four prompts (6 to 53 tokens) generated together, against one at a time
    # (max_num_seqs=1): batching must not change what a request gets from the coded cache
    batched = run(kvqrs={"scheme": "block", "bits": 8})
    alone = run(kvqrs={"scheme": "block", "bits": 8}, max_num_seqs=1)
    assert len({o["prompt_tokens"] for o in batched["rounds"][0]["outputs"]}) == len(PROMPTS)
    assert tokens(alone) == tokens(batched)


def test_every_attention_call_equals_the_codec_on_the_same_inputs(run):
    # decode steps and prefill of a batch of different lengths, through vLLM's block tables
    res = run(**KQV4_CHECKED)
    assert res["check"]["calls"] >= LAYERS * 24
    assert res["check"]["max_abs_diff"] < CHECK_ATOL


def test_4_bits_agrees_with_quantized_kv_cache(run, model_folder):
    """The same prompts through transformers with kvqrs' QuantizedKVCache (kqv, 4 bits, seed 0).
    Both quantize the same keys and values with the same codec, but the two float32 forwards
    differ by rounding (~1e-6), which a 4-bit code turns into another code wherever a coordinate
    sits on a decision boundary, and that grows over 30 layers: on an Intel Xeon, relative noise
    of 2^-22 on the transformers keys and values alone moves the first-token log-probabilities of
    "The capital of France is" by 0.3 nats, as much as vLLM's forward does, and vLLM on an AMD
    EPYC parted by more than 0.5 nats on "Write a haiku about the sea.". So no per-prompt bound
    holds on every machine; the exact check on the same inputs is
    test_every_attention_call_equals_the_codec_on_the_same_inputs. Here, over the prompts, vLLM
    must sit much closer to the same codec than to the same scheme with other seeds (rotations
    and sketches), the spread of 4-bit coding itself: a wrong seed, width, scale or attention in
    the server makes the two distances alike. Measured on an Intel Xeon: 0.49 nats summed over
    the 4 prompts against 2.5 (the mean over vLLM's top 5 per prompt; seeds 1 to 5)."""
    import torch
    from kvqrs.evaluation import model as model_mod
    from kvqrs.hf import QuantConfig, QuantizedKVCache

    res = run(**KQV4_CHECKED)
    model, tok = model_mod.load("float32")

    def first_logprobs(ids, seed):
        cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, seed=seed), model.config.num_hidden_layers)
        with torch.no_grad():
            return torch.log_softmax(model(ids, past_key_values=cache, use_cache=True).logits[0, -1].float(), -1)

    same, other = 0.0, 0.0
    for prompt, out in zip(PROMPTS, res["rounds"][0]["outputs"]):
        ids = tok(prompt, return_tensors="pt").input_ids
        served = {int(k): v for k, v in out["first_logprobs"].items()}

        same += _mean_gap(first_logprobs(ids, 0), served)
        other += sum(_mean_gap(first_logprobs(ids, seed), served) for seed in range(1, 6)) / 5
    assert same < 0.5 * other, (same, other)


@pytest.fixture(scope="module")
def matched_calibrations(model_folder, tmp_path_factory):
    """Two ``matched`` calibrations with per-token key scales and no sinks (what a paged cache
    serves), fitted on text of this module: ``LONG`` (served) and the three short prompts (the
    control: the same codec fitted elsewhere, the spread of 4-bit coding itself)."""
    from kvqrs.evaluation import model as model_mod
    from kvqrs.hf import calibrate_matched, save_matched

    model, tok = model_mod.load("float32", progress=False)
    folder = tmp_path_factory.mktemp("cal")
    meta = {"group": 256, "sink_tokens": 0, "value_norms": "float", "value_scale": "preserve_norm", "key_scales": "tokens"}
    paths = []
    for name, text in (("served", LONG), ("control", " ".join(PROMPTS[:3]))):
        ids = tok(text, return_tensors="pt").input_ids
        cal = calibrate_matched(model, [ids], 4.0, 256, key_scales="tokens")
        paths.append(str(save_matched(folder / name, cal, meta)))
    return paths


def test_matched_4_bits_served_from_a_calibration_file(run, matched_calibrations):
    """``KVQRS_SCHEME=matched`` with ``KVQRS_CALIBRATION``: every attention call equals the codec
    on the same inputs; the first-token log-probabilities sit much closer to transformers +
    QuantizedKVCache with the same calibration than with a calibration fitted on other text;
    greedy tokens of the bf16 model agree with bf16 vLLM as the 8-bit blocks do."""
    import torch
    from kvqrs.evaluation import model as model_mod
    from kvqrs.hf import QuantizedKVCache
    from kvqrs.vllm.settings import config_from_env

    served, control = matched_calibrations
    spec = {"scheme": "matched", "bits": 4, "calibration": served}
    res = run(kvqrs=spec, check=True, logprobs=5)
    assert res["check"]["calls"] >= LAYERS * 24
    assert res["check"]["max_abs_diff"] < CHECK_ATOL
    model, tok = model_mod.load("float32", progress=False)

    def first_logprobs(ids, path):
        cfg = config_from_env({"KVQRS_SCHEME": "matched", "KVQRS_BITS": "4", "KVQRS_CALIBRATION": path})
        cache = QuantizedKVCache(cfg, model.config.num_hidden_layers)
        with torch.no_grad():
            return torch.log_softmax(model(ids, past_key_values=cache, use_cache=True).logits[0, -1].float(), -1)

    same, other = 0.0, 0.0
    for prompt, out in zip(PROMPTS, res["rounds"][0]["outputs"]):
        ids = tok(prompt, return_tensors="pt").input_ids
        got = {int(k): v for k, v in out["first_logprobs"].items()}
        same += _mean_gap(first_logprobs(ids, served), got)
        other += _mean_gap(first_logprobs(ids, control), got)
    assert same < 0.5 * other, (same, other)
    ours = tokens(run(kvqrs=spec, dtype="bfloat16"))
    base = tokens(run(dtype="bfloat16", kv_cache_bytes=BF16_BUDGET))
    assert sum(o[:5] == b[:5] for o, b in zip(ours, base)) >= 3


def _mean_gap(logprobs, served: dict[int, float]) -> float:
    """Mean absolute difference of ``logprobs`` (a vocabulary's) from the served top-k."""
    return sum(abs(logprobs[k].item() - v) for k, v in served.items()) / len(served)


def test_tokens_per_gib_against_bf16(run):
    budget = BF16_BUDGET
    base, ours = (
        run(dtype="bfloat16", kv_cache_bytes=budget),
        run(kvqrs={"scheme": "kqv", "bits": 4}, dtype="bfloat16", kv_cache_bytes=budget),
    )
    slot = SlotLayout(config_from_env({"KVQRS_SCHEME": "kqv", "KVQRS_BITS": "4"}), 0, HEAD_DIM).slot_bytes
    bf16_per_token, ours_per_token = LAYERS * KV_HEADS * 2 * HEAD_DIM * 2, LAYERS * KV_HEADS * slot
    block = base["block_size"]
    assert base["cache_tokens"] == budget // (bf16_per_token * block) * block
    assert ours["cache_tokens"] == budget // (ours_per_token * block) * block
    assert ours["cache_tokens"] / base["cache_tokens"] > 3.5  # 4-bit kqv: 70 bytes per (token, head) vs 256


def test_the_budget_that_makes_bf16_preempt_holds_the_batch_in_kvqrs_codes(run):
    # the capacity is real: at the bytes of 5 bf16 blocks, 6 requests of 2 blocks each make
    # vLLM's bf16 cache preempt, while 4-bit kqv codes (70 bytes per token and head against
    # 256) give 18 blocks and serve the same batch without preempting
    spec = {"prompts": [PROMPTS[3]] * 6, "max_tokens": 80, "ignore_eos": True, "max_model_len": 512, "dtype": "bfloat16"}
    budget = LAYERS * KV_HEADS * 2 * HEAD_DIM * 2 * 128 * 5
    base = run(**spec, kv_cache_bytes=budget)
    ours = run(**spec, kvqrs={"scheme": "kqv", "bits": 4}, kv_cache_bytes=budget)
    assert base["cache_tokens"] == 5 * 128 and base["preemptions"] > 0
    assert ours["cache_tokens"] >= 12 * 128 and ours["preemptions"] == 0
    assert all(len(t) == 80 for t in tokens(ours))


def test_prefix_cache_reuses_coded_blocks(run):
    res = run(kvqrs={"scheme": "kqv", "bits": 4}, prompts=[LONG, LONG + " Finally,"], prefix_caching=True, repeat=2, max_tokens=8)
    first, second = res["rounds"]
    assert all(o["cached_tokens"] >= res["block_size"] for o in second["outputs"])
    assert tokens(res, 1) == tokens(res, 0)  # read from the cached codes: the same tokens


def test_preemption_recomputes_the_same_tokens(run):
    prompts = [PROMPTS[3]] * 6
    # 53 prompt tokens + 80 generated: 2 blocks of 128 tokens per request
    spec = {"kvqrs": {"scheme": "block", "bits": 8}, "prompts": prompts, "max_tokens": 80, "ignore_eos": True, "max_model_len": 512}
    slot = SlotLayout(config_from_env({"KVQRS_SCHEME": "block", "KVQRS_BITS": "8"}), 0, HEAD_DIM).slot_bytes
    small = run(**spec, kv_cache_bytes=LAYERS * KV_HEADS * slot * 128 * 5)  # 5 blocks for 6 x 2 blocks of demand
    large = run(**spec)
    assert small["cache_tokens"] == 5 * 128
    assert small["preemptions"] > 0
    assert tokens(small) == tokens(large)


def test_unsupported_settings_are_refused_at_start_up(run, model_folder, tmp_path):
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"model": model_folder, "prompts": ["x"], "max_tokens": 1}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQRS_")}
    env.update(KVQRS_SCHEME="kivi", KVQRS_BITS="2", HF_HUB_OFFLINE="1")
    res = subprocess.run(
        [sys.executable, "-m", "kvqrs.vllm.offline", str(spec), str(tmp_path / "o.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=RUN_TIMEOUT_S,
    )
    assert res.returncode != 0
    assert "KIVI keys share per-channel statistics over groups of tokens" in res.stderr
