"""An async, streaming OpenAI-compatible chat client (long_doc_qa's default mode): per request
start, TTFT (first non-empty content delta), end, output, prompt and cached tokens
(`usage.prompt_tokens_details`), at most K requests in flight; or open loop, each request sent at
its own arrival time whatever is in flight (vLLM's benchmark_serving with a request rate)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Sequence

import aiohttp

from kvbench.job_secrets import bearer
from kvbench.vllm_server import SERVED_NAME


def chat_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """The prompt as the user's message; greedy, exactly `max_tokens` output tokens (EOS ignored),
    usage in the last chunk. Special tokens stay in the text, so that a first token such as an
    end-of-turn (what the instruct model answers to a "hi hi hi" document) is a non-empty delta."""
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "skip_special_tokens": False,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **{k: v for k, v in extra.items() if v is not None},
    }


Hook = Callable[[int], None]  # called with the request's index


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    gate: asyncio.Semaphore,
    index: int,
    on_first_token: Hook | None,
    on_done: Hook | None,
    send_at: float | None = None,
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    if send_at is not None:  # open loop: its arrival time (event-loop clock), not a free slot
        await asyncio.sleep(max(0.0, send_at - loop.time()))
    async with gate:
        # how late it went out after its arrival (a busy event loop, a full gate); TTFT starts here
        late = loop.time() - send_at if send_at is not None else None
        row: dict[str, Any] = {"start": time.time(), "send_lag_s": late, "ttft_s": None, "error": None}
        start = time.perf_counter()
        texts, usage = [], {}
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    row["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                else:
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data:") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[5:])
                        usage = chunk.get("usage") or usage
                        for choice in chunk.get("choices") or []:
                            text = (choice.get("delta") or {}).get("content") or ""
                            if text and row["ttft_s"] is None:
                                row["ttft_s"] = time.perf_counter() - start
                                if on_first_token is not None:
                                    on_first_token(index)
                            texts.append(text)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            row["error"] = f"{type(err).__name__}: {err}"
        row["e2e_s"] = time.perf_counter() - start
        row["end"] = row["start"] + row["e2e_s"]
        row["output"] = "".join(texts)
        row["prompt_tokens"] = usage.get("prompt_tokens")
        row["output_tokens"] = usage.get("completion_tokens")
        row["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        tokens = row["output_tokens"] or 0  # time per output token after the first (ignore_eos: max_tokens of them)
        row["tpot_s"] = (
            (row["e2e_s"] - row["ttft_s"]) / (tokens - 1) if row["ttft_s"] is not None and tokens > 1 else None
        )
        if on_done is not None:
            on_done(index)  # still holding its slot: with one in flight, the next request waits for it
        return row


async def _all(
    base_url: str,
    bodies: Sequence[dict[str, Any]],
    max_inflight: int,
    timeout_s: float,
    api_key: str | None,
    on_first_token: Hook | None,
    on_done: Hook | None,
    arrivals: Sequence[float] | None,
) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(max_inflight)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # no connection limit (aiohttp's default is 100): the gate alone decides what is in flight
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, headers=bearer(api_key), connector=connector) as session:
        url = f"{base_url}/v1/chat/completions"
        t0 = asyncio.get_running_loop().time()
        send_at = [t0 + a for a in arrivals] if arrivals is not None else [None] * len(bodies)
        return list(
            await asyncio.gather(
                *(
                    _one(session, url, body, gate, i, on_first_token, on_done, at)
                    for i, (body, at) in enumerate(zip(bodies, send_at))
                )
            )
        )


def send_all(
    base_url: str,
    bodies: Sequence[dict[str, Any]],
    max_inflight: int,
    timeout_s: float = 900,
    api_key: str | None = None,
    on_first_token: Hook | None = None,
    on_done: Hook | None = None,
    arrivals: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """One row per body, in order; a failed request is a row with its error, never dropped.
    `api_key`: the server's (sent as a bearer token). `on_first_token(i)`, `on_done(i)`: called in
    the client's event loop when request i streams its first token, and when it has ended (before
    its slot is free); the client waits while they run. `arrivals`: open loop, request i sent
    `arrivals[i]` seconds after the round starts (still at most `max_inflight` at once: pass the
    number of bodies for none); its row's `send_lag_s` says how late it went out."""
    if arrivals is not None and len(arrivals) != len(bodies):
        raise ValueError(f"{len(arrivals)} arrival times for {len(bodies)} requests")
    return asyncio.run(_all(base_url, bodies, max_inflight, timeout_s, api_key, on_first_token, on_done, arrivals))
