"""Shared parts of the eviction methods (SnapKV, H2O, CaM): query capture and attention scores.

The cache update does not see queries, so a forward pre-hook on each attention module recomputes
this step's post-RoPE queries (q_proj + RoPE, as the module itself does) and hands them to the
layer, which releases them once used. Kept keys and values are stored at a 16-bit storage dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.methods.base import MethodCache, MethodLayer


class ScoredLayer(MethodLayer):
    """A layer that receives this step's queries from the hook before `update` runs.

    `prefill_queries`: how many of the prompt's last queries the layer needs (None: all of them,
    0: none); the hook projects only those, so scoring adds little to the prefill.
    `decode_queries`: whether decode steps need their query too (H2O keeps scoring).
    """

    prefill_queries: int | None = 0
    decode_queries: bool = False

    def __init__(self, storage: torch.dtype, q_heads: int) -> None:
        super().__init__()
        self.storage, self.q_heads = storage, q_heads
        self.queries: torch.Tensor | None = None

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys.to(self.storage), values.to(self.storage)

    def take_queries(self) -> torch.Tensor | None:
        """This step's queries, released from the layer (they are not part of the cache)."""
        queries, self.queries = self.queries, None
        return queries


class EvictionCache(MethodCache):
    def attach(self, model: torch.nn.Module) -> list[Any]:
        """A query hook on each attention module whose layer still needs queries: every layer before
        its prefill, only H2O-like layers (`decode_queries`) after it."""
        handles: dict[int, Any] = {}
        for index, block in enumerate(model.model.layers):
            if getattr(block.self_attn, "q_norm", None) is not None:  # Qwen3-style: normed before RoPE
                raise NotImplementedError(
                    f"{type(block.self_attn).__name__} normalizes its queries (q_norm), "
                    "which the query hook does not reproduce: eviction methods need q_proj + RoPE only"
                )
            if self.wants_queries(index):
                handles[index] = block.self_attn.register_forward_pre_hook(
                    self.query_hook(index, handles), with_kwargs=True
                )
        return list(handles.values())

    def wants_queries(self, index: int) -> bool:
        layer = self.layers[index]
        return not layer.is_initialized or layer.decode_queries

    def query_hook(self, index: int, handles: dict[int, Any]):
        """The forward pre-hook of attention module `index`: hands layer `index` its queries, and
        removes itself once the layer needs none (a hook on a module slows every call through it)."""

        def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            layer = self.layers[index]
            if not self.wants_queries(index):
                handles[index].remove()  # safe inside the call: torch iterates over a copy of the hooks
                return
            window = None if layer.is_initialized else layer.prefill_queries
            if window == 0:
                return
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            layer.queries = project_queries(module, hidden, *kwargs["position_embeddings"], window)

        return capture

    def attend(
        self,
        index: int,
        original,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        **kwargs: Any,
    ):
        """A decode step hands the layer this step's post-RoPE queries, as the hook does (the same
        projection of the same hidden states)."""
        layer = self.layers[index]
        if layer.is_initialized and layer.decode_queries:
            layer.queries = query
        return super().attend(index, original, module, query, key, value, mask, **kwargs)

    def before_fork(self, model: torch.nn.Module, index: int, prefill: Any, upto: int) -> None:
        """The queries the hook would capture in a prefill of the first `upto` positions, projected
        from the same captured hidden states."""
        window = self.layers[index].prefill_queries
        if window != 0:
            cos, sin = prefill.cos[:, :upto], prefill.sin[:, :upto]
            self.layers[index].queries = project_queries(
                model.model.layers[index].self_attn, prefill.hidden[index][:, :upto], cos, sin, window
            )


