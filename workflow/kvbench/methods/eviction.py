"""Shared parts of the eviction methods (SnapKV, H2O, CaM): query capture and attention scores.

The cache update does not see queries, so a forward pre-hook on each attention module recomputes
this step's post-RoPE queries (q_proj + RoPE, as the module itself does) and hands them to the
layer. Kept keys and values are stored at a 16-bit storage dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.methods.base import MethodCache, MethodLayer


class ScoredLayer(MethodLayer):
    """A layer that receives this step's queries from the hook before `update` runs.

    `query_window`: how many of the last queries the layer needs (None: all of them); the hook
    projects only those, so scoring adds little to the prefill. `decode_queries`: whether decode
    steps need queries too (H2O keeps scoring; SnapKV and CaM select once, at prefill).
    """

    query_window: int | None = None
    decode_queries: bool = False

    def __init__(self, storage: torch.dtype, q_heads: int) -> None:
        super().__init__()
        self.storage, self.q_heads = storage, q_heads
        self.queries: torch.Tensor | None = None

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys.to(self.storage), values.to(self.storage)


class EvictionCache(MethodCache):
    def attach(self, model: torch.nn.Module) -> list[Any]:
        handles = []
        for index, block in enumerate(model.model.layers):
            handles.append(block.self_attn.register_forward_pre_hook(self.query_hook(index), with_kwargs=True))
        return handles

    def query_hook(self, index: int):
        """The forward pre-hook of attention module `index`: hands layer `index` its queries."""

        def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            layer = self.layers[index]
            if layer.is_initialized and not layer.decode_queries:
                return
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            window = layer.query_window
            if window is not None:
                hidden, cos, sin = hidden[:, -window:], cos[:, -window:], sin[:, -window:]
            q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            layer.queries = q

        return capture


def attention_probs(queries: torch.Tensor, keys: torch.Tensor, kv_groups: int) -> torch.Tensor:
    """Softmax attention of `queries` [1, Hq, W, d] (the last W positions) over `keys`
    [1, Hkv, T, d], causal, averaged over each GQA group: [Hkv, W, T]."""
    w, t, d = queries.shape[-2], keys.shape[-2], queries.shape[-1]
    k = keys.float().repeat_interleave(kv_groups, dim=1)
    logits = queries.float() @ k.transpose(-1, -2) / math.sqrt(d)  # [1, Hq, W, T]
    q_pos = torch.arange(t - w, t)[:, None]
    logits = logits.masked_fill(torch.arange(t)[None, :] > q_pos, float("-inf"))
    probs = logits.softmax(dim=-1)[0]
    return probs.reshape(-1, kv_groups, w, t).mean(dim=1)


def pooled_window_scores(queries: torch.Tensor, keys: torch.Tensor, kv_groups: int, window: int,
                         kernel: int) -> torch.Tensor:
    """SnapKV scores [Hkv, T]: attention of the last `window` queries summed, then max-pooled."""
    return max_pool(attention_probs(queries[..., -window:, :], keys, kv_groups).sum(dim=1), kernel)


def max_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each position's score [H, T] raised to its neighbourhood's maximum: keeps clusters whole."""
    return torch.nn.functional.max_pool1d(scores[None], kernel, stride=1, padding=kernel // 2)[0]


def keep_count(tokens: int, settings: dict[str, Any]) -> int:
    """Tokens kept per head: a fixed `capacity`, or `keep_ratio` of the prompt."""
    if "capacity" in settings:
        return min(tokens, int(settings["capacity"]))
    return min(tokens, max(1, math.ceil(tokens * float(settings.get("keep_ratio", 0.25)))))


def select_with_window(scores: torch.Tensor, keep: int, window: int) -> torch.Tensor:
    """Per KV head, indices of the top (keep - window) prefix positions plus the last `window`
    positions, in position order: [Hkv, keep]."""
    heads, tokens = scores.shape
    window = min(window, keep)
    prefix = scores[:, : tokens - window]
    top = prefix.topk(keep - window, dim=-1).indices
    recent = torch.arange(tokens - window, tokens).expand(heads, window)
    return torch.cat([top, recent], dim=-1).sort(dim=-1).values


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [1, Hkv, T, d] at per-head positions index [Hkv, K] -> [1, Hkv, K, d]."""
    return x.gather(2, index[None, :, :, None].expand(1, -1, -1, x.shape[-1]))
