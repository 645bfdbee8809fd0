"""Cluster resources of each GPU rule from the model it loads and the tokens it runs, and the GPU
hours of a config: the formula every GPU rule's resources come from, for the config it runs
(rule_resources; docs/cluster.md).

    GPU memory  = 2 GiB (CUDA context, allocator) + W + KV + A            [harness jobs]
                = W + KV(vllm.max_model_len) + 2 GiB, within gpu_memory_utilization of the GPU  [vLLM jobs]
      W  = weight bytes: parameters x the checkpoint's bytes per weight (FP8: 1 for the
           transformer blocks, 2 for the embeddings and LM head)
      KV = 2 x layers x kv_heads x head_dim x 2 bytes x tokens x copies
           (copies 2 where a method's cache and the full prefill it starts from coexist)
      A  = one layer's working set of the longest prefill: tokens x (4 hidden + 3 intermediate) x 2 bytes
           (attention through SDPA/flash: linear in tokens; layers run one after another)
    host memory = 2 W + 8 GiB (a safetensors copy while weights move to the GPU; the process)
                  [serve jobs: + the Valkey the job starts (its maxmemory, or the run's bound) + the
                   connector's store queue + LMCache's CPU buffer]
    runtime     = 2 x (starts x startup + prefill tokens x s/token + decode steps x s/step + codec bytes / B/s),
                  at least 30 minutes; startup = a fixed part + W / load B/s (+ compile for a vLLM
                  server without enforce_eager); starts: the servers a job starts one after another
                  (quality_served: the 16-bit server and each native KV cache's)

The per-token costs are STATED: an 8B model in bf16 on an A100/H100-class GPU, scaled by parameter
count (GPU_COST below); replace them with a workflow run's `benchmark:` times on the GPUs used.
bench/gpu_methods.py measured the harness's on an H200 (docs/cluster.md): prefill far faster than
stated, the quantized methods' decode steps slower. Token and job counts come from the config, the same counts the dry run plans.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

GIB = 2**30
OVERHEAD_GIB = 2.0
HOST_BASE_GIB = 8.0
SAFETY = 2.0
MIN_RUNTIME_MIN = 30
WORDS_TO_TOKENS = 1.3  # English words -> Llama/Mistral/Qwen tokens, LongBench's own estimate
# Stated per-token costs of an 8B model (bf16) on one A100/H100-class GPU; scaled by parameters.
GPU_COST = {
    "harness_prefill_s_per_token": 2.5e-4,  # transformers, batch 1: ~4,000 tokens/s
    "harness_decode_s_per_step": 0.04,  # transformers, batch 1, with a method's cache work
    "vllm_prefill_s_per_token": 1.0e-4,  # vLLM: ~10,000 tokens/s
    "vllm_decode_s_per_step": 0.03,  # vLLM: one step of every running sequence
    "harness_startup_s": 30.0,  # imports; + weights at load_bytes_per_s
    "vllm_startup_s": 60.0,  # engine, KV pool; + weights; + vllm_compile_s unless eager
    "vllm_compile_s": 180.0,  # torch.compile and CUDA graph capture
    "load_bytes_per_s": 2e9,  # weights from the shared filesystem to the GPU
    "codec_bytes_per_s": 100e6,  # kv stage: one codec pass over the captured bytes (CPU)
}
# LongBench's English datasets: average words per sample (LongBench paper, table 1).
LONGBENCH_WORDS = {
    "narrativeqa": 18409,
    "qasper": 3619,
    "multifieldqa_en": 4559,
    "hotpotqa": 9151,
    "2wikimqa": 4887,
    "musique": 11214,
    "gov_report": 8734,
    "qmsum": 10614,
    "multi_news": 2113,
    "trec": 5177,
    "triviaqa": 8209,
    "samsum": 6258,
    "passage_count": 11141,
    "passage_retrieval_en": 9289,
    "lcc": 1235,
    "repobench-p": 4206,
}
# The shapes of the config's hub models as their config.json gives them, for before the prefetch
# (afterwards the model folder's config.json is read): parameters counted from the safetensors index.
KNOWN_SHAPES = {
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        params=8.03e9,
        layers=32,
        kv_heads=8,
        head_dim=128,
        hidden=4096,
        intermediate=14336,
        vocab=128256,
        tied=False,
        fp8=False,
        context=131072,
    ),
    "mistralai/Mistral-7B-Instruct-v0.3": dict(
        params=7.25e9,
        layers=32,
        kv_heads=8,
        head_dim=128,
        hidden=4096,
        intermediate=14336,
        vocab=32768,
        tied=False,
        fp8=False,
        context=32768,
    ),
    "Qwen/Qwen3-8B-FP8": dict(
        params=8.19e9,
        layers=36,
        kv_heads=8,
        head_dim=128,
        hidden=4096,
        intermediate=12288,
        vocab=151936,
        tied=False,
        fp8=True,
        context=40960,
    ),
    "Qwen/Qwen3-0.6B": dict(
        params=0.596e9,
        layers=28,
        kv_heads=8,
        head_dim=128,
        hidden=1024,
        intermediate=3072,
        vocab=151936,
        tied=True,
        fp8=False,
        context=40960,
    ),
}


@dataclass(frozen=True)
class Shape:
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool
    fp8: bool
    context: int

    @property
    def weight_bytes(self) -> float:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.params - embeddings) * (1 if self.fp8 else 2) + embeddings * 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def scale(self) -> float:
        """Cost relative to the stated 8B costs."""
        return self.params / 8e9


def shape_from_config_json(hf: Mapping[str, Any], params: float) -> Shape:
    hf = hf.get("text_config", hf)
    heads = hf["num_attention_heads"]
    quant = (hf.get("quantization_config") or {}).get("quant_method", "")
    return Shape(
        params=params,
        layers=hf["num_hidden_layers"],
        kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        hidden=hf["hidden_size"],
        intermediate=hf["intermediate_size"],
        vocab=hf["vocab_size"],
        tied=bool(hf.get("tie_word_embeddings", False)),
        fp8="fp8" in quant,
        context=hf["max_position_embeddings"],
    )


def model_shape(config: Mapping[str, Any], name: str, folder: str | Path | None = None) -> Shape:
    """From the model folder's config.json and safetensors index once they exist, else KNOWN_SHAPES."""
    source = config["models"][name]
    path = Path(folder) if folder else None
    if path is not None and (path / "config.json").is_file() and (path / "model.safetensors.index.json").is_file():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        hf = json.loads((path / "config.json").read_text())
        total = index.get("metadata", {}).get("total_parameters") or index["metadata"]["total_size"] / 2
        return shape_from_config_json(hf, float(total))
    if source.get("hub") in KNOWN_SHAPES:
        return Shape(**KNOWN_SHAPES[source["hub"]])
    raise KeyError(f"models.{name}: no shape known before its folder exists (add it to kvbench.resources.KNOWN_SHAPES)")


