"""One harness for every method: prefill + greedy decode through the method's cache, measuring
TTFT, TPOT, throughput and the bytes the cache holds. Failures become rows, never gaps."""

from __future__ import annotations

import copy
import gc
import re
import resource
import statistics
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from kvbench.methods.base import MethodCache, ModelShape
from kvbench.methods.catalog import build_cache

CacheFactory = Callable[[dict[str, Any], ModelShape, int], MethodCache]
TIMINGS = ("ttft_s", "tpot_s", "decode_tok_s", "prefill_tok_s", "e2e_s")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _proc_status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) / 1024 if match else None


def reset_peak_memory(device: torch.device) -> float | None:
    """Restart the peak-memory count and return the memory in use now (MB): CUDA allocations on
    GPU; on Linux CPUs the resident set (writing 5 to /proc/self/clear_refs resets VmHWM). None
    where the peak cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status_mb("VmRSS")


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory on GPU; peak RSS on CPU (since the last reset where Linux allows it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _proc_status_mb("VmHWM") or peak_rss_mb()


def median_and_std(values: list[float]) -> tuple[float, float]:
    """The true median (the mean of the middle two for an even count) and the sample std (0 for one)."""
    return statistics.median(values), statistics.stdev(values) if len(values) > 1 else 0.0


def context_bucket(tokens: int, max_context: int) -> str:
    """0-4k, 4-8k, 8k+ on an 8K+ model scaled to its context: halves of it, and beyond."""
    edges = [max_context // 2, max_context] if max_context < 16384 else [4096, 8192]
    if tokens < edges[0]:
        return f"0-{edges[0] // 1024}k"
    if tokens < edges[1]:
        return f"{edges[0] // 1024}-{edges[1] // 1024}k"
    return f"{edges[1] // 1024}k+"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def attached(cache: MethodCache, model: torch.nn.Module) -> Iterator[MethodCache]:
    """Every forward pass through a method's cache runs inside this: the method's hooks (query
    capture, its own attention) are installed on `model` and removed after."""
    handles = cache.attach(model)
    try:
        yield cache
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def teacher_forced(model: torch.nn.Module, spec: dict[str, Any], ids: list[int], answer: list[int],
                   seed: int = 0) -> torch.Tensor:
    """Next-token log-probabilities [len(answer), V] through a fresh cache of `spec`: after the
    prompt, then after each token of `answer` fed in turn (explicit positions, as `generate`)."""
    cache = build_cache(spec, ModelShape.of(model.config), seed)
    out = []
    with attached(cache, model):
        logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        out.append(logits[0, -1].log_softmax(-1))
        for i, token in enumerate(answer[:-1]):
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[len(ids) + i]])).logits
            out.append(logits[0, -1].log_softmax(-1))
    return torch.stack(out)


@torch.inference_mode()
def generate(
    model: torch.nn.Module, spec: dict[str, Any], input_ids: list[int], max_new_tokens: int, seed: int = 0,
    make_cache: CacheFactory = build_cache,
) -> dict[str, Any]:
    """Prefill, then greedy decode with explicit positions (evicting caches are shorter than the
    sequence, so positions cannot come from the cache length). `make_cache` lets a benchmark
    instrument the cache."""
    device = next(model.parameters()).device
    shape = ModelShape.of(model.config)
    cache = make_cache(spec, shape, seed)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    with attached(cache, model):
        ids = torch.tensor([input_ids], device=device)
        _sync(device)
        start = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        _sync(device)
        ttft = time.perf_counter() - start
        bytes_prefill = cache.nbytes()
        decode_start = time.perf_counter()  # the byte walk is outside both TTFT and TPOT
        tokens, position = [token], len(input_ids)
        while len(tokens) < max_new_tokens and token not in eos_ids:
            out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[position]], device=device))
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            position += 1
        _sync(device)
        end = time.perf_counter()
        total, decode = end - start, end - decode_start
    decode_steps = len(tokens) - 1
    full_prefill = shape.full_bytes(len(input_ids))
    full_end = shape.full_bytes(len(input_ids) + decode_steps)
    bytes_end = cache.nbytes()
    return {
        "tokens": tokens, "context_tokens": len(input_ids), "new_tokens": len(tokens),
        "ttft_s": ttft, "e2e_s": total, "tpot_s": decode / decode_steps if decode_steps else None,
        "decode_tok_s": decode_steps / decode if decode_steps else None,
        "prefill_tok_s": len(input_ids) / ttft,
        "kv_bytes_prefill": bytes_prefill, "kv_bytes_end": bytes_end,
        "full16_bytes_prefill": full_prefill, "full16_bytes_end": full_end,
        "ratio_prefill": full_prefill / bytes_prefill, "ratio_end": full_end / bytes_end,
    }


def run_row(
    model: torch.nn.Module, method: str, spec: dict[str, Any], input_ids: list[int], max_new_tokens: int,
    repeats: int, seed: int, max_context: int, make_cache: CacheFactory = build_cache,
) -> dict[str, Any]:
    """Measured repeats of one method on one prompt (after one warm-up), or the error it raised."""
    device = next(model.parameters()).device
    row: dict[str, Any] = {"method": method, "kind": spec["kind"], "params": str(sorted(spec.items())),
                           "context_tokens": len(input_ids),
                           "bucket": context_bucket(len(input_ids), max_context), "error": None}
    try:
        # Warm-up (excluded), long enough to pass the quantizers' residual windows.
        generate(model, spec, input_ids[:256], 2, seed, make_cache)
        gc.collect()
        baseline = reset_peak_memory(device)
        runs = [generate(model, spec, input_ids, max_new_tokens, seed, make_cache) for _ in range(repeats)]
    except Exception as err:  # an OOM or a method bug on this prompt: a row with the error
        traceback.print_exc()
        row["error"] = f"{type(err).__name__}: {err}"
        gc.collect()
        return row
    first = runs[0]
    row |= {k: first[k] for k in ("new_tokens", "kv_bytes_prefill", "kv_bytes_end", "full16_bytes_prefill",
                                  "full16_bytes_end", "ratio_prefill", "ratio_end")}
    row["output_ids"] = first["tokens"]
    for key in TIMINGS:
        values = [r[key] for r in runs if r[key] is not None]
        # None e.g. for TPOT when the first token was the end of sequence
        row[key], row[f"{key}_std"] = median_and_std(values) if values else (None, None)
    row["repeats"] = repeats
    row["peak_memory_mb"] = peak_memory_mb(device)
    row["memory_increase_mb"] = row["peak_memory_mb"] - baseline if baseline is not None else None
    return row


def decode_step(model: torch.nn.Module, cache: MethodCache, token: int, position: int) -> torch.Tensor:
    """One decode forward through `cache`: feed `token` at `position`, return the next-token logits [V]."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True,
                position_ids=torch.tensor([[position]], device=device))
    return out.logits[0, -1]


