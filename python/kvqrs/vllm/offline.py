"""One offline vLLM run, with kvqrs' backend or vLLM's own: greedy generation of a batch of
prompts, and what the cache held. The vLLM tests and benchmark run each configuration in its
own process (vLLM's backend choice is per process) through the command line::

    python -m kvqrs.vllm.offline SPEC.json OUT.json

SPEC keys: ``model`` (a Hugging Face folder), ``prompts`` (strings or token-id lists),
``max_tokens``, ``dtype`` (default bfloat16), ``kvqrs`` (``{"scheme", "bits", ...}`` of
:func:`kvqrs.vllm.environment`, or null for vLLM's own bf16 cache), ``kv_cache_bytes``,
``max_num_seqs``, ``max_model_len``, ``prefix_caching`` (bool), ``repeat`` (generate the batch
this many times; later rounds hit the prefix cache), ``ignore_eos``, ``logprobs`` (top-k of the
first generated token), ``check`` (with kvqrs: recompute every attention call from the float
keys and values that reached the cache, with the codec's decode path, and record the largest
difference: :func:`_checked`).
OUT: ``rounds`` (per round: ``seconds``, ``preemptions`` (the round's), ``peak_running`` (the
most requests in the scheduler's running list after any step of the round was scheduled, those
still in prefill included: the batch the cache let vLLM run; null where the engine core is not
in this process) and per prompt ``token_ids``, ``text``, ``cached_tokens``), ``cache_tokens``
(tokens the KV cache holds), ``cache_bytes``, ``block_size``, ``preemptions`` (all rounds),
``backend``, ``kvqrs_path`` (the folder kvqrs was imported from).
"""

from __future__ import annotations

import json
import os
import sys
import time


def run(spec: dict) -> dict:
    """Run ``spec`` in this process (set no ``KVQRS_*`` variable beforehand: ``spec["kvqrs"]``
    chooses). Returns the OUT dict of the module docstring."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    if spec.get("kvqrs"):
        from .settings import environment

        os.environ.update(environment(**spec["kvqrs"]))
    from vllm import LLM, SamplingParams

    worst = _checked() if spec.get("check") else None
    llm = LLM(
        spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 1024),
        max_num_seqs=spec.get("max_num_seqs", 16),
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 1 << 28),
        enable_prefix_caching=spec.get("prefix_caching", False),
        disable_log_stats=False,
        seed=0,
    )
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in spec["prompts"]]
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=spec.get("ignore_eos", False), logprobs=spec.get("logprobs")
    )
    rounds = []
    peak = _watch_running(llm)
    for _ in range(spec.get("repeat", 1)):
        before = _preemptions(llm)
        if peak is not None:
            peak["running"] = 0
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rounds.append(
            {
                "seconds": seconds,
                "preemptions": _preemptions(llm) - before,
                "peak_running": None if peak is None else peak["running"],
                "outputs": [
                    {
                        "prompt_tokens": len(o.prompt_token_ids),
                        "token_ids": list(o.outputs[0].token_ids),
                        "text": o.outputs[0].text,
                        "cached_tokens": o.num_cached_tokens or 0,
                        "first_logprobs": {str(k): v.logprob for k, v in o.outputs[0].logprobs[0].items()}
                        if spec.get("logprobs")
                        else None,
                    }
                    for o in outs
                ],
            }
        )
    cfg = llm.llm_engine.vllm_config
    cache = cfg.cache_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return {
        "rounds": rounds,
        "cache_tokens": cache.num_gpu_blocks * cache.block_size,
        "cache_bytes": spec.get("kv_cache_bytes", 1 << 28),
        "block_size": cache.block_size,
        "preemptions": _preemptions(llm),
        "backend": AttentionBackendEnum.CPU_ATTN.get_path(),
        "check": None if worst is None else {"calls": worst["calls"], "max_abs_diff": worst["max"]},
        "kvqrs_path": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    }


def _checked() -> dict:
    """Wrap kvqrs' backend so that every forward is recomputed independently: the float keys and
    values written to each (layer, slot) are kept aside; each query token's attention is then
    ``softmax(q . k_hat / sqrt(d)) @ v_hat`` over its sequence's first ``length`` tokens (found
    through the block table), ``k_hat``, ``v_hat`` the codec's decodes of those floats (the
    path of :class:`~kvqrs.hf.QuantizedKVCache`). Returns the running ``{"calls", "max"}``."""
    import numpy as np

    from . import backend

    worst = {"calls": 0, "max": 0.0}
    shadow: dict = {}
    forward = backend.KvqrsAttentionImpl.forward

    def attend(self, layer, query, key, value, kv_cache, md, output=None, *args, **kwargs):
        out = forward(self, layer, query, key, value, kv_cache, md, output, *args, **kwargs)
        if md is None or md.num_actual_tokens == 0:
            return out
        n = md.num_actual_tokens
        store = shadow.setdefault(layer.layer_name, {})
        new = (t[:n].float().numpy().reshape(n, self.num_kv_heads, self.head_size) for t in (key, value))
        for s, k, v in zip(md.slot_mapping.tolist(), *new):  # the step's writes, as the forward made them
            if s >= 0:
                store[s] = (k.copy(), v.copy())
        codec = self._layout(layer, kv_cache.shape[-1]).codec
        block = kv_cache.shape[2]
        got = out[: md.num_actual_tokens].float().numpy().reshape(md.num_actual_tokens, self.num_heads, self.head_size)
        q = query[: md.num_actual_tokens].float().numpy().reshape(got.shape)
        g = self.num_heads // self.num_kv_heads
        for t, (r, n) in enumerate(zip(md.seq, md.lengths)):
            slots = [int(md.block_table[r, j // block]) * block + j % block for j in range(n)]
            k = np.stack([store[s][0] for s in slots], axis=1)  # (kv_heads, n, d)
            v = np.stack([store[s][1] for s in slots], axis=1)
            kh = np.repeat(codec.decode_keys(codec.encode_keys(k)), g, axis=0).astype(np.float64)
            vh = np.repeat(codec.decode_values(codec.encode_values(v)), g, axis=0).astype(np.float64)
            logits = np.einsum("hd,hnd->hn", q[t].astype(np.float64), kh) * self.scale
            p = np.exp(logits - logits.max(-1, keepdims=True))
            want = np.einsum("hn,hnd->hd", p / p.sum(-1, keepdims=True), vh)
            worst["max"] = max(worst["max"], float(np.abs(got[t] - want).max()))
        worst["calls"] += 1
        return out

    backend.KvqrsAttentionImpl.forward = attend
    return worst


def _watch_running(llm) -> dict | None:
    """Record, after each ``schedule()`` of the engine core's scheduler, the number of requests
    in its running list (a wrapper on that one instance: no cost beyond a ``len``). Returns the
    ``{"running": peak}`` it updates, or None where the engine core runs in another process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) or the attributes are not there."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None or not hasattr(scheduler, "running"):
        return None
    peak = {"running": 0}
    schedule = scheduler.schedule

    def watched(*args, **kwargs):
        out = schedule(*args, **kwargs)
        peak["running"] = max(peak["running"], len(scheduler.running))
        return out

    scheduler.schedule = watched
    return peak


def _preemptions(llm) -> int:
    """The engine's preemption counter (0 when it reports none)."""
    total = 0
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            total += int(getattr(m, "value", 0) or 0)
    return total


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvqrs.vllm.offline SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(args[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