def project_queries(
    module: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Post-RoPE queries [1, Hq, W, d] of the last `window` positions (None: all) of `hidden`, as the
    attention module computes them (q_proj, then RoPE)."""
    if window is not None:
        hidden, cos, sin = hidden[:, -window:], cos[:, -window:], sin[:, -window:]
    q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim).transpose(1, 2)
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return q


def head_probs(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Softmax attention [Hq, W, T] of `queries` [1, Hq, W, d] (the last W positions) over `keys`
    [1, Hkv, T, d] (GQA: each query head reads its group's KV head), causal."""
    w, t, d = queries.shape[-2], keys.shape[-2], queries.shape[-1]
    k = keys.float().repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
    logits = queries.float() @ k.transpose(-1, -2) / math.sqrt(d)  # [1, Hq, W, T]
    q_pos = torch.arange(t - w, t, device=keys.device)[:, None]
    logits = logits.masked_fill(torch.arange(t, device=keys.device)[None, :] > q_pos, float("-inf"))
    return logits.softmax(dim=-1)[0]


def group_mean(per_query_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[Hq, ...] -> [Hkv, ...]: the mean over each GQA group's query heads."""
    return per_query_head.reshape(kv_heads, -1, *per_query_head.shape[1:]).mean(dim=1)


def attention_probs(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of the last W `queries` over `keys`, averaged per GQA group: [Hkv, W, T]."""
    return group_mean(head_probs(queries, keys), keys.shape[1])


def attention_received(queries: torch.Tensor, keys: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """What each key received: the causal softmax attention of `queries` [1, Hq, W, d] (the last W
    positions) summed over the queries and averaged per GQA group, [Hkv, T] — as
    `attention_probs(queries, keys).sum(dim=1)`, in chunks of queries and without repeating the keys
    per query head or masking more than each chunk's own diagonal block (H2O's prefill: ~3x faster)."""
    hkv, t, d = keys.shape[1], keys.shape[-2], keys.shape[-1]
    w, group = queries.shape[-2], queries.shape[1] // keys.shape[1]
    k = keys[0].float().transpose(-1, -2) / math.sqrt(d)  # [Hkv, d, T]
    q = queries[0].float().reshape(hkv, group, w, d)
    received = torch.zeros(hkv, t, device=keys.device)
    for start in range(0, w, chunk):
        c = min(chunk, w - start)
        visible = t - w + start + c  # the chunk's last query sees up to here
        logits = (q[:, :, start : start + c].reshape(hkv, group * c, d) @ k[..., :visible]).view(hkv, group, c, visible)
        later = torch.ones(c, c, dtype=torch.bool, device=keys.device).triu_(1)  # within the chunk, causal
        logits[..., visible - c :].masked_fill_(later, float("-inf"))
        received[:, :visible] += logits.softmax(dim=-1).sum(dim=(1, 2)) / group
    return received


def pool(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Each position's score [H, T] smoothed over its `kernel` neighbours (zero-padded at the ends,
    as F.avg_pool1d and F.max_pool1d do): keeps clusters of attended tokens whole."""
    fn = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    return fn(scores[None], kernel, stride=1, padding=kernel // 2)[0]


def snapkv_scores(queries: torch.Tensor, keys: torch.Tensor, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """SnapKV scores [Hkv, T], as kvpress SnapKVPress computes them: the attention of the last
    `window` queries (each query head's softmax over every key, causal inside the window), averaged
    over the window, on the prefix (all but the window) only; pooled per query head; averaged over
    each GQA group; the window itself scores +inf so it is always kept."""
    t = keys.shape[-2]
    probs = head_probs(queries[..., -window:, :], keys)[..., : t - window]  # [Hq, W, T - W]
    scores = group_mean(pool(probs.mean(dim=1), kernel, pooling), keys.shape[1])
    return F.pad(scores, (0, window), value=float("inf"))


def keep_count(tokens: int, capacity: int | None, keep_ratio: float | None) -> int:
    """Tokens kept per head: a fixed `capacity` if set, else `keep_ratio` of the prompt rounded
    down (as kvpress's int(T * (1 - compression_ratio)))."""
    if capacity is not None:
        return min(tokens, capacity)
    return min(tokens, max(1, int(tokens * keep_ratio)))


def keep_top(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Per head, the positions of the `keep` highest scores [H, T], in position order: [H, keep]."""
    return scores.topk(keep, dim=-1).indices.sort(dim=-1).values


def protect_recent(scores: torch.Tensor, recent: int) -> torch.Tensor:
    """`scores` with the last `recent` positions raised to +inf (always kept)."""
    if recent <= 0:
        return scores
    return torch.cat([scores[:, :-recent], torch.full_like(scores[:, -recent:], float("inf"))], dim=-1)


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [1, Hkv, T, d] at per-head positions index [Hkv, K] -> [1, Hkv, K, d]."""
    return x.gather(2, index[None, :, :, None].expand(1, -1, -1, x.shape[-1]))
