"""The server's own view of a round: /metrics scraped before and after, kept as deltas."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# Counters (and histogram sums/counts) whose deltas describe a round.
TRACKED = {
    "vllm:time_to_first_token_seconds_sum": "server_ttft_sum_s",
    "vllm:time_to_first_token_seconds_count": "server_ttft_count",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:external_prefix_cache_queries_total": "external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits_total": "external_prefix_cache_hits",
    "vllm:prompt_tokens_by_source_total": "prompt_tokens",
}


def parse(text: str) -> dict[str, float]:
    """Tracked samples summed over engines; prompt_tokens_by_source split by its `source` label."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = TRACKED.get(sample.name)
            if name is None:
                continue
            if name == "prompt_tokens":
                name = f"prompt_tokens_{sample.labels.get('source', 'unknown')}"
            out[name] = out.get(name, 0.0) + sample.value
    return out


def scrape(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as resp:
        return parse(resp.read().decode())


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in sorted(set(before) | set(after))}
    count = out.get("server_ttft_count", 0.0)
    out["server_ttft_mean_s"] = out.get("server_ttft_sum_s", 0.0) / count if count else float("nan")
    return out