@dataclass(frozen=True)
class Work:
    """What one job of a rule does, for the formula."""

    rule: str
    model: str
    jobs: int
    engine: str  # "harness" | "vllm"
    longest: int  # tokens of the longest sequence the job holds
    prefill_tokens: float
    decode_steps: float
    copies: int = 1
    codec_bytes: float = 0.0
    starts: int = 1  # servers (or processes) the job starts one after another, each paying startup


def gpu_bytes(work: Work, shape: Shape, vllm_len: int) -> float:
    if work.engine == "vllm":
        return shape.weight_bytes + shape.kv_bytes_per_token * vllm_len + OVERHEAD_GIB * GIB
    kv = shape.kv_bytes_per_token * work.longest * work.copies
    activations = work.longest * (4 * shape.hidden + 3 * shape.intermediate) * 2  # gate, up and act(gate)*up at once
    return OVERHEAD_GIB * GIB + shape.weight_bytes + kv + activations


def host_bytes(shape: Shape) -> float:
    return 2 * shape.weight_bytes + HOST_BASE_GIB * GIB


def job_seconds(work: Work, shape: Shape, eager: bool = False) -> float:
    """The stated GPU cost of one job, without the safety factor."""
    c = GPU_COST
    kind = work.engine
    startup = c[f"{kind}_startup_s"] + shape.weight_bytes / c["load_bytes_per_s"]
    startup += c["vllm_compile_s"] if kind == "vllm" and not eager else 0.0
    return (
        work.starts * startup
        + shape.scale
        * (work.prefill_tokens * c[f"{kind}_prefill_s_per_token"] + work.decode_steps * c[f"{kind}_decode_s_per_step"])
        + work.codec_bytes / c["codec_bytes_per_s"]
    )


