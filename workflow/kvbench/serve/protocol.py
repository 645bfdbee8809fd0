"""LMCache's `long_doc_qa` protocol: a warm-up round over every document, then a query round that
repeats them (`random` / `tile` / `interleave`, seeded) with a hit:miss ratio, where a miss gets a
unique numeric prefix so no cache holds any of its blocks. An open-loop round sends the same plan
at Poisson arrival times instead of K at a time (vLLM's benchmark_serving's `--request-rate`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

REPEAT_MODES = ("random", "tile", "interleave")


@dataclass(frozen=True)
class Planned:
    round: (
        # warmup | rewarm (a whole prefix round's documents asked again first) | leadin (an interleaved
        # block's predecessors in the plan, asked again first) | query | fault; no TTFT figure
        # reads rewarm or leadin rows
        str
    )
    index: int  # position in the round's plan (a lead-in: the position of the request it asks again)
    doc_id: str
    prompt: str
    miss: bool  # a query-round request with a unique prefix
    # fault round: before, during (killed and restarted), reloaded; the prefix warm-up: before and
    # after Valkey's warm-up
    phase: str | None = None


def parse_ratio(text: str) -> tuple[int, int]:
    """'3:1' -> (3, 1): of every 4 query-round requests, the 4th misses."""
    try:
        hit, miss = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"hit:miss ratio {text!r} is not two integers like '3:1'") from None
    if hit < 0 or miss < 0 or hit + miss == 0:
        raise ValueError(f"hit:miss ratio {text!r} needs non-negative parts, not both zero")
    return hit, miss


def prewarm_prompts(n: int, words: int) -> list[str]:
    """long_doc_qa's pre-warm, sent to every server before any measured round."""
    return [str(i) + "xx" + " ".join(["hi"] * words) for i in range(n)]


def repeats_for_hits(n_docs: int, ratio: str, hits: int) -> int:
    """The smallest repeat count whose query round holds at least `hits` hits."""
    hit, miss = parse_ratio(ratio)
    if hit == 0:
        raise ValueError(f"hit:miss ratio {ratio!r} has no hits")
    count = 1
    while sum(i % (hit + miss) < hit for i in range(count * n_docs)) < hits:
        count += 1
    return count


def warmup_round(prompts: dict[str, str]) -> list[Planned]:
    return [Planned("warmup", i, doc, text, False) for i, (doc, text) in enumerate(prompts.items())]


def repeat(doc_ids: list[str], count: int, mode: str, rng: random.Random) -> list[str]:
    if mode == "tile":
        return doc_ids * count
    if mode == "interleave":
        return [d for d in doc_ids for _ in range(count)]
    if mode == "random":
        out = doc_ids * count
        rng.shuffle(out)
        return out
    raise ValueError(f"repeat mode {mode!r}; known: {', '.join(REPEAT_MODES)}")


def query_round(
    prompts: dict[str, str], count: int, mode: str, ratio: str, seed: int, name: str = "query"
) -> list[Planned]:
    """As long_doc_qa: repeat, then every request at position i with i % (hit+miss) >= hit misses
    (its prompt gets a random integer and a space in front)."""
    hit, miss = parse_ratio(ratio)
    rng = random.Random(seed)
    order = repeat(list(prompts), count, mode, rng)
    planned = []
    for i, doc in enumerate(order):
        is_miss = i % (hit + miss) >= hit
        prompt = miss_prompt(prompts[doc], rng) if is_miss else prompts[doc]
        planned.append(Planned(name, i, doc, prompt, is_miss))
    return planned


def lead_in(previous: Planned, prompts: dict[str, str], seed: int) -> Planned:
    """`previous` asked again first, as round `leadin`: a block of an interleaved level then starts
    behind the request that precedes it in the plan (a miss again a miss, under a prefix of its own,
    so that its stores are queued as they were), not behind another cell's requests and an empty
    store queue."""
    prompt = prompts[previous.doc_id]
    if previous.miss:
        prompt = miss_prompt(prompt, random.Random(seed))
    return Planned("leadin", previous.index, previous.doc_id, prompt, previous.miss)


def miss_prompt(text: str, rng: random.Random) -> str:
    """long_doc_qa's miss: a random integer and a space in front, so no cache holds any block."""
    return f"{rng.randint(-10_000_000, 10_000_000)} {text}"


def poisson_arrivals(n: int, rate_rps: float, seed: int) -> list[float]:
    """Send times (seconds after the round starts) of n requests at `rate_rps` per second: the gaps
    of a Poisson process (exponential, seeded), scaled so the n requests span exactly
    (n - 1) / rate_rps, as vLLM's benchmark_serving rescales its schedule. The offered rate is then
    the configured one, not a draw around it (unscaled, gpu.yaml's seeded rounds of 32 requests
    would offer 0.56, 0.86 and 1.5 requests/s for its 0.5, 1 and 2)."""
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be positive, got {rate_rps}")
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate_rps))
    if n > 1:
        scale = (n - 1) / rate_rps / times[-1]
        times = [t * scale for t in times]
    return times[:n]
