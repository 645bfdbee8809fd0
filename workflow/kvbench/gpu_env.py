"""The GPU environment: one CUDA major for every pinned wheel (envs/gpu.txt, its lock
envs/gpu.lock.txt), the driver that major needs, and the check every GPU job makes before it
touches the device.

torch, vLLM and LMCache wheels from PyPI each bundle or link one CUDA runtime major; a driver older
than that major's floor, or a torch built for another major, fails late and obscurely (no
device, or "undefined symbol" from a compiled extension). A job refuses to start instead, naming
what it found and what it needs. Torch-free: torch's CUDA build is read from its version file.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

CUDA_MAJOR = 13
# Minimum Linux driver per CUDA major (NVIDIA's CUDA toolkit release notes, table 3: the driver
# shipped with the major's first release; minor-version compatibility keeps it for the major).
DRIVER_FLOOR = {12: "525.60.13", 13: "580.65.06"}
# The oldest GPU architecture each CUDA major builds for: CUDA 13 dropped Maxwell, Pascal and Volta
# (sm_50 to sm_72), so torch's and vLLM's cu130 kernels start at Turing (sm_75).
MIN_CAPABILITY = {12: (5, 0), 13: (7, 5)}
# FP8 tensor cores (Ada, Hopper and later). Below, transformers loads an FP8 checkpoint dequantized
# to 16 bits without a word: twice the weight bytes the resources formula counts.
FP8_CAPABILITY = (8, 9)
# Lock entries that name another major on purpose: nvidia-cutlass-dsl always pulls its cu12
# libraries next to the cu13 ones its [cu13] extra adds, and picks by the runtime it finds.
OTHER_MAJOR_OK = {"nvidia-cutlass-dsl-libs-cu12"}


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def lock_majors(lock_text: str) -> dict[str, int]:
    """CUDA major of every locked package that names one: `*-cu13`, `cupy-cuda13x`, or a CUDA
    package versioned by the toolkit (cuda-toolkit, cuda-bindings, cuda-python, nvidia-cuda-runtime)."""
    found = {}
    for name, version in re.findall(r"^([A-Za-z0-9_.\-\[\],]+)==(\S+)", lock_text, flags=re.M):
        name = re.sub(r"\[.*\]", "", name).lower()
        if m := re.search(r"-cu(\d+)$", name) or re.fullmatch(r"cupy-cuda(\d+)x", name):
            found[name] = int(m.group(1))
        elif name in ("cuda-toolkit", "cuda-bindings", "cuda-python", "nvidia-cuda-runtime"):
            found[name] = version_tuple(version)[0]
    return found


def lock_problems(lock_text: str, major: int = CUDA_MAJOR) -> list[str]:
    return [
        f"{name}: CUDA {found}, not {major}"
        for name, found in sorted(lock_majors(lock_text).items())
        if found != major and name not in OTHER_MAJOR_OK
    ]


def cuda_problems(
    torch_cuda: str | None,
    drivers: Iterable[str],
    gpus: Iterable[str],
    major: int = CUDA_MAJOR,
    capabilities: Iterable[str] = (),
    fp8: bool = False,
) -> list[str]:
    """Why this machine cannot run the GPU environment (empty: it can). `torch_cuda` is
    torch.version.cuda (None: a CPU build), `drivers` the driver version of each visible GPU,
    `capabilities` their compute capabilities in the same order (`8.0`; others are skipped), `fp8`
    whether the job loads an FP8 checkpoint into the transformers harness."""
    drivers, gpus = list(drivers), list(gpus)
    found = []
    if not gpus:
        found.append("no NVIDIA GPU visible (nvidia-smi lists none): this job asks for the cuda device")
    if torch_cuda is None:
        found.append(f"torch is a CPU build: install the GPU environment (envs/gpu.lock.txt, CUDA {major})")
    elif version_tuple(torch_cuda)[0] != major:
        found.append(
            f"torch is built for CUDA {torch_cuda}, the GPU environment for CUDA {major} "
            "(install envs/gpu.lock.txt or use the container)"
        )
    floor = DRIVER_FLOOR[major]
    for driver in sorted(set(drivers)):
        if version_tuple(driver) < version_tuple(floor):
            found.append(
                f"NVIDIA driver {driver} is older than {floor}, the least CUDA {major} "
                "runs on: ask the site for a newer driver or use a node that has one"
            )
    least = MIN_CAPABILITY[major]
    for name, cap in sorted(set(zip(gpus, capabilities))):
        if not re.fullmatch(r"\d+\.\d+", cap):  # an older nvidia-smi: [N/A] or nothing
            continue
        have = version_tuple(cap)[:2]
        if have < least:
            found.append(
                f"{name} has compute capability {cap}; CUDA {major}'s kernels start at {least[0]}.{least[1]}: "
                "pick a newer gpu_model"
            )
        elif fp8 and have < FP8_CAPABILITY:
            found.append(
                f"{name} (compute capability {cap}) has no FP8: transformers would load this FP8 checkpoint "
                "dequantized to 16 bits (twice the weight memory the resources formula asks for, while the "
                f"rows would say fp8): use a GPU of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} "
                "or more (L40S, H100, H200) or the model's 16-bit checkpoint"
            )
    return found


def toolchain_problems(which: Any = shutil.which, include: str | None = None) -> list[str]:
    """What vLLM on CUDA compiles with at run time and this machine lacks: Triton builds its kernel
    launcher with a C compiler against Python.h at the first kernel, FlashInfer JIT-compiles its
    sampler at start-up."""
    found = []
    compiler = os.environ.get("CC") or "gcc"
    if which(compiler) is None and which("cc") is None:
        found.append(
            f"no C compiler ({compiler}, cc) on PATH: Triton compiles its launcher at the first kernel "
            "(install build-essential; envs/gpu.def does)"
        )
    header = Path(include or sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        found.append(f"{header} is missing: Triton's launcher needs the Python headers (python3-dev)")
    return found


def torch_cuda() -> str | None:
    """torch.version.cuda without importing torch (its version.py)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    text = (Path(spec.origin).parent / "version.py").read_text()
    match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, flags=re.M)
    return match.group(1) if match else None


