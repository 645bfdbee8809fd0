"""KV capture: prefill one document with transformers (fp32) and keep every layer's K and V."""

from __future__ import annotations

import torch


def capture_kv(model: torch.nn.Module, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return K and V as fp32 tensors [layers, tokens, kv_heads * head_dim].

    Token-major per layer, the layout an offload connector ships. Keys are post-RoPE, as the
    cache holds them. Only this document's cache is alive while the caller uses the result.
    """
    ids = torch.tensor([input_ids], dtype=torch.long, device=next(model.parameters()).device)
    with torch.inference_mode():
        # logits_to_keep=1: an 8K x 49K fp32 logit matrix would cost 1.6 GB for nothing.
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values

        def stacked(kind: str, cache=cache) -> torch.Tensor:
            per_layer = [getattr(layer, kind)[0].transpose(0, 1).reshape(len(input_ids), -1) for layer in cache.layers]
            return torch.stack(per_layer).float().cpu()

        keys, values = stacked("keys"), stacked("values")
    del cache
    return keys, values
