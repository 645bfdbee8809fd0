"""The shared prefill side by side with the per-method path, on the same samples (issue 18).

Every path does the quality stage's query-aware work: every method on the same N samples of a quality
task folder, each method's output teacher-forced on the reference (`full`) cache's continuation for
up to `quality.fidelity_positions` positions, with a free row branched at its first divergence (its
answer). All paths run in one process, interleaved: each round runs every path once, the order rotated
by one each round (two paths alternate), after one untimed warm-up per path (the first sample's first
256 tokens, 2 new tokens, as the quality adapter warms up).

- `per-method`: the quality stage as it ran before the shared prefill. For every method (`full` first:
  its continuation and distributions become the references) and every sample, a prefill through the
  method's own cache (kvbench.harness.prefill), then that method's decode alone: one row per forward
  pass (kvbench.decode.run_rows with max_batch=1; the forced row and its branch take turns).
- `shared`: what the quality stage runs now, kvbench.quality.engine.run (protocol query-aware,
  reference `full`): one full-precision prefill per sample, every method forked from it, the
  reference's rows decoded first, then every other method's rows of all samples decoded together
  (up to `quality.max_rows` rows per forward pass).
- `shared-one-row`: the same engine with max_rows=1: the shared prefill, decoded one row per pass.

per-method / shared is what the quality stage gained. It pulls two levers, which the third path tells
apart: per-method / shared-one-row is the shared prefill's (one prefill per sample instead of one per
method and sample, plus the forks' compression), shared-one-row / shared the batched decode's.

Recorded (results/bench/shared_prefill.parquet, provenance columns as every bench), `record` = `round`:
per round and path the wall and CPU seconds (this process, all threads), the forward passes' split
(prefill, fork, decode seconds, decode steps, row-steps), samples, methods and prompt tokens.
`record` = `sample`: per path × method × sample (the first timed round's run) the bytes after the
prefill and at the end, the output tokens, first divergence, fidelity (kl_first, kl_mean, kl_max,
top1_agreement), the error if any, whether the path gave the same tokens in every round, and the
comparison with the per-method path: same prefill bytes, same tokens, kl_mean difference.

What the checks show: the paths compute the same thing. A fork holds the bytes its method's own
prefill builds and the prompt's next-token distribution is bit for bit the same
(tests/test_quality_engine.py), so prefill bytes must be equal on every path; a row decoded alone
does the same arithmetic whichever prefill it came from, so shared-one-row gives the per-method
path's tokens and KL values exactly. The batched path does not round like one row per pass (a
projection over B rows sums in another order), so its tokens can part from the others' at a
near-tie and its KL values differ in the last digits, its reference included (decoded batched too).

Not measured: the context-only protocol (its question pass exists only on the shared path); model
loading, lm-eval's task loading and scoring (all paths start from token ids); memory. Like for like
with the old stage except that both paths force at most `fidelity_positions` positions (the current
definition; the old stage forced the reference's whole continuation) and the old stage decoded a
forced row to its end before its branch (the same one-row passes, in another order). This machine is
shared: other work lands in whichever path runs at the time; the paired per-round ratios cancel only
drift slower than a round, so the spread over rounds is printed with the ratio.

    .venv/bin/python bench/shared_prefill.py [--samples 4] [--rounds 2] [--tasks results/quality/smollm2-135m/tasks]
    .venv/bin/python bench/shared_prefill.py --build-from ../other/results/corpus/realistic --tasks /tmp/tasks
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import pandas as pd
import torch
import yaml

from kvbench.report.blocks import Block

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "results" / "bench" / "shared_prefill.parquet"
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
PER_METHOD, SHARED, SHARED_ONE_ROW = "per-method", "shared", "shared-one-row"
PATHS = (PER_METHOD, SHARED, SHARED_ONE_ROW)
FIELDS = (
    "kv_bytes_prefill",
    "kv_bytes_end",
    "first_divergence",
    "same_output_as_reference",
    "kl_first",
    "kl_mean",
    "kl_max",
    "top1_agreement",
    "fidelity_positions",
)
T = TypeVar("T")


def pick(groups: Sequence[Sequence[T]], n: int) -> list[T]:
    """The first `n` items taking one from each group in turn: samples across the tasks, not the
    first task's alone."""
    turns = itertools.zip_longest(*groups, fillvalue=None)
    return [item for turn in turns for item in turn if item is not None][:n]


