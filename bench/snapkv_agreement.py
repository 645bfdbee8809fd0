"""Does our SnapKV keep the positions kvpress SnapKVPress keeps? Same model, same prompts, same
settings (config/config.yaml's `snapkv`: window, kernel, avg pooling, keep ratio); kvpress runs in
the peer venv. Both sides' kept positions are read back by matching the kept keys bit for bit
against a plain prefill's keys in the same venv. Reported per prompt: the share of kept positions
per (layer, KV head) that both keep, and for positions only one side keeps, how far their score
sits from the selection threshold (a relative gap near float rounding means a near-tie).

    .venv/bin/python bench/snapkv_agreement.py [--contexts 1024 4096]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pandas as pd
import torch
from side_by_side import MODEL, OURS, build_all_prompts, peer_setup, run_peer

from kvbench.harness import attached
from kvbench.methods.base import ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.methods.eviction import EvictionCache, ScoredLayer, keep_count, snapkv_scores
from kvbench.methods.kinds import settings_of
from kvbench.models import load_model, load_tokenizer
from kvbench.provenance import provenance, write_table
from kvbench.report.blocks import Block


@torch.inference_mode()
def our_kept(model: Any, spec: dict[str, Any], ids: list[int]) -> tuple[list[list[list[int]]], list[torch.Tensor]]:
    """Per layer and KV head, the positions our SnapKV (at fp32 storage) keeps, and its scores."""
    shape = ModelShape.of(model.config)

    class Scores(ScoredLayer):  # the plain prefill's keys and the window's queries, per layer
        prefill_queries = spec["window"]

        def update(self, key_states, value_states, *args, **kwargs):
            self.captured = key_states.clone(), self.take_queries()
            return key_states, value_states

    plain = EvictionCache([Scores(torch.float32, shape.q_heads) for _ in range(shape.layers)])
    snap = build_cache(spec | {"storage": "fp32"}, shape)
    for cache in (plain, snap):
        with attached(cache, model):
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    kept, scores = [], []
    for full, pressed in zip(plain.layers, snap.layers):
        keys, queries = full.captured
        scores.append(snapkv_scores(queries, keys, spec["window"], spec["kernel"], spec.get("pooling", "avg")))
        per_head = []
        for head in range(keys.shape[1]):
            where = {row.numpy().tobytes(): p for p, row in enumerate(keys[0, head])}
            per_head.append(sorted(where[row.numpy().tobytes()] for row in pressed.keys[0, head]))
        kept.append(per_head)
    return kept, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    spec = OURS["snapkv"]
    tokenizer = load_tokenizer(MODEL)
    prompts = build_all_prompts(tokenizer, args.contexts)
    peer = run_peer("kept", peer_setup(prompts, 1, 64, []))
    theirs = {(r["prompt_id"], r["layer"], r["head"]): r["kept"] for r in peer["rows"]}
    model = load_model(MODEL)
    rows = []
    for prompt in prompts:
        kept, scores = our_kept(model, spec, prompt["input_ids"])
        snap = settings_of(spec)
        keep = keep_count(len(prompt["input_ids"]), snap.capacity, snap.keep_ratio)
        for layer, per_head in enumerate(kept):
            for head, ours in enumerate(per_head):
                other = theirs[(prompt["prompt_id"], layer, head)]
                s = scores[layer][head]
                threshold = s.topk(keep).values[-1].item()
                only = sorted(set(ours) ^ set(other))
                gap = max((abs(s[p].item() - threshold) / threshold for p in only), default=0.0)
                rows.append(
                    {
                        "prompt_id": prompt["prompt_id"],
                        "context_tokens": len(prompt["input_ids"]),
                        "layer": layer,
                        "head": head,
                        "kept_ours": len(ours),
                        "kept_kvpress": len(other),
                        "shared": len(set(ours) & set(other)) / len(other),
                        "max_relative_score_gap": gap,
                    }
                )
    table = pd.DataFrame(rows)
    summary = (
        table.groupby("prompt_id")
        .agg(
            context_tokens=("context_tokens", "first"),
            heads=("shared", "size"),
            mean_shared=("shared", "mean"),
            min_shared=("shared", "min"),
            heads_identical=("shared", lambda s: (s == 1).mean()),
            max_relative_score_gap=("max_relative_score_gap", "max"),
        )
        .reset_index()
    )
    pd.set_option("display.width", 200)
    print(summary.to_string(index=False, float_format="%.6g"))
    table["peer_versions"] = json.dumps(peer["versions"], sort_keys=True)
    config = {"seed": 0, "bench": "snapkv_agreement", "contexts": args.contexts, "snapkv": spec}
    write_table(table, "results/bench/snapkv_agreement.parquet", provenance(config, model="smollm2-135m"))


def render(t: pd.DataFrame) -> pd.DataFrame:
    """Per prompt, over its (layer, KV head) pairs: the share of kvpress's kept positions ours keeps."""
    out = (
        t.groupby("prompt_id", sort=False)
        .agg(
            tokens=("context_tokens", "first"),
            heads=("shared", "size"),
            mean_shared=("shared", "mean"),
            min_shared=("shared", "min"),
            below_100=("shared", lambda s: int((s < 1).sum())),
            max_gap=("max_relative_score_gap", "max"),
        )
        .reset_index()
    )
    out[["mean_shared", "min_shared"]] = (100 * out[["mean_shared", "min_shared"]]).round(2)
    return out.rename(
        columns={
            "prompt_id": "prompt",
            "heads": "(layer, head) pairs",
            "mean_shared": "mean shared %",
            "min_shared": "min shared %",
            "below_100": "pairs below 100 %",
            "max_gap": "max relative score gap",
        }
    )


BLOCKS = {"snapkv-agreement": Block(render, ("bench/snapkv_agreement.parquet",), make="make bench-peers")}


if __name__ == "__main__":
    main()