@lru_cache(maxsize=1)
def nvidia_smi() -> list[dict[str, str]]:
    """name, driver_version and compute_cap of each visible GPU (empty without nvidia-smi or a GPU)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [
        dict(zip(("name", "driver", "capability"), (p.strip() for p in line.rsplit(",", 2))))
        for line in out.splitlines()
        if line.strip()
    ]


def describe() -> str:
    """For provenance: GPUs, compute capability, driver and torch's CUDA build, e.g. '1x NVIDIA
    H200 (sm 9.0), driver 580.95.05, torch CUDA 13.0'; 'no GPU' without one."""
    gpus = nvidia_smi()
    if not gpus:
        return "no GPU"
    drivers = ",".join(sorted({g["driver"] for g in gpus}))
    cap = gpus[0].get("capability")
    return (
        f"{len(gpus)}x {gpus[0]['name']}{f' (sm {cap})' if cap else ''}, driver {drivers}, "
        f"torch CUDA {torch_cuda() or 'none (CPU build)'}"
    )


# A login node's CUDA toolkit (a `module load cuda`) reaches the jobs through sbatch's --export=ALL:
# its runtime libraries on LD_LIBRARY_PATH come before the wheels' own (torch's RUNPATH is searched
# after it), so a CUDA 12 toolkit would load beside the cu130 wheels.
CUDA_HOME_VARS = ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "CUDA_TOOLKIT_ROOT_DIR", "CUDNN_HOME")
TOOLKIT_LIBS = ("libcudart.so", "libcublas.so", "libcudnn.so", "libnvrtc.so")
KEEP_CUDA_ENV = "KVBENCH_KEEP_CUDA_ENV"  # 1: keep them (a site whose toolkit you mean to use)
# Compile caches vLLM, Triton, FlashInfer and torch.compile write, moved from $HOME (shared by every
# job at once over a network filesystem) to node-local scratch. vLLM keeps its torch.compile and
# inductor caches under VLLM_CACHE_ROOT (it overrides TORCHINDUCTOR_CACHE_DIR in its own processes;
# the variable still moves the harness jobs' cache); Triton honours TRITON_CACHE_DIR; FlashInfer's
# JIT writes under FLASHINFER_WORKSPACE_BASE (default $HOME).
CACHE_VARS = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "VLLM_CACHE_ROOT": "vllm",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "CUDA_CACHE_PATH": "nv-compute",
}


def holds_toolkit(folder: str) -> bool:
    try:
        return any(name.startswith(TOOLKIT_LIBS) for name in os.listdir(folder))
    except OSError:
        return False


