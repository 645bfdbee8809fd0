"""The compiled kernels (`lut_kernels.c`: decode, and the encode side's codes and packing): built
on first use with the host's C compiler for the CPU it runs on, cached, loaded with ctypes. No
torch import here: provenance reports `status()`.

The build is keyed by the source, the compiler, its flags and the CPU's feature flags, so a cache
directory shared between machines (a cluster's home) never hands one CPU another's binary.
Without a compiler, without AVX2 or AVX-512, or with KVBENCH_NATIVE_KERNELS=0, methods fall back to
their torch path, which computes the same values; `status()` says which one a process uses.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from functools import lru_cache
from pathlib import Path

SOURCE = Path(__file__).with_name("lut_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# (groups, tokens, rows, dim, layout, bits, packed, signs, values, query|weights, span|cols, out, threads)
_DECODE = [_I64, _I64, _I64, _I64, _INT, _INT, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _INT]
SIGNATURES = {
    "level_dots": _DECODE,
    "level_sums": _DECODE,
    "count_below": [_I64, _PTR, _PTR, _INT, _PTR, _INT],  # (n, x, edges, n_edges, out, threads)
    "pack_codes": [_I64, _PTR, _INT, _PTR, _INT],  # (n, codes, bits, out, threads)
}
OK, UNSUPPORTED, NO_MEMORY = 0, -1, -2  # the kernels' return codes
# What the kernel calls of this process did: "native", or the reason they ran in torch instead.
CALLS: Counter[str] = Counter()


def cache_dir() -> Path:
    if os.environ.get("KVBENCH_KERNEL_CACHE"):
        return Path(os.environ["KVBENCH_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvbench" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler() -> tuple[str, str]:
    """(path, version line) of the C compiler ($CC or cc); raises OSError if there is none."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise OSError(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    return cc, version.split("\n", 1)[0].strip()


def _flags() -> tuple[str, ...]:
    """FLAGS plus KVBENCH_KERNEL_FLAGS (e.g. `-mno-avx512f`: tests build the AVX2 path on an AVX-512 CPU)."""
    return FLAGS + tuple(os.environ.get("KVBENCH_KERNEL_FLAGS", "").split())


def _build(cc: str, key: str) -> Path:
    target = cache_dir() / f"lut_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        run = subprocess.run(
            [cc, *_flags(), str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=300
        )
        if run.returncode:
            raise OSError(f"{cc} failed ({run.returncode}): {run.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same file
    return target


def _mapped_file(address: int) -> str | None:
    """The file mapped at `address` in this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5] if len(fields) > 5 else None
    return None


def _shares_torch_openmp(library: ctypes.CDLL) -> bool:
    """Whether the kernels' OpenMP runtime is the one torch runs (found by soname, so not a given:
    a torch on another runtime would put two thread pools on the same cores)."""
    try:
        ours = _mapped_file(ctypes.cast(library.omp_get_max_threads, ctypes.c_void_p).value)
        with open("/proc/self/maps") as maps:
            torch_dir = next(
                (Path(f).parent for f in (line.split()[-1] for line in maps) if f.endswith("libtorch_cpu.so")), None
            )
    except (AttributeError, OSError, ValueError):
        return False
    return ours is not None and torch_dir is not None and Path(ours).parent == torch_dir


_LOADING = threading.Lock()  # background threads (the serve stage's stores) may load them first


def _load() -> tuple[ctypes.CDLL | None, str, bool]:
    with _LOADING:
        return _load_once()


@lru_cache(maxsize=1)
def _load_once() -> tuple[ctypes.CDLL | None, str, bool]:
    if os.environ.get("KVBENCH_NATIVE_KERNELS", "1") == "0":
        return None, "torch (native kernels off: KVBENCH_NATIVE_KERNELS=0)", False
    try:
        cc, version = _compiler()
        key = hashlib.sha256(
            "\n".join([SOURCE.read_text(), " ".join(_flags()), version, platform.machine(), _cpu_flags()]).encode()
        ).hexdigest()[:16]
        library = ctypes.CDLL(str(_build(cc, key)))
    except (OSError, subprocess.SubprocessError) as error:
        print(f"kvbench: native kernels unavailable, using the torch path: {error}", file=sys.stderr)
        return None, f"torch (native kernels unavailable: {str(error)[:200]})", False
    isa = library.kernel_isa()
    if not isa:
        return None, "torch (native kernels need AVX2 or AVX-512; this CPU has neither)", False
    for name, signature in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = signature, _INT
    shared = _shares_torch_openmp(library)
    threads = "torch's threads" if shared else "1 thread: its OpenMP runtime is not torch's"
    flags = " ".join(_flags()[:3] + _flags()[5:])
    return library, f"native {'AVX-512' if isa == 512 else 'AVX2'} ({version}, {flags}, {threads})", shared


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built (callers use their torch path)."""
    return _load()[0]


def threads(wanted: int) -> int:
    """Threads for a kernel call: torch's count when both share one OpenMP runtime, else 1."""
    return wanted if _load()[2] else 1


def status() -> str:
    """Which kernels this process has, and what its decode kernel calls did, for provenance."""
    if not CALLS:
        return f"{_load()[1]}; no kernel calls"
    return f"{_load()[1]}; kernel calls: " + ", ".join(f"{n} {what}" for what, n in sorted(CALLS.items()))
