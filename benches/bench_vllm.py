"""vLLM offline with kvqrs' paged KV-cache backend against vLLM's own bf16 cache (CPU):

- throughput: greedy generation of a batch of concurrent prompts, output tokens per second;
- capacity: tokens the KV cache holds at a fixed cache budget (the most concurrent context a
  server gets from it), and tokens per GiB.

Each configuration runs in its own process (``python -m kvqrs.vllm.offline``), one after the
other, so the ratios are measured side by side on this machine. Needs the environment of
scripts/setup-vllm.sh::

    .venv-vllm/bin/python benches/bench_vllm.py [--prompts 8] [--max-tokens 64] [--budget-mib 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

CONFIGS = [
    ("bf16 (vLLM CPU_ATTN)", None),
    ("kvqrs block 8", {"scheme": "block", "bits": 8}),
    ("kvqrs kqv 4", {"scheme": "kqv", "bits": 4}),
    ("kvqrs qkqv 3", {"scheme": "qkqv", "bits": 3}),
]
TEXT = (
    "Anthropology is the study of humans and their societies in the past and present. Its main subdivisions are social "
    "anthropology and cultural anthropology. Archaeology studies past cultures through the material remains they left behind. "
)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    return f"machine: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def run(spec: dict, folder: str, name: str) -> dict:
    path, out = os.path.join(folder, f"{name}.json"), os.path.join(folder, f"{name}.out")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQRS_")}
    env["HF_HUB_OFFLINE"] = "1"
    subprocess.run([sys.executable, "-m", "kvqrs.vllm.offline", path, out], check=True, env=env, capture_output=True)
    with open(out) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="concurrent prompts")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--budget-mib", type=int, default=256, help="KV cache budget of the capacity table (MiB)")
    args = ap.parse_args()
    from kvqrs.vllm.model import hf_folder

    model = str(hf_folder())
    prompts = [TEXT * (1 + i % 3) + f"Question {i}: what is studied?" for i in range(args.prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for i, (label, kv) in enumerate(CONFIGS):
            spec = {
                "model": model,
                "prompts": prompts,
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "dtype": "bfloat16",
                "kvqrs": kv,
                "kv_cache_bytes": args.budget_mib << 20,
                "max_num_seqs": args.prompts,
            }
            res = run(spec, folder, str(i))
            rnd = res["rounds"][0]
            generated = sum(len(o["token_ids"]) for o in rnd["outputs"])
            prompt_tokens = sum(o["prompt_tokens"] for o in rnd["outputs"])
            rows.append((label, generated / rnd["seconds"], rnd["seconds"], prompt_tokens, res["cache_tokens"], res["cache_bytes"]))
    base_tps, base_cap = rows[0][1], rows[0][4]
    print(machine())
    print(
        f"\n{args.prompts} concurrent prompts ({rows[0][3]} prompt tokens), {args.max_tokens} greedy tokens each, bf16 model, enforce_eager\n"
    )
    print("| KV cache | output tokens/s | vs bf16 | wall s |")
    print("| --- | ---: | ---: | ---: |")
    for label, tps, sec, *_ in rows:
        print(f"| {label} | {tps:.1f} | {tps / base_tps:.2f}x | {sec:.1f} |")
    print(f"\nKV cache budget {args.budget_mib} MiB (30 layers x 3 KV heads x head_dim 64)\n")
    print("| KV cache | tokens held | tokens per GiB | vs bf16 | contexts of 2048 tokens |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, *_, cap, budget in rows:
        print(f"| {label} | {cap} | {cap * (1 << 30) / budget:.0f} | {cap / base_cap:.2f}x | {cap // 2048} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