def rotation(paths: Sequence[str], round_index: int) -> list[str]:
    """The paths' order in a round: rotated by one each round, so each path runs in every place."""
    k = round_index % len(paths)
    return [*paths[k:], *paths[:k]]


class _TaskLoader(yaml.SafeLoader):
    """Reads a task YAML as written by kvbench.quality.taskfiles (`!function` kept as its name)."""


_TaskLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def requests(folder: Path, n: int) -> tuple[list[Any], frozenset[str]]:
    """lm-eval's requests for `n` samples of the task folder (one from each task in turn), and the
    plain (no chat template) tasks. Zero-shot without a description, lm-eval's context for a document
    is its `doc_to_text` template rendered (lm_eval.api.task.ConfigurableTask.fewshot_context)."""
    from lm_eval.api.instance import Instance
    from lm_eval.utils import apply_template

    from kvbench.quality.taskfiles import read_manifest

    groups, plain = [], set()
    for entry in read_manifest(folder):
        if not entry["samples"]:
            continue
        task = entry["task"]
        config = yaml.load((folder / f"{task}.yaml").read_text(), Loader=_TaskLoader)
        if not config["metadata"]["chat"]:
            plain.add(task)
        docs = [json.loads(line) for line in (folder / f"{task}.jsonl").read_text().splitlines()]
        groups.append(
            [
                Instance(
                    "generate_until",
                    doc,
                    (apply_template(config["doc_to_text"], doc), dict(config["generation_kwargs"])),
                    i,
                    (task, i, 1),
                )
                for i, doc in enumerate(docs)
            ]
        )
    chosen = pick(groups, n)
    if len(chosen) < n:
        raise ValueError(f"{folder}: {len(chosen)} samples, {n} asked for (--samples)")
    return chosen, frozenset(plain)


def build_task_folder(corpus: Path, folder: Path, config: Mapping[str, Any], model_dir: str) -> None:
    """The quality task folder built from a realistic corpus (docs.parquet, facts.parquet) as the
    workflow's quality_tasks rule builds it, with the config's tasks and seed."""
    from kvbench.quality.taskfiles import MANIFEST, build_tasks, load_sources, text_tokenizer, write_tasks

    if (folder / MANIFEST).exists():
        raise SystemExit(f"--build-from: {folder} already holds a task folder; remove it or leave out --build-from")
    sources = load_sources(
        pd.read_parquet(corpus / "docs.parquet"),
        pd.read_parquet(corpus / "facts.parquet"),
        None,
        text_tokenizer(model_dir),
    )
    write_tasks(build_tasks(config["quality"]["tasks"], sources, int(config["seed"])), folder)


def outcome(row: Any) -> dict[str, Any]:
    """What the engine records for a decoded row (kvbench.quality.engine), from a row decoded alone."""
    from kvbench.fidelity import summarize

    done = row.result()
    error = row.error or done.error
    if error is not None:
        return {"error": error}
    out = {
        "tokens": done.tokens,
        "kv_bytes_end": done.bytes_end,
        "first_divergence": row.divergence if row.reference is not None else None,
    }
    if row.reference is not None:
        out |= {"same_output_as_reference": done.tokens == row.reference.tokens, **summarize(row.kl, row.top1)}
    return out


def per_method(
    model: Any,
    prompts: list[Any],
    methods: Mapping[str, dict[str, Any]],
    *,
    seed: int,
    reference: str,
    fidelity_positions: int | None,
    cost: Any,
    **_: Any,
) -> dict[tuple[str, str], dict[str, Any]]:
    """Method after method (the reference first), sample after sample: the method's own prefill, then
    its rows decoded one per forward pass."""
    from kvbench.decode import Row, eos_ids, run_rows
    from kvbench.fidelity import Reference, prompt_hash
    from kvbench.harness import prefill
    from kvbench.methods.base import ModelShape
    from kvbench.methods.catalog import build_cache

    shape, eos = ModelShape.of(model.config), eos_ids(model)
    references: dict[str, Any] = {}
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for method in [reference, *(m for m in methods if m != reference)]:
        for prompt in prompts:
            try:
                cache = build_cache(methods[method], shape, seed)
                logits, seconds = prefill(model, cache, prompt.ids)
            except Exception as err:  # a method that fails on a sample: its row says why
                results[(method, prompt.key)] = {"error": f"{type(err).__name__}: {err}"}
                continue
            cost.prefill_s += seconds
            mine = method == reference
            row = Row(
                cache,
                logits,
                len(prompt.ids),
                prompt.max_new_tokens,
                eos,
                prompt.stop,
                reference=None if mine else references.get(prompt.key),
                forced_positions=fidelity_positions,
                keep_logprobs=mine,
                keep_positions=fidelity_positions,
            )
            bytes_prefill = cache.nbytes()
            run_rows(model, [row], max_batch=1, tally=cost.decode)
            if mine and row.error is None:
                references[prompt.key] = Reference(row.tokens, torch.stack(row.logprobs), prompt_hash(prompt.ids))
            results[(method, prompt.key)] = {"kv_bytes_prefill": bytes_prefill, **outcome(row)}
    return results


