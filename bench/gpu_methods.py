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

import pandas as pd
import torch
import yaml

from kvbench.harness import generate, peak_memory_mb, reset_peak_memory
from kvbench.provenance import provenance, write_table
from kvbench.report.blocks import Block
from kvbench.report.bootstrap import MIN_UNITS
from kvbench.report.render import fmt
from kvbench.resources import GPU_COST, KNOWN_SHAPES, Shape, Work, gpu_bytes
from kvbench.serve.intervals import paired_ratio_of_medians

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
    """kvbench.resources' GPU memory of a harness job holding one cache of this length (copies 1:
    the quality and system jobs, which hold two, are sized with 2), and its stated seconds for
    this prefill and per decode step, scaled to the model as the profile scales them."""
    work = Work("bench", hub, 1, "harness", context + steps, context, steps)
    return {
        "formula_gpu_gib": gpu_bytes(work, shape, 0) / 2**30,
        "stated_ttft_s": shape.scale * context * GPU_COST["harness_prefill_s_per_token"],
        "stated_step_s": shape.scale * GPU_COST["harness_decode_s_per_step"],
    }


def cuda_context_gib(device: torch.device) -> float | None:
    """What the process holds on the GPU beyond PyTorch's allocator (the CUDA context, cuBLAS
    workspaces): used minus reserved, on a GPU no other process uses."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return (total - free - torch.cuda.memory_reserved(device)) / 2**30


def run_one(model, spec: dict, ids: list[int], steps: int, seed: int, context_gib: float | None) -> dict:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak_memory(device)
    try:
        out = generate(model, spec, ids, steps, seed=seed)
    except Exception as err:  # noqa: BLE001 - an OOM or a method's failure is a row, not a crash
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=3)}
    keep = ("ttft_s", "tpot_s", "e2e_s", "new_tokens", "kv_bytes_end", "full16_bytes_end", "ratio_end")
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None
    return {k: out[k] for k in keep} | {
        # the decode loop's wall time per step: TPOT's forward passes plus the loop's own work
        "step_s": (out["e2e_s"] - out["ttft_s"]) / max(1, out["new_tokens"] - 1),
        "peak_allocated_gib": peak_memory_mb(device) / 1024,
        "peak_process_gib": reserved + context_gib if reserved is not None and context_gib is not None else None,
        "error": None,
    }


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "config" / "gpu.yaml"))
    parser.add_argument("--hub", default=HUB, choices=sorted(KNOWN_SHAPES), help="the shape to build")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", type=int, nargs="+", default=[10000])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no run after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=TABLE)
    args = parser.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    methods = config["methods"]
    start = time.perf_counter()
    model = random_llama(args.hub, args.seed, args.device)
    device = next(model.parameters()).device
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
    for context in args.contexts:  # untimed: each shape's and method's first calls
        for name, spec in methods.items():
            generate(model, spec, prompts[context], 2, seed=args.seed)
    context_gib = cuda_context_gib(device)
    print(f"warmed up at {time.perf_counter() - start:.1f} s; CUDA context {context_gib} GiB", flush=True)
    for round_ in range(args.rounds):
        for context in args.contexts:
            for name in rng.sample(list(methods), len(methods)):
                if time.perf_counter() - start > args.budget_s:
                    print(f"budget of {args.budget_s:.0f} s spent: stopping", flush=True)
                    return
                row = {"round": round_, "context_tokens": context, "method": name, "steps": args.steps}
                row |= run_one(model, methods[name], prompts[context], args.steps, args.seed, context_gib)
                row |= formula(args.hub, shape, context, args.steps)
                rows.append(row)
                shown = row["error"] or (
                    f"TTFT {row['ttft_s']:.3f} s, TPOT {row['tpot_s'] * 1e3:.1f} ms, "
                    f"step {row['step_s'] * 1e3:.1f} ms, peak {row['peak_allocated_gib']:.1f} GiB"
                )
                print(f"round {round_} {context} {name}: {shown}", flush=True)
                write_table(pd.DataFrame(rows), args.out, prov)


def ratio_to_full(t: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per context and method: median of `column` over rounds / full's median, paired by round
    (kvbench.serve.intervals.paired_ratio_of_medians: its interval resamples rounds; none below
    MIN_UNITS rounds)."""
    wide = t.pivot_table(index=["context_tokens", "round"], columns="method", values=column)
    rows = []
    for context, per_round in wide.groupby(level=0):
        for method in per_round.columns:
            ratio, low, high, n = paired_ratio_of_medians(per_round[method].to_numpy(), per_round["full"].to_numpy())
            rows.append({"context_tokens": context, "method": method, "ratio": ratio, "low": low, "high": high, "n": n})
    return pd.DataFrame(rows).set_index(["context_tokens", "method"])