def runtime_minutes(work: Work, shape: Shape, eager: bool = False) -> int:
    return max(MIN_RUNTIME_MIN, math.ceil(SAFETY * job_seconds(work, shape, eager) / 60))


def _quality_work(config: Mapping[str, Any], model: str, shape: Shape) -> tuple[int, float, float]:
    """Longest prompt, prefill tokens and decode steps of one quality job (every sample once)."""
    from kvbench.hub import lm_eval_task
    from kvbench.quality.kinds import dataset_of

    quality = config["quality"]
    budget = quality.get("max_prompt_tokens") or shape.context - 500
    cap = int(quality["max_gen_cap"])
    prefill = decode = 0.0
    longest = 0
    for entry in quality["tasks"].values():
        for tokens in entry["context_tokens"]:
            prefill += entry["samples"] * tokens
            decode += entry["samples"] * min(cap, entry.get("max_gen_tokens", cap))
            longest = max(longest, tokens)
    for task in quality.get("lm_eval_tasks") or []:
        samples = quality.get("lm_eval_limit") or 200
        tokens = min(budget, LONGBENCH_WORDS[dataset_of(task)] * WORDS_TO_TOKENS)
        prefill += samples * tokens
        decode += samples * min(cap, int(lm_eval_task(task)["generation_kwargs"]["max_gen_toks"]))
        longest = max(longest, budget)  # samples reach the budget: LongBench's lengths vary widely
    return int(longest), prefill, decode  # the teacher-forced fidelity pass is one forward: in the margin


def workloads(config: Mapping[str, Any]) -> list[Work]:
    """One entry per (rule, model) of the GPU rules, with the job count the dry run plans."""
    from kvbench.batches import batches, paired_batches

    corpus, kv, system, serve, quality = (config[k] for k in ("corpus", "kv", "system", "serve", "quality"))
    realistic = corpus["realistic"]
    docs = realistic["docs_per_type"] * 3 * len(realistic["domains"])
    # The generator writes each document section by section; each section's prompt is its fact sheet
    # (a few hundred tokens), not the text so far: prefill counted as the output, an upper bound.
    generated = docs * realistic["target_tokens"]
    work = [
        Work(
            "corpus_realistic",
            corpus["generator"],
            1,
            "vllm",
            config["vllm"]["max_model_len"],
            generated,
            generated / max(1, realistic["concurrency"]),
        )
    ]
    kv_model = kv["model"]
    kv_bytes = model_shape(config, kv_model).kv_bytes_per_token * kv["context_tokens"] * kv["docs_per_corpus"]
    work.append(
        Work(
            "kv_capture",
            kv_model,
            len(kv["corpora"]) * len(kv["weights"]),
            "harness",
            kv["context_tokens"],
            kv["docs_per_corpus"] * kv["context_tokens"],
            0,
            codec_bytes=kv_bytes * len(kv["dtypes"]) * len(kv["codecs"]) * 2 * kv["repeats"],
        )
    )
    prompts = sum(system["prompts_per_corpus"].values())
    methods = system.get("methods") or list(config["methods"])
    system_jobs = paired_batches(methods, config["report"]["baseline"], system.get("methods_per_job"))
    per_job = max(len(j) for j in system_jobs)
    for model in system["models"]:
        work.append(
            Work(
                "system_job",
                model,
                len(system_jobs),
                "harness",
                max(system["context_tokens"]) + system["max_new_tokens"],
                per_job * prompts * sum(system["context_tokens"]) * system["repeats"],
                per_job * prompts * len(system["context_tokens"]) * system["max_new_tokens"] * system["repeats"],
                copies=2,
            )
        )
    work += _serve_work(config)
    jobs = batches(quality["methods"], quality["reference"], quality["methods_per_job"])
    for model in quality["models"]:
        longest, prefill, decode = _quality_work(config, model, model_shape(config, model))
        per_method = len(jobs[0])
        work.append(
            Work("quality_reference", model, 1, "harness", longest, prefill * per_method, decode * per_method, copies=2)
        )
        if len(jobs) > 1:
            per_method = max(len(j) for j in jobs[1:])
            work.append(
                Work(
                    "quality_methods",
                    model,
                    len(jobs) - 1,
                    "harness",
                    longest,
                    prefill * per_method,
                    decode * per_method,
                    copies=2,
                )
            )
        served = quality.get("served") or {}
        if served.get("servers"):  # the 16-bit server and each native one: answers, forced positions and
            # decode steps per sample (three prefills, two decodes; the 16-bit server's forced and decode twice)
            n, inflight = len(served["servers"]) + 1, int(served.get("concurrency") or 1)
            work.append(Work("quality_served", model, 1, "vllm", config["vllm"]["max_model_len"],
                             (3 * n + 2) * prefill, (2 * n + 1) * decode / inflight, starts=n))  # fmt: skip
    return work