def shared(
    model: Any,
    prompts: list[Any],
    methods: Mapping[str, dict[str, Any]],
    *,
    seed: int,
    reference: str,
    fidelity_positions: int | None,
    cost: Any,
    max_rows: int,
    prompts_per_batch: int,
) -> dict[tuple[str, str], dict[str, Any]]:
    """The quality engine, query-aware only."""
    from kvbench.quality import engine

    outcomes, _ = engine.run(
        model,
        prompts,
        methods,
        protocols=(engine.QUERY_AWARE,),
        seed=seed,
        reference=reference,
        fidelity_positions=fidelity_positions,
        prompts_per_batch=prompts_per_batch,
        max_rows=max_rows,
        cost=cost,
        log=lambda _: None,
    )
    return {
        (method, key): {
            "error": o.error,
            **({"tokens": o.tokens} if o.error is None else {}),
            **{k: o.record[k] for k in FIELDS if k in o.record},
        }
        for (method, _protocol, key), o in outcomes.items()
    }


def timed(
    run: Callable[..., dict],
    model: Any,
    prompts: list[Any],
    methods: Mapping[str, dict[str, Any]],
    settings: Mapping[str, Any],
) -> tuple[dict, dict[str, float | int]]:
    from kvbench.quality.engine import Cost

    cost = Cost()
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    results = run(model, prompts, methods, cost=cost, **settings)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return results, {
        "wall_s": wall,
        "cpu_s": cpu,
        "prefill_s": cost.prefill_s,
        "fork_s": cost.fork_s,
        "decode_s": cost.decode.seconds,
        "decode_steps": cost.decode.steps,
        "row_steps": cost.decode.row_steps,
    }


def sample_rows(outputs: Mapping[str, list[dict]], prompts: list[Any], methods: list[str]) -> list[dict[str, Any]]:
    """Per path x method x sample: the first timed round's outcome, and whether every round gave its tokens."""
    rows = []
    for path, results in outputs.items():
        for prompt in prompts:
            for method in methods:
                key = (method, prompt.key)
                first = results[0].get(key, {"error": "no outcome"})
                tokens = first.get("tokens")
                every = all(later.get(key, {}).get("tokens") == tokens for later in results[1:])
                rows.append(
                    {
                        "record": "sample",
                        "path": path,
                        "method": method,
                        "sample": prompt.key,
                        "prompt_tokens": len(prompt.ids),
                        "max_new_tokens": prompt.max_new_tokens,
                        "output_ids": tokens,
                        "new_tokens": len(tokens) if tokens is not None else None,
                        "error": first.get("error"),
                        **{k: first.get(k) for k in FIELDS},
                        "same_every_round": every,
                    }
                )
    return rows


def compare(samples: pd.DataFrame) -> pd.DataFrame:
    """Each path's rows next to the per-method path's for the same method and sample: same prefill
    bytes, same output tokens (None where either failed), and kl_mean's difference."""
    base = {(r.method, r.sample): r for r in samples[samples.path == PER_METHOD].itertuples()}
    same_bytes, same_tokens, kl_diff = [], [], []
    for row in samples.itertuples():
        other = base.get((row.method, row.sample))
        ok = other is not None and row.output_ids is not None and other.output_ids is not None
        same_bytes.append(bool(row.kv_bytes_prefill == other.kv_bytes_prefill) if ok else None)
        same_tokens.append(bool(list(row.output_ids) == list(other.output_ids)) if ok else None)
        kl_diff.append(
            float(row.kl_mean) - float(other.kl_mean)
            if ok and pd.notna(row.kl_mean) and pd.notna(other.kl_mean)
            else None
        )
    return samples.assign(
        same_prefill_bytes_as_per_method=pd.array(same_bytes, dtype="boolean"),
        same_tokens_as_per_method=pd.array(same_tokens, dtype="boolean"),
        kl_mean_minus_per_method=pd.array(kl_diff, dtype="Float64"),
    )


