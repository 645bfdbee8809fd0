"""The cluster preflight: what a first GPU run needs, checked in minutes before GPU hours go
(docs/cluster.md). Run it in an allocation of one GPU (`salloc --gpus=1 -t 20`), offline, in the
environment the jobs use (the lock or the image):

    make cluster-preflight CONFIG=config/gpu-smoke.yaml      # every part
    make gpu-preflight                                        # the parts that need no vLLM

Parts: the node (GPU, driver, compute capability, torch's CUDA build), a C compiler and Python.h,
one Triton kernel, the connector's staging copies (with and without the pinned pool) and its wire
code on vLLM-shaped CUDA caches through a real Valkey; then imports of vllm and lmcache.c_ops, our
connector's vLLM server (a stored chunk found again by the next request), a TurboQuant server and
an LMCache server on the config's serve model, one request each; and a one-minute job through the
SLURM profile with its exact flags. Prints a table and writes it (Markdown and JSON) under --out;
exits 1 when a part failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
PROMPT_FILE = REPO / "tests" / "data" / "legal-contract-00.txt"


class Skip(Exception):
    """A part that cannot run here for a reason that is not a failure of the node."""


@dataclass
class Context:
    config: dict[str, Any]
    workdir: Path
    profile: Path
    slurm_args: list[str]
    _model: str | None = None

    def model(self) -> str:
        """The config's serve model as a folder vLLM loads (a prefetched snapshot linked, no download)."""
        if self._model is None:
            from kvbench.hub import link_prefetched

            name = self.config["serve"]["model"]
            source = self.config["models"][name]
            if "path" in source:
                self._model = str(source["path"])
            elif "hub" in source:
                out = self.workdir / "model"
                if not out.exists():
                    link_prefetched(self.config, source["hub"], out)
                self._model = str(out)
            else:
                raise Skip(f"models.{name} is a packaged GGUF: the preflight serves hub or path models")
        return self._model

    def vllm(self) -> dict[str, Any]:
        return {**self.config["vllm"], "device": "cuda", "dtype": self.config["serve"].get("dtype", "bfloat16")}


def prompt(tokens_hint: int = 2000) -> str:
    """A realistic document (the repository's contract text) long enough for several KV blocks."""
    text = PROMPT_FILE.read_text()
    return text[: tokens_hint * 4] + "\n\nQuestion: Who are the parties to this contract? Answer in one sentence."


def cuda_device() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
    return torch.device("cuda")


# ---------------------------------------------------------------- parts without vLLM


def check_gpu(ctx: Context) -> str:
    from kvbench import gpu_env

    gpus = gpu_env.nvidia_smi()
    problems = gpu_env.cuda_problems(
        gpu_env.torch_cuda(),
        [g["driver"] for g in gpus],
        [g["name"] for g in gpus],
        capabilities=[g.get("capability", "") for g in gpus],
    )
    if problems:
        raise RuntimeError("; ".join(problems))
    return gpu_env.describe()


def check_compiler(ctx: Context) -> str:
    from kvbench.gpu_env import toolchain_problems

    if problems := toolchain_problems():
        raise RuntimeError("; ".join(problems))
    cc = shutil.which(os.environ.get("CC") or "gcc") or shutil.which("cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    return f"{version}; Python.h present"


def check_triton(ctx: Context) -> str:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x, y, out, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out + offsets, tl.load(x + offsets, mask=mask) + tl.load(y + offsets, mask=mask), mask=mask)

    device = cuda_device()
    x, y = torch.rand(4096, device=device), torch.rand(4096, device=device)
    out = torch.empty_like(x)
    start = time.perf_counter()
    add[(4,)](x, y, out, 4096, BLOCK=1024)
    torch.cuda.synchronize()
    if not torch.equal(out, x + y):
        raise RuntimeError("the Triton kernel's sum differs from torch's")
    cache = os.environ.get("TRITON_CACHE_DIR", "~/.triton (default)")
    return f"triton {triton.__version__}: compiled and ran in {time.perf_counter() - start:.1f} s; cache {cache}"


