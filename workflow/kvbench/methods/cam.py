"""`cam`: cache merging (Zhang et al., ICML 2024, zyxxmu/cam), as kvpress CAMPress runs it.

Tokens are scored by SnapKV (`window`, `kernel`, `pooling`); a compression keeps the top `keep`
positions and merges evicted values into the kept tokens that follow them (the reference's update,
kvpress `presses/cam_press.py`):
- the merge candidates are the `n` highest-scoring evicted tokens (ties: later positions first),
  where n is the number of tokens added since the last compression (every evicted token at prefill);
- each candidate i has a window of the `merge_budget` kept tokens after it (fewer at the end);
- with A the attention each token received, it merges with probability
  clamp(A_i / mean_{j in window} A_j, 0, 1), a Bernoulli draw seeded from the run seed, layer and
  compression; a merged value adds v_i / |window| to each value in its window (keys are unchanged).
`selection: shared` (kvpress's default: scores averaged over KV heads, so every head evicts the
same positions) or `per_head` (as `snapkv`). Two schedules, either or both:
- prefill (`keep_ratio` or `capacity`): after the prompt's attention, like `snapkv`, with A the
  observation window's attention; with `selection: per_head` it differs from `snapkv` at the same
  settings only by the merge. (kvpress runs CaM while decoding only; this schedule is ours.)
- decode (`target`): every `interval` decode steps, once the cache holds more than `target`
  tokens, compress to `target`, scoring with the last `window` of up to `buffer` buffered decode
  queries, A accumulated over decode steps since then (kvpress: interval 32, target 1024, buffer 64
  in the seed study). kvpress 0.5.5 (the peer bench's pin) rotates every buffered query with the
  current step's RoPE angle; we keep each query's own position, as later kvpress releases do by
  buffering each step's angles. Buffered queries and A are method state, counted in the bytes.
A is kvpress's: per step, the softmax of the step's queries over every cached key, averaged per
GQA group, summed over steps (`eviction.attention_received`), kept in fp32 (kvpress sums in the
model's dtype). The paper's code (zyxxmu/cam `local_cam_mask`) instead averages a start- and
recent-masked attention over all queries and divides by a maximum, not a window mean.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvbench.methods.base import STORAGE, ModelShape, layer_seed, register, tensor_bytes
from kvbench.methods.eviction import (
    EvictionCache,
    ScoredLayer,
    attention_received,
    gather,
    keep_count,
    snapkv_scores,
)
from kvbench.methods.kinds import CaMSettings

Uniform = Callable[[tuple[int, ...]], torch.Tensor]


def cam_compress(
    values: torch.Tensor,
    scores: torch.Tensor,
    attn: torch.Tensor,
    keep: int,
    new: int,
    merge_budget: int,
    uniform: Uniform,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One CaM compression. values [H, T, d] (fp32), scores and attn [H, T], `keep` tokens kept,
    `new` tokens since the last compression. Returns kept positions [H, keep] in position order
    and the values [H, T, d] with the merges added (the caller gathers the kept ones)."""
    heads, tokens = scores.shape
    kept = scores.topk(keep, dim=-1).indices.sort(dim=-1).values
    evicted_mask = torch.ones(heads, tokens, dtype=torch.int8, device=scores.device).scatter_(1, kept, 0)
    # Evicted positions first, in position order (a stable sort): ascending per head, [H, T - keep].
    evicted = evicted_mask.argsort(dim=-1, descending=True, stable=True)[:, : tokens - keep]
    n = min(new, tokens - keep)
    # The n best-scoring evicted tokens; flipping first makes the stable sort prefer later positions.
    order = scores.gather(1, evicted).flip(-1).argsort(dim=-1, descending=True, stable=True)[:, :n]
    merge = evicted.gather(1, tokens - keep - 1 - order).sort(dim=-1).values  # [H, n]
    window = torch.searchsorted(kept, merge, right=True)[..., None] + torch.arange(
        merge_budget, device=scores.device
    )  # [H, n, B]
    valid = window < keep
    targets = kept.gather(1, window.clamp(max=keep - 1).view(heads, -1)).view(heads, n, merge_budget)
    size = valid.sum(dim=-1)  # [H, n]
    mean = (attn.gather(1, targets.view(heads, -1)).view(heads, n, merge_budget) * valid).sum(-1) / size.clamp(min=1)
    prob = attn.gather(1, merge) / mean
    prob = torch.where(prob.isnan(), 0.0, torch.where(prob.isinf(), 1.0, prob)).clamp(0, 1)
    merged = (uniform((heads, n)) < prob) & (size > 0)
    scale = merged / size.clamp(min=1)  # [H, n]
    contrib = values.gather(1, merge[..., None].expand(-1, -1, values.shape[-1])) * scale[..., None]  # [H, n, d]
    contrib = (contrib[:, :, None, :] * valid[..., None]).reshape(heads, n * merge_budget, -1)
    out = values.clone()
    out.scatter_add_(1, targets.view(heads, -1, 1).expand(-1, -1, values.shape[-1]), contrib)
    return kept, out