def serve_requests(config: Mapping[str, Any]) -> dict[str, tuple[int, float, int]]:
    """Per serve server: (requests, decode steps, requests whose chunks pass a codec), from the
    stage's own plan (kvbench.serve.stage.main_cells for the main and dummy-weights servers: warm-ups,
    the concurrency sweep's query rounds per cell, and the fault round; reference_cells for example
    and vLLM-native servers; LMCache's warm-up, query and salted rounds) with the pre-warm; a Valkey
    warm-up stores every codec, a query request loads or stores one."""
    from kvbench.config import with_schema_defaults
    from kvbench.serve.backends import DUMMY_SERVER, server_backends, servers
    from kvbench.serve.stage import ServeSettings, fault_repeats, main_cells, reference_cells

    s = ServeSettings.of(with_schema_defaults({"serve": config["serve"]})["serve"])
    # as many documents as the stage hands each round: reference servers take their own count of them
    n_docs = max(s.docs_per_corpus, s.reference_docs_per_corpus)
    main_docs = {corpus: {f"doc{i}": "" for i in range(s.docs_per_corpus)} for corpus in s.corpora}
    docs = {corpus: {f"doc{i}": "" for i in range(n_docs)} for corpus in s.corpora}
    asides, seed = int(s.prewarm["prompts"]), int(config["seed"])  # the pre-warm every server gets
    out = {}
    for server in servers(list(s.backends), list(s.weights)):
        backends = server_backends(server, list(s.backends))
        if server == "lmcache":  # warm-up, query and salted rounds per corpus
            cells = []
            rounds = [(len(s.corpora) * s.docs_per_corpus * (2 + s.repeat_count), s.max_inflight)]
        else:
            main = server in ("main", DUMMY_SERVER)
            cells = (
                main_cells(server, backends, s, main_docs, seed)
                if main
                else reference_cells(server, backends[0], s, docs, seed)
            )
            # an open-loop round's requests may not overlap: counted as one at a time (an upper bound
            # on its work; the round also lasts at least its arrival schedule, which at low rates
            # and few requests can outlast the work: not counted)
            rounds = [(len(c.planned), 1 if c.rate_rps else c.concurrency) for c in cells]
        faulted = server == "main" and s.fault_round and "valkey" in backends
        fault = s.docs_per_corpus * (2 + fault_repeats(s.docs_per_corpus)) if faulted else 0
        rounds += [(fault, s.max_inflight), (asides, s.max_inflight)]
        coded = fault + sum(len(c.planned) * max(1, len(c.store)) for c in cells if c.backend == "valkey")
        out[server] = (sum(n for n, _ in rounds), sum(n * s.max_tokens / level for n, level in rounds), coded)
    return out


def _serve_work(config: Mapping[str, Any]) -> list[Work]:
    """One serve job per server: every request a prefill of the document (an upper bound: hits
    load), its chunks through a codec where it stores or loads (serve_requests)."""
    serve, vllm_len = config["serve"], config["vllm"]["max_model_len"]
    doc_bytes = model_shape(config, serve["model"]).kv_bytes_per_token * serve["doc_tokens"]
    return [
        Work(
            "serve_server",
            serve["model"],
            1,
            "vllm",
            vllm_len,
            n * serve["doc_tokens"],
            steps,
            codec_bytes=coded * doc_bytes,
        )
        for n, steps, coded in serve_requests(config).values()
    ]


LMCACHE_CPU_BUFFER_MB = (
    5 * 1024
)  # LMCache's pinned CPU buffer (max_local_cpu_size's default), held with its CPU tier off