def _cuda_caches(device: Any, seed: int) -> list[Any]:
    """Per layer vLLM's CUDA layout: logical [blocks, heads, block, 2 * head] over an NHD tensor."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(4):
        physical = torch.randn(8, 64, 4, 2 * 64, generator=gen).to(torch.bfloat16).to(device)
        layers.append(physical.permute(0, 2, 1, 3))
    return layers


def check_staging(ctx: Context) -> str:
    """Bytes as the CPU path's, with and without the pool, and whether each copy returned before
    it ran with the stream kept busy (the overlap staging.py intends; measured, reported)."""
    import torch

    from kvbench.serve.staging import PinnedPool, copy_in, copy_out

    device = cuda_device()
    want = copy_out(_cuda_caches("cpu", 0), [4, 1]).chunks
    found = []
    for name, pool in (("fresh pinned buffers", None), ("pinned pool", PinnedPool())):
        views = _cuda_caches(device, 0)
        for _ in range(3):  # the pool's buffers come back after the first round
            copy = copy_out(views, [4, 1], pool)
            copy.wait()
            if not all(torch.equal(got, w) for got, w in zip(copy.chunks, want)):
                raise RuntimeError(f"copy_out ({name}) landed other bytes than the CPU path")
            copy.release()
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of a busy stream
        copy = copy_out(views, [4, 1], pool)
        out_early = not copy.event.query()
        copy_in(want, views, [6, 7], pool)
        in_early = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        copy.release()
        if not torch.equal(views[0][6].cpu(), want[0][0]):
            raise RuntimeError(f"copy_in ({name}) wrote other bytes")
        allocations = f", {pool.allocations} allocations" if pool else ""
        found.append(f"{name}: out returned early {out_early}, in returned early {in_early}{allocations}")
    return "; ".join(found)


def check_connector_wire(ctx: Context) -> str:
    import torch

    from kvbench.serve import layout
    from kvbench.serve.keys import chunk_keys, namespace
    from kvbench.serve.transfer import gather, load_chunks, store_chunks
    from kvbench.serve.valkey_server import valkey_server
    from kvbench.serve.wire import ChunkSpec, wire_format

    device = cuda_device()
    spec = ChunkSpec(4, 4, 64, 64, torch.bfloat16, layout.TOKEN_ROWS)
    out = []
    with valkey_server(256, ctx.workdir / "wire-valkey.log") as server:
        client = server.client()
        for codec, method in (
            ("zstd-3+byteplane", None),
            ("kivi4", {"kind": "kivi", "bits": 4, "group_size": 32, "residual": 128}),
        ):
            wire = wire_format(codec, spec, method, seed=0) if method else wire_format(codec, spec)
            keys = chunk_keys(
                namespace("preflight", "m", "bfloat16", 64, codec, layout.TOKEN_ROWS), list(range(129)), 64, 2
            )
            source, target = _cuda_caches(device, 1), _cuda_caches(device, 2)
            stored = store_chunks(client, wire, spec, keys, gather(source, [3, 0]))
            loaded = load_chunks(client, wire, spec, keys, [1, 5], target)
            torch.cuda.synchronize()
            if stored["error"] or loaded["error"] or loaded["loaded_chunks"] != 2:
                raise RuntimeError(f"{codec}: store {stored['error']}, load {loaded['error']}")
            if method is None and not all(torch.equal(t[1], s[3]) for t, s in zip(target, source)):
                raise RuntimeError(f"{codec}: lossless chunks came back changed")
            out.append(f"{codec} {stored['wire_bytes'] / stored['raw_bytes']:.3f} of raw")
    return "round trips through Valkey: " + ", ".join(out)


# ---------------------------------------------------------------- parts with vLLM


def check_imports(ctx: Context) -> str:
    import importlib

    found = []
    for module in ("vllm", "lmcache.c_ops"):  # lmcache's compiled ops: torch's C++ ABI (docs/cluster.md)
        importlib.import_module(module)
        top = importlib.import_module(module.split(".")[0])
        found.append(f"{module} ({top.__name__} {getattr(top, '__version__', '?')})")
    return "imported " + ", ".join(found)


def _serve(ctx: Context, backend: str) -> Any:
    from kvbench.serve.standalone import standalone

    logs = ctx.workdir / backend
    logs.mkdir(parents=True, exist_ok=True)
    return standalone(backend, "zstd-3", ctx.model(), ctx.vllm(), int(ctx.config["serve"]["block_size"]), str(logs))


def _ask(client: Any) -> str:
    answer = client.chat([{"role": "user", "content": prompt()}], max_tokens=16, temperature=0)
    return answer["choices"][0]["message"]["content"]


def check_server_valkey(ctx: Context) -> str:
    """Our connector on CUDA: a request stores its chunks, the same request again loads them."""
    from kvbench.serve.async_store import pending
    from kvbench.serve.metrics import delta, scrape

    with _serve(ctx, "valkey") as up:
        first = _ask(up.client)
        start = time.monotonic()
        store = up.store.client()
        while pending(store, up.pending_key()) and time.monotonic() - start < 60:
            time.sleep(0.1)
        landed = time.monotonic() - start
        before = scrape(up.client.base_url)
        second = _ask(up.client)
        hits = delta(before, scrape(up.client.base_url)).get("external_prefix_cache_hits", 0)
        mode = up.client.engine_mode(ctx.vllm())
    if hits <= 0:
        raise RuntimeError(f"the second request loaded nothing from Valkey (stores landed after {landed:.1f} s)")
    same = "the same answer" if first == second else "a different answer"
    return f"{int(hits)} tokens loaded from Valkey, {same}; stores landed {landed:.1f} s after the first; {mode}"


def check_server_turboquant(ctx: Context) -> str:
    from kvbench.serve.backends import served_block_size

    with _serve(ctx, "vllm-turboquant-4bit") as up:
        answer = _ask(up.client)
    block = served_block_size("vllm-turboquant-4bit", int(ctx.config["serve"]["block_size"]))
    if not answer.strip():
        raise RuntimeError("turboquant_4bit_nc answered nothing")
    return f"turboquant_4bit_nc at block {block} answered {answer.strip()[:40]!r}"


def check_server_lmcache(ctx: Context) -> str:
    from kvbench.serve.backends import lmcache_chunks, require_lmcache_store

    with _serve(ctx, "lmcache") as up:
        _ask(up.client)
        start, stored = time.monotonic(), 0
        while not (stored := lmcache_chunks(up.store.client())) and time.monotonic() - start < 60:
            time.sleep(0.5)
        require_lmcache_store(ctx.workdir / "lmcache" / "vllm.log", stored)
    return f"LMCache stored {stored} chunks in Valkey over resp://"


def check_sbatch(ctx: Context) -> str:
    """One short job through the SLURM profile, submitted by the real executor plugin."""
    snakemake = shutil.which("snakemake") or str(Path(sys.executable).with_name("snakemake"))
    folder = ctx.workdir / "sbatch"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [snakemake, "-s", str(REPO / "workflow" / "preflight" / "Snakefile"), "-d", str(folder),
           "--workflow-profile", str(ctx.profile), "--retries", "0", *ctx.slurm_args]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        tail = "\n".join((done.stderr + done.stdout).strip().splitlines()[-6:])
        raise RuntimeError(f"the profile's job failed:\n{tail}")
    return "ran: " + (folder / "preflight-job.txt").read_text().strip().replace("\n", "; ")


# name -> (needs vLLM, check)
PARTS: dict[str, tuple[bool, Callable[[Context], str]]] = {
    "gpu": (False, check_gpu),
    "compiler": (False, check_compiler),
    "triton": (False, check_triton),
    "staging": (False, check_staging),
    "connector-wire": (False, check_connector_wire),
    "imports": (True, check_imports),
    "server-valkey": (True, check_server_valkey),
    "server-turboquant": (True, check_server_turboquant),
    "server-lmcache": (True, check_server_lmcache),
    "sbatch": (True, check_sbatch),
}


def run_parts(ctx: Context, names: list[str], log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        log(f"preflight: {name} ...")
        start = time.monotonic()
        try:
            status, detail = "pass", PARTS[name][1](ctx)
        except Skip as why:
            status, detail = "skip", str(why)
        except Exception as err:  # every part runs and reports, whatever the others did
            status, detail = "fail", f"{type(err).__name__}: {err}"
            (ctx.workdir / f"{name}.traceback.txt").write_text(traceback.format_exc())
        rows.append({"part": name, "status": status, "seconds": round(time.monotonic() - start, 1), "detail": detail})
        log(f"preflight: {name}: {status} ({detail.splitlines()[0] if detail else ''})")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| part | status | s | detail |", "|---|---|---|---|"]
    lines += [
        f"| {r['part']} | {r['status']} | {r['seconds']} | {r['detail'].replace(chr(10), ' / ').replace('|', '/')} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--configfile", nargs="+", default=["config/gpu-smoke.yaml"])
    parser.add_argument("--profile", default=str(REPO / "workflow" / "profiles" / "slurm"))
    parser.add_argument("--parts", default="all", help="all, no-vllm, or a comma list of: " + ", ".join(PARTS))
    parser.add_argument("--slurm-args", default="", help="more snakemake options for the sbatch part (quoted)")
    parser.add_argument("--out", default="results/preflight")
    args = parser.parse_args(argv)
    from kvbench.config import load_configfiles, with_schema_defaults
    from kvbench.hub import hub_env

    config = with_schema_defaults(load_configfiles(args.configfile))
    os.environ.update(hub_env(config))  # offline, from the prefetched cache, as the jobs run
    if args.parts == "all":
        names = list(PARTS)
    elif args.parts == "no-vllm":
        names = [n for n, (vllm, _) in PARTS.items() if not vllm]
    else:
        names = args.parts.split(",")
        if unknown := [n for n in names if n not in PARTS]:
            parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="preflight-", dir=out))
    ctx = Context(config, workdir, Path(args.profile), args.slurm_args.split())
    rows = run_parts(ctx, names)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    host = platform.node() or "host"
    report = f"# kvbench preflight on {host}, {stamp}\n\nconfig: {' '.join(args.configfile)}; logs: {workdir}\n\n{table(rows)}\n"
    (out / f"preflight-{host}-{stamp}.md").write_text(report)
    (out / f"preflight-{host}-{stamp}.json").write_text(json.dumps(rows, indent=1))
    print("\n" + table(rows))
    counts = {status: [r["part"] for r in rows if r["status"] == status] for status in ("pass", "fail", "skip")}
    print(
        f"\npreflight: {len(counts['pass'])} parts passed, {len(counts['fail'])} failed, {len(counts['skip'])} skipped"
    )
    if counts["fail"]:
        print(f"preflight: failed: {', '.join(counts['fail'])} (tracebacks in {workdir})")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