@torch.inference_mode()
def generate_scored(
    model: torch.nn.Module, spec: dict[str, Any], input_ids: list[int], max_new_tokens: int,
    reference: list[int] | None = None, stop: Callable[[list[int]], bool] | None = None, seed: int = 0,
    make_cache: CacheFactory = build_cache,
) -> dict[str, Any]:
    """Greedy generation through the method's cache that also returns next-token logits.

    Without `reference`: `logits[i]` is the distribution behind `tokens[i]` (what the reference run
    stores). With `reference` (the full cache's greedy tokens for the same prompt): `logits[i]` is
    the method's distribution teacher-forced on `reference[:i]`, and `tokens` is the method's own
    greedy output. One prefill serves both: up to `first_divergence` (the first position where the
    method's greedy token differs from the reference) the two feed the same tokens; there the cache
    is copied and the copy continues on the method's own tokens. Generation ends at an
    end-of-sequence token, at `max_new_tokens`, or when `stop(tokens)` says so (stop strings).
    """
    device = next(model.parameters()).device
    shape = ModelShape.of(model.config)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

    def done(tokens: list[int]) -> bool:
        return tokens[-1] in eos_ids or len(tokens) >= max_new_tokens or (stop is not None and stop(tokens))

    seconds: list[float] = []  # every decode step, teacher-forced or free

    def step(cache: MethodCache, token: int, position: int) -> torch.Tensor:
        _sync(device)
        start = time.perf_counter()
        logits = decode_step(model, cache, token, position)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        return logits

    cache = make_cache(spec, shape, seed)
    handles = cache.attach(model)
    divergence: int | None = None
    try:
        _sync(device)
        start = time.perf_counter()
        out = model(input_ids=torch.tensor([input_ids], device=device), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        logits = [out.logits[0, -1]]
        first = int(logits[0].argmax())
        _sync(device)
        ttft = time.perf_counter() - start
        bytes_prefill = cache.nbytes()
        position = len(input_ids)
        branch: MethodCache | None = None
        if reference is None:
            tokens = [first]
            while not done(tokens):
                logits.append(step(cache, tokens[-1], position + len(tokens) - 1))
                tokens.append(int(logits[-1].argmax()))
            shared, bytes_end = len(seconds), cache.nbytes()
        else:
            for i, token in enumerate(reference):
                if divergence is None and int(logits[i].argmax()) != token:
                    divergence, tokens = i, reference[:i] + [int(logits[i].argmax())]
                    shared, bytes_end = len(seconds), cache.nbytes()
                    if not done(tokens):  # the copy goes on with the method's own tokens
                        branch = copy.deepcopy(cache)
                if i + 1 < len(reference):
                    logits.append(step(cache, token, position + i))
            if divergence is None:
                tokens, shared, bytes_end = list(reference), len(seconds), cache.nbytes()
        free_seconds = sum(seconds[:shared])
        if branch is not None:
            for handle in handles:
                handle.remove()
            handles = branch.attach(model)
            forced = len(seconds)
            while not done(tokens):
                tokens.append(int(step(branch, tokens[-1], position + len(tokens) - 1).argmax()))
            free_seconds += sum(seconds[forced:])
            bytes_end = branch.nbytes()
    finally:
        for handle in handles:
            handle.remove()
    decode_steps = len(tokens) - 1
    full_prefill = shape.full_bytes(len(input_ids))
    full_end = shape.full_bytes(len(input_ids) + decode_steps)
    return {
        "tokens": tokens, "logits": torch.stack(logits).float(), "first_divergence": divergence,
        "context_tokens": len(input_ids), "new_tokens": len(tokens),
        "ttft_s": ttft, "tpot_s": free_seconds / decode_steps if decode_steps else None,
        "e2e_s": ttft + free_seconds, "forward_s": ttft + sum(seconds),
        "kv_bytes_prefill": bytes_prefill, "kv_bytes_end": bytes_end,
        "full16_bytes_prefill": full_prefill, "full16_bytes_end": full_end,
        "ratio_prefill": full_prefill / bytes_prefill, "ratio_end": full_end / bytes_end,
    }