def timed(t: pd.DataFrame) -> pd.DataFrame:
    """The runs the blocks summarise: no error, after the first round (on the H200 the first
    round's decode ran up to 3x slower for every method, the untimed warm-up before it
    notwithstanding; its rows stay in the table)."""
    return t[t.error.isna() & (t["round"] > 0)]


def render(t: pd.DataFrame) -> pd.DataFrame:
    """Per context and method, over the rounds after the first: medians of TTFT, TPOT and the
    decode loop's time per step, TPOT's ratio to `full`'s (ratio of medians, paired by round)
    with its interval, the process's peak GPU memory against the formula's, and the stated costs
    beside the measured."""
    ok = timed(t)
    ratio = ratio_to_full(ok, "tpot_s")
    g = ok.groupby(["context_tokens", "method"])
    out = pd.DataFrame(
        {
            "runs": g.size(),
            "TTFT (s)": g.ttft_s.median(),
            "TTFT stated (s)": g.stated_ttft_s.first(),
            "TPOT (ms)": g.tpot_s.median() * 1e3,
            "step (ms)": g.step_s.median() * 1e3,
            "step stated (ms)": g.stated_step_s.first() * 1e3,
            "TPOT / full": ratio.ratio,
            "95 % interval": [
                "—" if m == "full" else f"{fmt(lo)}–{fmt(hi)}" if lo == lo else f"none (n < {MIN_UNITS})"
                for (_, m), lo, hi in zip(ratio.index, ratio.low, ratio.high)
            ],
            "peak GiB": g.peak_process_gib.max(),
            "formula GiB": g.formula_gpu_gib.first(),
            "KV / full16": 1 / g.ratio_end.median(),
        }
    ).reset_index()
    failed = t[t.error.notna()].groupby(["context_tokens", "method"]).error.first()
    out["error"] = [failed.get((c, m), "") for c, m in zip(out.context_tokens, out.method)]
    return out.sort_values(["context_tokens", "TPOT / full"]).rename(columns={"context_tokens": "tokens"})


def render_summary(t: pd.DataFrame) -> str:
    """One sentence: where it ran, full's measured prefill and decode costs and the slowest
    method's decode step against the stated ones (scaled to the model), and whether the process's
    peak GPU memory stayed within the formula's."""
    ok = timed(t)
    longest = int(ok.context_tokens.max())
    at = ok[ok.context_tokens == longest]
    full = at[at.method == "full"]
    stated_ttft, stated_step = float(at.stated_ttft_s.iloc[0]), float(at.stated_step_s.iloc[0])
    steps = at.groupby("method").step_s.median().sort_values()
    slowest = steps.index[-1]
    over = ok[ok.peak_process_gib > ok.formula_gpu_gib]
    memory = (
        "no GPU memory measured (not on CUDA)"
        if ok.peak_process_gib.isna().all()
        else "every run's peak GPU memory (the allocator's reserved peak plus the CUDA context) within the formula's"
        if over.empty
        else "above the formula's GPU memory: "
        + ", ".join(sorted(f"{m} ({fmt(p)} GiB)" for m, p in over.groupby("method").peak_process_gib.max().items()))
    )
    hardware = str(t.hardware.iloc[0]).split(", ")
    gpu = next((part for part in hardware if "x NVIDIA" in part), "a GPU")
    return (
        f"on {gpu} ({len(t)} runs over {t['round'].nunique()} rounds, {int(t.steps.iloc[0])} decode steps each, "
        f"{t.error.notna().sum()} failed; {len(ok)} after the first round summarised), `full` at {longest} tokens prefilled in {fmt(full.ttft_s.median())} s "
        f"(stated {fmt(stated_ttft)}) and decoded at {fmt(full.step_s.median() * 1e3)} ms per step "
        f"(range {fmt(full.step_s.min() * 1e3)}–{fmt(full.step_s.max() * 1e3)}; stated {fmt(stated_step * 1e3)}); "
        f"the slowest method's step, {slowest}'s, took {fmt(steps.iloc[-1] * 1e3)} ms "
        f"({fmt(steps.iloc[-1] / stated_step)}× the stated); {memory}"
    )


BLOCKS = {
    "gpu-methods": Block(render, (TABLE.removeprefix("results/"),), make="make bench-gpu"),
    "gpu-methods-summary": Block(render_summary, (TABLE.removeprefix("results/"),), make="make bench-gpu", inline=True),
}


if __name__ == "__main__":
    main()