def _spread(values: pd.Series) -> str:
    return f"{values.median():.2f}x [{values.min():.2f}, {values.max():.2f}]"


def render(table: pd.DataFrame) -> str:
    """The README block: per path the median seconds; the paired per-round speedups with their spread
    over rounds (min, max) and n; the checks that the paths compute the same thing."""
    from kvbench.report.render import markdown_table

    rounds = table[table.record == "round"]
    samples = table[table.record == "sample"]
    paths = [p for p in PATHS if p in set(rounds.path)]
    n = rounds["round"].nunique()
    first = rounds.iloc[0]
    per_path = (
        rounds.groupby("path")[["wall_s", "cpu_s", "prefill_s", "fork_s", "decode_s", "decode_steps", "row_steps"]]
        .median()
        .reindex(paths)
    )
    per_path = per_path.rename(
        columns={
            "wall_s": "wall s",
            "cpu_s": "CPU s",
            "prefill_s": "prefill s",
            "fork_s": "fork s",
            "decode_s": "decode s",
            "decode_steps": "forward passes",
            "row_steps": "row-steps",
        }
    ).rename_axis("path (median over rounds)")
    wall = rounds.pivot(index="round", columns="path", values="wall_s")
    cpu = rounds.pivot(index="round", columns="path", values="cpu_s")
    ratios = [
        (PER_METHOD, SHARED, "the quality stage's gain (both levers)"),
        (PER_METHOD, SHARED_ONE_ROW, "the shared prefill alone"),
        (SHARED_ONE_ROW, SHARED, "the batched decode alone"),
    ]
    speedups = pd.DataFrame(
        [
            {
                "speedup": f"{a} / {b}",
                "what": what,
                "wall: median [min, max]": _spread(wall[a] / wall[b]),
                "CPU: median [min, max]": _spread(cpu[a] / cpu[b]),
                "rounds": n,
            }
            for a, b, what in ratios
            if a in wall and b in wall
        ]
    )
    pairs = samples[samples.path == PER_METHOD]
    lines = [
        f"{int(first.samples)} samples ({int(first.prompt_tokens)} prompt tokens) x {int(first.methods)} methods, "
        f"query-aware, {n} rounds interleaved (order rotated), {int(first.threads)} threads; one process.",
        "",
        markdown_table(per_path.reset_index()),
        "",
        markdown_table(speedups),
        "",
        f"Checks over {len(pairs)} method x sample pairs (each path's first timed round against the per-method "
        "path's):",
    ]
    for path in paths[1:]:
        mine = samples[samples.path == path]
        kl = mine.kl_mean_minus_per_method.abs().dropna()
        lines.append(
            f"- {path}: bytes after the prefill equal in {int(mine.same_prefill_bytes_as_per_method.sum())}"
            f"/{len(mine)}, same output tokens in {int(mine.same_tokens_as_per_method.sum())}/{len(mine)}, "
            f"max |kl_mean difference| {kl.max() if len(kl) else float('nan'):.3g} over {len(kl)} rows"
            + (
                " (expected: all equal, difference 0: one row per pass on both paths, the same arithmetic)"
                if path == SHARED_ONE_ROW
                else " (expected: bytes equal; tokens and KL may part by the batch's "
                "rounding: a projection over many rows sums in another order)"
            )
        )
    errors = samples[samples.error.notna()]
    lines.append(
        f"- errors: {', '.join(f'{r.path} {r.method} {r.sample}: {r.error}' for r in errors.itertuples())}"
        if len(errors)
        else "- errors: none on any path"
    )
    unstable = [f"{r.path} {r.method} {r.sample}" for r in samples.itertuples() if not r.same_every_round]
    lines.append(f"- same tokens in every round on every path: {'no: ' + ', '.join(unstable) if unstable else 'yes'}")
    return "\n".join(lines)


