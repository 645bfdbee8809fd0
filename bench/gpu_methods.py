"""The harness's cost per method at the seeds' scale on one GPU: every config/gpu.yaml method
prefills and greedily decodes through kvbench.harness.generate (the quality stage's timed path,
batch 1) on a Llama-3.1-8B-shaped model in bf16 with SDPA, on CUDA. Weights are RANDOM (the hub's
cannot reach a GPU host without internet): compute costs match the real model's, and what an
eviction keeps does not matter to them. Per (context, method): TTFT, TPOT, peak GPU memory and the
cache's bytes, next to kvbench.resources' formula for the same job and its stated per-token costs,
which this table measures in their place. Methods run in a shuffled order per round; each run is
appended to the table as it ends (a run cut short keeps what it measured), and a run that fails
(out of memory, say) is a row with its error.

    python bench/gpu_methods.py [--contexts 2048 10000] [--steps 32] [--rounds 2] [--budget-s 300]
"""

from __future__ import annotations

import argparse
import random
import time
import traceback
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

from kvbench.harness import generate, peak_memory_mb, reset_peak_memory
from kvbench.provenance import provenance, write_table
from kvbench.report.blocks import Block
from kvbench.report.bootstrap import MIN_UNITS
from kvbench.report.render import fmt
from kvbench.resources import GPU_COST, KNOWN_SHAPES, Shape, Work, gpu_bytes
from kvbench.serve.intervals import bootstrap

ROOT = Path(__file__).resolve().parents[1]
HUB = "meta-llama/Llama-3.1-8B-Instruct"
TABLE = "results/bench/gpu_methods.parquet"