class CaMLayer(ScoredLayer):
    def __init__(self, storage: torch.dtype, q_heads: int, settings: CaMSettings, seed: int, index: int) -> None:
        super().__init__(storage, q_heads)
        self.settings, self.seed, self.index = settings, seed, index  # run seed and layer: the draws' seed
        self.window, self.kernel, self.pooling = settings.window, settings.kernel, settings.pooling
        self.shared, self.merge_budget = settings.selection == "shared", settings.merge_budget
        self.at_prefill = settings.keep_ratio is not None or settings.capacity is not None
        self.target, self.interval, self.buffer = settings.target, settings.interval, settings.buffer
        self.prefill_queries = self.window if self.at_prefill else 0
        self.decode_queries = self.target is not None
        self.compressions = 0
        self.steps = 0  # decode tokens since the last compression
        self.attn: torch.Tensor | None = None  # [Hkv, kept]: attention accumulated since then
        self.recent: torch.Tensor | None = None  # [1, Hq, <= min(buffer, window), d]: last decode queries

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        queries = self.take_queries()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            tokens = key_states.shape[-2]
            keep = keep_count(tokens, self.settings.capacity, self.settings.keep_ratio) if self.at_prefill else tokens
            if keep >= tokens:
                self.store(key_states, value_states)
            else:
                if queries is None:
                    raise RuntimeError("cam: no queries reached the layer; run the model with the cache attached")
                window = min(self.window, keep)
                scores = snapkv_scores(queries, key_states, window, self.kernel, self.pooling)
                attn = attention_received(queries[..., -window:, :], key_states)  # [Hkv, T]
                self._compress(key_states, value_states, scores, attn, keep, tokens)
            return key_states, value_states  # the prefill itself attends to the whole prompt
        compute = key_states.dtype
        keys = self.append("keys", key_states.to(self.storage))
        values = self.append("values", value_states.to(self.storage))
        out = keys.to(compute), values.to(compute)  # this step attends to everything; compression follows
        if self.target is not None:
            self._decode_schedule(queries, out[0], key_states.shape[-2])
        return out

    def _decode_schedule(self, queries: torch.Tensor | None, keys: torch.Tensor, new: int) -> None:
        if queries is None:
            raise RuntimeError("cam: no queries reached the layer; run the model with the cache attached")
        step = attention_received(queries, keys)  # [Hkv, T]: this step's attention
        grown = keys.shape[-2] - (0 if self.attn is None else self.attn.shape[-1])
        self.attn = (
            step if self.attn is None else torch.cat([self.attn, step.new_zeros(step.shape[0], grown)], 1) + step
        )
        kept_queries = min(self.buffer, self.window)  # the scorer reads only the last `window`
        recent = queries.float() if self.recent is None else torch.cat([self.recent, queries.float()], dim=-2)
        self.recent = recent[..., -kept_queries:, :].clone()
        self.steps += new
        tokens = keys.shape[-2]
        if self.steps >= self.interval and tokens > self.target:
            window = min(self.recent.shape[-2], self.target)
            scores = snapkv_scores(self.recent, keys, window, self.kernel, self.pooling)
            kept = self._compress(keys, self.values, scores, self.attn, self.target, self.steps)
            self.attn = self.attn.gather(1, kept)
            self.steps, self.recent = 0, None

    def _compress(
        self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, attn: torch.Tensor, keep: int, new: int
    ) -> torch.Tensor:
        if self.shared:
            scores = scores.mean(dim=0, keepdim=True).expand_as(scores)
        # Drawn on the CPU and moved to the cache's device: the same draws on every device.
        generator = torch.Generator().manual_seed(layer_seed(self.seed, self.index, self.compressions))
        self.compressions += 1
        kept, merged = cam_compress(
            values[0].float(),
            scores,
            attn,
            keep,
            new,
            self.merge_budget,
            lambda shape: torch.rand(shape, generator=generator).to(values.device),
        )
        self.store(gather(keys, kept), gather(merged[None], kept))
        return kept

    def nbytes(self) -> int:
        return super().nbytes() + tensor_bytes(self.attn, self.recent)


@register("cam")
def cam(settings: CaMSettings, shape: ModelShape, seed: int) -> EvictionCache:
    storage = STORAGE[settings.storage]
    return EvictionCache([CaMLayer(storage, shape.q_heads, settings, seed, i) for i in range(shape.layers)])