BLOCKS = {"shared-prefill": Block(render, ("bench/shared_prefill.parquet",), make="make bench-prefill")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "config" / "config.yaml"))
    parser.add_argument("--tasks", help="a quality task folder (default: results/quality/<first quality model>/tasks)")
    parser.add_argument(
        "--build-from",
        type=Path,
        help="build --tasks first from this realistic corpus folder "
        "(docs.parquet, facts.parquet) with the config's quality.tasks",
    )
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", nargs="+", help="keys of methods: (default: the config's quality.methods)")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if PER_METHOD not in args.paths or len(args.paths) < 2:
        parser.error(f"--paths: {PER_METHOD} and at least one other (the comparison is with it)")

    from kvbench.checks import check_config
    from kvbench.config import model_dir
    from kvbench.models import load_model, load_tokenizer
    from kvbench.provenance import provenance, write_table
    from kvbench.quality.adapter import KvbenchLM
    from kvbench.quality.engine import Prompt
    from kvbench.quality.run import max_prompt_tokens

    config = yaml.safe_load(Path(args.config).read_text())
    check_config(config, SCHEMA)
    quality = config["quality"]
    names = args.methods or list(quality["methods"])
    unknown = [m for m in names if m not in config["methods"]]
    if unknown:
        parser.error(f"--methods {', '.join(unknown)}: not a key of methods ({', '.join(config['methods'])})")
    reference = quality["reference"]
    methods = {m: config["methods"][m] for m in [reference, *(m for m in names if m != reference)]}
    model_name = quality["models"][0]
    folder = Path(args.tasks or f"results/quality/{model_name}/tasks")
    if args.build_from:
        build_task_folder(args.build_from, folder, config, model_dir(config, model_name))
    chosen, plain = requests(folder, args.samples)  # before the model loads: a short folder fails fast
    torch.set_num_threads(args.threads)
    seed = int(config["seed"])
    tokenizer = load_tokenizer(model_dir(config, model_name))
    model = load_model(
        model_dir(config, model_name), "real", seed, getattr(torch, quality["compute_dtype"]), quality["device"]
    )
    lm = KvbenchLM(
        model,
        tokenizer,
        methods,
        seed=seed,
        max_gen_cap=int(quality["max_gen_cap"]),
        max_prompt_tokens=max_prompt_tokens(quality, model),
        plain_tasks=plain,
    )
    prompts = [lm._prepare(request) for request in chosen]  # the adapter's truncation, template, stop, length
    common = {
        "seed": seed,
        "reference": reference,
        "fidelity_positions": quality["fidelity_positions"],
        "prompts_per_batch": int(quality["prompts_per_batch"]),
    }
    runs = {
        PER_METHOD: (per_method, common),
        SHARED: (shared, {**common, "max_rows": int(quality["max_rows"])}),
        SHARED_ONE_ROW: (shared, {**common, "max_rows": 1}),
    }
    runs = {p: runs[p] for p in PATHS if p in args.paths}
    print(
        f"{len(prompts)} samples ({', '.join(f'{p.key} {len(p.ids)} tokens' for p in prompts)}) x {len(methods)} "
        f"methods, paths {', '.join(runs)}, {args.rounds} rounds, {args.threads} threads",
        flush=True,
    )

    warm = [Prompt("warm-up", prompts[0].ids[:256], None, 2)]
    for path, (run, settings) in runs.items():
        timed(run, model, warm, methods, settings)
    rows, outputs = [], {}
    for r in range(args.rounds):
        for place, path in enumerate(rotation(list(runs), r)):
            run, settings = runs[path]
            results, seconds = timed(run, model, prompts, methods, settings)
            outputs.setdefault(path, []).append(results)
            rows.append(
                {
                    "record": "round",
                    "round": r,
                    "place": place,
                    "path": path,
                    **seconds,
                    "samples": len(prompts),
                    "methods": len(methods),
                    "prompt_tokens": sum(len(p.ids) for p in prompts),
                    "threads": args.threads,
                }
            )
            print(
                f"round {r} {path}: {seconds['wall_s']:.1f} s wall, {seconds['cpu_s']:.1f} s CPU (prefill "
                f"{seconds['prefill_s']:.1f}, forks {seconds['fork_s']:.1f}, decode {seconds['decode_s']:.1f} s in "
                f"{seconds['decode_steps']} passes, {seconds['row_steps']} row-steps)",
                flush=True,
            )
    rows += sample_rows(outputs, prompts, list(methods))
    table = pd.DataFrame(rows)
    per_sample = table.record == "sample"
    table = pd.concat([table[~per_sample], compare(table[per_sample].reset_index(drop=True))], ignore_index=True)
    bench_config = {
        "seed": seed,
        "bench": "shared_prefill",
        "samples": args.samples,
        "rounds": args.rounds,
        "methods": list(methods),
        "paths": list(runs),
        "threads": args.threads,
        "quality": quality,
        "tasks": str(folder),
    }
    write_table(table, args.out, provenance(bench_config, model=model_name))
    print(f"\n{render(table)}\n\nwrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