def serve_host_extra_mb(serve: Mapping[str, Any], shape: Shape) -> int:
    """Host memory a serve job holds beyond its model: the Valkey it starts (a `valkey` or
    `lmcache` backend and no `valkey.url`; its maxmemory, or when that is 0 the stage's own bound
    for the run at 2 bytes a value: kvbench.serve.stage.store_bound_mb), the connector's queue of
    chunk copies, its transient buffers (a store thread holds a request's encoded and sealed chunks,
    ~2 R; a load its replies, decoded chunks and pinned staging, ~4 R, one request at a time in
    the worker's load loop; R a document's KV at 2 bytes a value), and LMCache's CPU buffer where
    it runs."""
    from kvbench.config import with_schema_defaults
    from kvbench.serve.stage import ServeSettings, store_bound_mb

    serve = with_schema_defaults({"serve": serve})["serve"]
    settings = ServeSettings.of(serve)
    valkey = serve.get("valkey") or {}
    own = bool({"valkey", "lmcache"} & set(serve["backends"])) and not valkey.get("url")
    cap = int(valkey.get("maxmemory_mb") or 0) or store_bound_mb(
        settings, shape.kv_bytes_per_token * settings.block_size
    )
    lmcache = LMCACHE_CPU_BUFFER_MB if "lmcache" in serve["backends"] else 0
    store = serve.get("store") or {}
    request = settings.doc_tokens * shape.kv_bytes_per_token
    transient = math.ceil((2 * int(store.get("threads", 1)) + 4) * request / 2**20)
    return (cap if own else 0) + int(store.get("queue_mb", 512)) + transient + lmcache


def profile_resources(config: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Per GPU rule, the largest need over its models: gpu_mem_mb, mem_mb, runtime (minutes)."""
    out: dict[str, dict[str, int]] = {}
    vllm_len = config["vllm"]["max_model_len"]
    for work in workloads(config):
        shape = model_shape(config, work.model)
        extra = serve_host_extra_mb(config["serve"], shape) if work.rule == "serve_server" else 0
        need = {
            "gpu_mem_mb": math.ceil(gpu_bytes(work, shape, vllm_len) / 2**20),
            "mem_mb": math.ceil(host_bytes(shape) / 2**20) + extra,
            "runtime": runtime_minutes(work, shape, config["vllm"]["enforce_eager"]),
        }
        prev = out.get(work.rule, {})
        out[work.rule] = {k: max(v, prev.get(k, 0)) for k, v in need.items()}
    out["kv_memory_probe"] = dict(out["kv_capture"])  # the same model, one 8K prefill
    return out


# The stage whose `device` each GPU rule runs on (common.smk's resources gpu=GPUS[stage]).
RULE_STAGE = {
    "corpus_realistic": "vllm",
    "kv_capture": "kv",
    "kv_memory_probe": "kv",
    "system_job": "system",
    "serve_server": "vllm",
    "quality_reference": "quality",
    "quality_methods": "quality",
    "quality_served": "vllm",
}


def rule_resources(config: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """The resources each rule asks a scheduler for under this config: the formula's gpu_mem_mb,
    mem_mb and runtime for the rules whose stage runs on CUDA (none on CPU: the profile's defaults),
    so a smoke config asks for a smoke config's needs, not config/gpu.yaml's."""
    cuda = {rule for rule, stage in RULE_STAGE.items() if config[stage]["device"] == "cuda"}
    if not cuda:
        return {}
    derived = profile_resources(config)
    return {rule: derived[rule] for rule in cuda if rule in derived}


def cost_table(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """GPU hours per rule and model (jobs x stated cost, one GPU a job): ESTIMATES."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for work in workloads(config):
        shape = model_shape(config, work.model)
        hours = work.jobs * job_seconds(work, shape, config["vllm"]["enforce_eager"]) / 3600
        row = rows.setdefault(
            (work.rule, work.model), {"rule": work.rule, "model": work.model, "jobs": 0, "hours": 0.0}
        )
        row["jobs"] += work.jobs
        row["hours"] += hours
    return [
        {"rule": r["rule"], "model": r["model"], "jobs": r["jobs"], "gpu_hours": round(r["hours"], 2)}
        for r in rows.values()
    ]


if __name__ == "__main__":
    import sys

    import yaml

    loaded = yaml.safe_load(Path(sys.argv[1]).read_text())
    print(yaml.safe_dump(profile_resources(loaded), sort_keys=True))
    print("| rule | model | jobs | GPU-hours (estimate) |\n|---|---|---|---|")
    for row in cost_table(loaded):
        print(f"| {row['rule']} | {row['model']} | {row['jobs']} | {row['gpu_hours']} |")
    print(
        f"| total | | {sum(r['jobs'] for r in cost_table(loaded))} | "
        f"{round(sum(r['gpu_hours'] for r in cost_table(loaded)), 1)} |"
    )