def random_llama(hub: str, seed: int, device: str) -> torch.nn.Module:
    """A Llama of `hub`'s shape (kvbench.resources.KNOWN_SHAPES) with transformers' own random
    initialisation under `seed`, built on `device` in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = KNOWN_SHAPES[hub]
    config = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["hidden"] // s["head_dim"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=s["context"],
        rope_theta=500000.0,
        tie_word_embeddings=s["tied"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None  # a random model's argmax may hit EOS: decode every step
    return model.eval()


def formula(hub: str, shape: Shape, context: int, steps: int) -> dict[str, float]:
    """kvbench.resources' GPU memory of a harness job holding one cache of this length, and its
    stated seconds for this prefill and decode."""
    work = Work("bench", hub, 1, "harness", context + steps, context, steps)
    return {
        "formula_gpu_gib": gpu_bytes(work, shape, 0) / 2**30,
        "stated_ttft_s": shape.scale * context * GPU_COST["harness_prefill_s_per_token"],
        "stated_tpot_s": shape.scale * GPU_COST["harness_decode_s_per_step"],
    }


def run_one(model, spec: dict, ids: list[int], steps: int, seed: int) -> dict:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.empty_cache()
    before = reset_peak_memory(device)
    try:
        out = generate(model, spec, ids, steps, seed=seed)
    except Exception as err:  # noqa: BLE001 - an OOM or a method's failure is a row, not a crash
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=3)}
    keep = ("ttft_s", "tpot_s", "new_tokens", "kv_bytes_end", "full16_bytes_end", "ratio_end")
    return {k: out[k] for k in keep} | {
        "peak_gpu_gib": peak_memory_mb(device) / 1024,
        "in_use_before_gib": before / 1024 if before is not None else None,
        "error": None,
    }


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "config" / "gpu.yaml"))
    parser.add_argument("--hub", default=HUB, choices=sorted(KNOWN_SHAPES), help="the shape to build")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 10000])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no run after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=TABLE)
    args = parser.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    methods = config["methods"]
    start = time.perf_counter()
    model = random_llama(args.hub, args.seed, args.device)
    print(f"model built in {time.perf_counter() - start:.1f} s", flush=True)
    shape = Shape(**KNOWN_SHAPES[args.hub])
    prov = provenance(
        {"seed": args.seed, "bench": "gpu_methods", "methods": methods, "steps": args.steps},
        model=args.hub + " (random)",
    )
    rng, rows = random.Random(args.seed), []
    gen = torch.Generator().manual_seed(args.seed)
    prompts = {
        c: torch.randint(0, KNOWN_SHAPES[args.hub]["vocab"], (c,), generator=gen).tolist() for c in args.contexts
    }
    warm = generate(model, {"kind": "full"}, prompts[args.contexts[0]][:256], 4)  # CUDA and SDPA's first calls
    del warm
    for round_ in range(args.rounds):
        for context in args.contexts:
            for name in rng.sample(list(methods), len(methods)):
                if time.perf_counter() - start > args.budget_s:
                    print(f"budget of {args.budget_s:.0f} s spent: stopping", flush=True)
                    return
                row = {"round": round_, "context_tokens": context, "method": name, "steps": args.steps}
                row |= run_one(model, methods[name], prompts[context], args.steps, args.seed)
                row |= formula(args.hub, shape, context, args.steps)
                rows.append(row)
                shown = row["error"] or (
                    f"TTFT {row['ttft_s']:.3f} s, TPOT {row['tpot_s'] * 1e3:.1f} ms, peak {row['peak_gpu_gib']:.1f} GiB"
                )
                print(f"round {round_} {context} {name}: {shown}", flush=True)
                write_table(pd.DataFrame(rows), args.out, prov)


def ratio_interval(ratios: pd.Series) -> str:
    """95 % bootstrap interval of the median of the per-round ratios (seeded; none below MIN_UNITS
    rounds): how steady the ratio is between rounds in one process on one GPU."""
    if ratios.notna().sum() < MIN_UNITS:
        return f"none (n < {MIN_UNITS})"
    low, high = bootstrap(ratios.to_numpy(), np.median)
    return f"{fmt(low)}–{fmt(high)}"


def render(t: pd.DataFrame) -> pd.DataFrame:
    """Per context and method: medians over rounds of TTFT and TPOT, TPOT's ratio to `full`'s in
    the same round (paired) with its interval, peak GPU memory against the formula's, and the
    stated costs the measured ones stand beside."""
    ok = t[t.error.isna()]
    full = ok[ok.method == "full"].set_index(["round", "context_tokens"])
    ratio = ok.join(full[["ttft_s", "tpot_s"]], on=["round", "context_tokens"], rsuffix="_full")
    ratio = ratio.assign(
        ttft_vs_full=ratio.ttft_s / ratio.ttft_s_full,
        tpot_vs_full=ratio.tpot_s / ratio.tpot_s_full,
    )
    g = ratio.groupby(["context_tokens", "method"])
    out = pd.DataFrame(
        {
            "runs": g.size(),
            "TTFT (s)": g.ttft_s.median(),
            "TTFT stated (s)": g.stated_ttft_s.first(),
            "TPOT (ms)": g.tpot_s.median() * 1e3,
            "TPOT stated (ms)": g.stated_tpot_s.first() * 1e3,
            "TPOT / full": g.tpot_vs_full.median(),
            "95 % interval": g.tpot_vs_full.apply(ratio_interval),
            "peak GiB": g.peak_gpu_gib.max(),
            "formula GiB": g.formula_gpu_gib.first(),
            "KV / full16": 1 / g.ratio_end.median(),
        }
    ).reset_index()
    out.loc[out.method == "full", "95 % interval"] = "—"
    failed = t[t.error.notna()].groupby(["context_tokens", "method"]).error.first()
    out["error"] = [failed.get((c, m), "") for c, m in zip(out.context_tokens, out.method)]
    return out.sort_values(["context_tokens", "TPOT / full"]).rename(columns={"context_tokens": "tokens"})


def render_summary(t: pd.DataFrame) -> str:
    """One sentence: where it ran, full's measured per-token costs against the stated ones, and
    whether the formula's GPU memory covered every measured peak."""
    ok = t[t.error.isna()]
    full = ok[ok.method == "full"]
    longest = int(full.context_tokens.max())
    at = full[full.context_tokens == longest]
    prefill = at.ttft_s / at.context_tokens * 1e3
    decode = at.tpot_s * 1e3
    over = ok[ok.peak_gpu_gib > ok.formula_gpu_gib]
    memory = (
        "every run's peak GPU memory within the formula's"
        if over.empty
        else f"{over.method.nunique()} method(s) above the formula's GPU memory: "
        + ", ".join(sorted(f"{m} ({fmt(p)} GiB)" for m, p in over.groupby("method").peak_gpu_gib.max().items()))
    )
    hardware = str(t.hardware.iloc[0]).split(", ")
    gpu = next((part for part in hardware if "x NVIDIA" in part or part.startswith("1x")), "a GPU")
    return (
        f"on {gpu} ({len(t)} runs, {int(t.steps.iloc[0])} decode steps each, {t.error.notna().sum()} failed), "
        f"`full` at {longest} tokens prefilled at {fmt(prefill.median())} ms per token "
        f"(median of {len(at)} runs, range {fmt(prefill.min())}–{fmt(prefill.max())}; "
        f"stated {fmt(GPU_COST['harness_prefill_s_per_token'] * 1e3)}) and decoded at {fmt(decode.median())} ms "
        f"per step (range {fmt(decode.min())}–{fmt(decode.max())}; stated "
        f"{fmt(GPU_COST['harness_decode_s_per_step'] * 1e3)}); {memory}"
    )


BLOCKS = {
    "gpu-methods": Block(render, (TABLE.removeprefix("results/"),), make="make bench-gpu"),
    "gpu-methods-summary": Block(render_summary, (TABLE.removeprefix("results/"),), make="make bench-gpu", inline=True),
}


if __name__ == "__main__":
    main()