def strip_login_cuda(env: dict[str, str]) -> list[str]:
    """Remove a login node's CUDA toolkit from `env` (its *_HOME variables and the LD_LIBRARY_PATH
    entries that hold a CUDA runtime library; the driver's folder holds libcuda, not these, and
    stays). Returns what it removed; nothing with KVBENCH_KEEP_CUDA_ENV=1."""
    if env.get(KEEP_CUDA_ENV) == "1":
        return []
    removed = [f"{var}={env.pop(var)}" for var in CUDA_HOME_VARS if var in env]
    if paths := env.get("LD_LIBRARY_PATH"):
        kept = [p for p in paths.split(os.pathsep) if p and not holds_toolkit(p)]
        dropped = [p for p in paths.split(os.pathsep) if p and holds_toolkit(p)]
        if dropped:
            removed.append(f"LD_LIBRARY_PATH entries {os.pathsep.join(dropped)}")
            if kept:
                env["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
            else:
                env.pop("LD_LIBRARY_PATH")
    return removed


def node_local_caches(env: dict[str, str]) -> dict[str, str]:
    """Each compile cache not already set, under the job's node-local scratch ($SLURM_TMPDIR, else
    $TMPDIR, else /tmp), one folder per user: concurrent jobs on a node share it safely (the caches
    write by atomic rename on a local filesystem), jobs on other nodes never touch it."""
    root = Path(env.get("SLURM_TMPDIR") or env.get("TMPDIR") or "/tmp") / f"kvbench-cache-{os.getuid()}"
    return {var: str(root / sub) for var, sub in CACHE_VARS.items() if var not in env}


class GPUEnvironmentError(RuntimeError):
    pass


def require_gpu_environment(device: Any, fp8: bool = False, compiles: bool = False) -> None:
    """Raise before a job uses `device` when it is CUDA and this machine cannot run the pinned
    CUDA major (no GPU, wrong torch build, driver below the floor, a GPU older than the major's
    kernels; with `fp8`, one without FP8 for an FP8 checkpoint; with `compiles`, no compiler or
    Python headers for vLLM's run-time builds)."""
    if not str(device).startswith("cuda"):
        return
    gpus = nvidia_smi()
    problems = cuda_problems(
        torch_cuda(),
        [g["driver"] for g in gpus],
        [g["name"] for g in gpus],
        capabilities=[g.get("capability", "") for g in gpus],
        fp8=fp8,
    )
    if compiles:
        problems += toolchain_problems()
    if problems:
        raise GPUEnvironmentError("this node cannot run the GPU environment:\n  " + "\n  ".join(problems))


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them (lm_eval, LM-Eval -> lm-eval)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_lines(report: dict[str, Any], requirements: str) -> list[str]:
    """envs/gpu.lock.txt from a `pip install --dry-run --report` of envs/gpu.txt: every resolved
    distribution pinned with the hash of the file pip chose, sorted by name."""
    env = report.get("environment", {})
    lines = [
        "# Generated by `make lock` from envs/gpu.txt: do not edit. pip's resolver (install --dry-run --report,",
        f"# pip {report.get('pip_version', '?')}, PyPI only) for {env.get('sys_platform', '?')} "
        f"{env.get('platform_machine', '?')}, Python {env.get('python_full_version', '?')}; CUDA {CUDA_MAJOR} "
        f"(driver >= {DRIVER_FLOOR[CUDA_MAJOR]}).",
        "# Install: pip install --no-deps --require-hashes -r envs/gpu.lock.txt  (envs/gpu.def builds the container)",
    ]
    pinned = {}
    for item in report["install"]:
        meta, info = item["metadata"], item["download_info"]
        archive = info["archive_info"]
        digest = archive.get("hashes", {}).get("sha256") or archive["hash"].split("=")[1]
        pinned[canonical(meta["name"])] = f"{canonical(meta['name'])}=={meta['version']} \\\n    --hash=sha256:{digest}"
    wanted = {
        canonical(re.split(r"[\[=<>~! ]", line.strip())[0])
        for line in requirements.splitlines()
        if line.strip() and not line.startswith("#")
    }
    missing = wanted - set(pinned)
    if missing:
        raise ValueError(f"the report lacks requirements {sorted(missing)}: was it made from envs/gpu.txt?")
    return lines + [pinned[name] for name in sorted(pinned)]


if __name__ == "__main__":
    import json
    import sys

    report_path, requirements_path = sys.argv[1:3]
    print("\n".join(lock_lines(json.loads(Path(report_path).read_text()), Path(requirements_path).read_text())))


_LEASES: list[Any] = []  # lock files held for the life of the process


def lease_gpus(count: int, available: int, folder: str | Path) -> list[int]:
    """Take `count` of this node's `available` GPUs that no other job holds, by an exclusive lock
    on one file per GPU index in `folder`, held until this process ends (the kernel drops it even
    on SIGKILL). Snakemake counts GPU jobs (`--resources gpu=N`) but does not say which GPU a job
    gets; outside SLURM (which sets CUDA_VISIBLE_DEVICES itself) this picks distinct ones."""
    if available < count:
        raise GPUEnvironmentError(f"this job needs {count} GPU(s); nvidia-smi lists {available} on this node")
    Path(folder).mkdir(parents=True, exist_ok=True)
    taken: list[Any] = []
    for index in range(available):
        if len(taken) == count:
            break
        handle = open(Path(folder) / f"gpu{index}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        handle.write(str(index))
        handle.flush()
        taken.append(handle)
    if len(taken) < count:
        for handle in taken:
            handle.close()
        raise GPUEnvironmentError(
            f"this job needs {count} GPU(s), but {available - len(taken)} of this node's "
            f"{available} are held by other kvbench jobs ({folder}): --resources gpu=N must "
            "not exceed the node's GPU count"
        )
    _LEASES.extend(taken)
    return [int(Path(h.name).stem.removeprefix("gpu")) for h in taken]


def assign_gpus(requested: int, env: dict[str, str] | Any, folder: str | Path | None = None) -> None:
    """Set CUDA_VISIBLE_DEVICES for a job that asks for GPUs, unless a scheduler already did. The
    leases live in /tmp: one node, every kvbench run of this user on it."""
    if requested < 1 or "CUDA_VISIBLE_DEVICES" in env or "SLURM_JOB_ID" in env:
        return
    folder = folder or Path(f"/tmp/kvbench-gpu-leases-{os.getuid()}")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, lease_gpus(requested, len(nvidia_smi()), folder)))
