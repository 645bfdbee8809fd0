"""One harness for every method: prefill + greedy decode through the method's cache, measuring
TTFT, TPOT, throughput and the bytes the cache holds. Failures become rows, never gaps. Decoding is
kvbench.decode's loop (one row here), the one every stage uses."""

from __future__ import annotations

import re
import resource
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from kvbench.decode import Row, eos_ids, run_rows, sync
from kvbench.fidelity import Reference
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


@contextmanager
def attached(cache: MethodCache, model: torch.nn.Module) -> Iterator[MethodCache]:
    """A prefill through a method's cache runs inside this: the method's hooks (query capture) are
    installed on `model` and removed after. Decode steps need none (kvbench.decode)."""
    handles = cache.attach(model)
    try:
        yield cache
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def prefill(model: torch.nn.Module, cache: MethodCache, input_ids: list[int]) -> tuple[torch.Tensor, float]:
    """The prompt through the method's own cache: the next-token logits [V] and the pass's seconds
    (the time to the first token's distribution)."""
    device = next(model.parameters()).device
    with attached(cache, model):
        sync(device)
        start = time.perf_counter()
        out = model(
            input_ids=torch.tensor([input_ids], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        logits = out.logits[0, -1].float()
        sync(device)
    return logits, time.perf_counter() - start


def teacher_forced(
    model: torch.nn.Module, spec: dict[str, Any], ids: list[int], answer: list[int], seed: int = 0
) -> torch.Tensor:
    """Next-token log-probabilities [len(answer), V] through a fresh cache of `spec`: after the
    prompt, then after each token of `answer` fed in turn (the decode loop, explicit positions)."""
    cache = build_cache(spec, ModelShape.of(model.config), seed)
    logits, _ = prefill(model, cache, ids)
    row = Row(
        cache,
        logits,
        len(ids),
        len(answer),
        reference=Reference(list(answer), None, ""),
        branch_free=False,
        keep_logprobs=True,
    )
    run_rows(model, [row])
    return torch.stack(row.logprobs)


def generate(
    model: torch.nn.Module,
    spec: dict[str, Any],
    input_ids: list[int],
    max_new_tokens: int,
    seed: int = 0,
    make_cache: CacheFactory = build_cache,
) -> dict[str, Any]:
    """Prefill through the method's cache, then greedy decoding (the decode loop, one row).
    `make_cache` lets a benchmark instrument the cache."""
    device = next(model.parameters()).device
    shape = ModelShape.of(model.config)
    cache = make_cache(spec, shape, seed)
    logits, ttft = prefill(model, cache, input_ids)
    bytes_prefill = cache.nbytes()  # the byte walk is outside both TTFT and TPOT
    row = Row(cache, logits, len(input_ids), max_new_tokens, eos_ids(model))
    decode_start = time.perf_counter()
    run_rows(model, [row])
    sync(device)
    return measured(row, shape, len(input_ids), ttft, ttft + time.perf_counter() - decode_start, bytes_prefill)


def measured(
    row: Row, shape: ModelShape, context: int, ttft: float, total: float, bytes_prefill: int
) -> dict[str, Any]:
    """The columns every stage reports for one decoded row: TTFT, TPOT (kvbench.decode's one
    definition), end-to-end latency, measured bytes and their ratio to a 16-bit full cache."""
    decode_steps = len(row.tokens) - 1
    full_prefill, full_end = shape.full_bytes(context), shape.full_bytes(context + decode_steps)
    tpot = row.tpot_s
    return {
        "tokens": row.tokens,
        "context_tokens": context,
        "new_tokens": len(row.tokens),
        "ttft_s": ttft,
        "e2e_s": total,
        "tpot_s": tpot,
        "decode_tok_s": 1 / tpot if tpot else None,
        "prefill_tok_s": context / ttft,
        "kv_bytes_prefill": bytes_prefill,
        "kv_bytes_end": row.bytes_end,
        "full16_bytes_prefill": full_prefill,
        "full16_bytes_end": full_end,
        "ratio_prefill": full_prefill / bytes_prefill,
        "ratio_end": full_end / row.bytes_end,
    }
