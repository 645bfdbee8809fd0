"""The GPU environment on paper and the check a GPU job makes (no GPU here: the check's logic runs
on faked nvidia-smi answers and torch builds)."""

from __future__ import annotations

import os
import re

import pytest
import yaml

from kvbench import gpu_env
from kvbench.gpu_env import CUDA_MAJOR, GPUEnvironmentError, cuda_problems, lock_lines, lock_majors, lock_problems
from kvbench.tinyrun import REPO

LOCK = (REPO / "envs" / "gpu.lock.txt").read_text()


def pins(text: str) -> dict[str, str]:
    return {
        re.sub(r"\[.*\]", "", name).lower(): version
        for name, version in re.findall(r"^([A-Za-z0-9_.\-\[\],]+)==(\S+)", text, flags=re.M)
    }


def test_the_lock_pins_every_requirement_at_its_version_with_a_hash():
    wanted = pins((REPO / "envs" / "gpu.txt").read_text())
    locked = pins(LOCK)
    assert {name: locked.get(name) for name in wanted} == wanted
    entries = re.findall(r"^\S+==\S+ \\\n    --hash=sha256:[0-9a-f]{64}$", LOCK, flags=re.M)
    assert len(entries) == len(locked) > len(wanted)  # dependencies too, each hashed


def test_the_locked_packages_agree_on_one_cuda_major():
    majors = lock_majors(LOCK)
    # torch's toolkit, the runtime, lmcache's cupy and cuda-python: each names the major.
    assert {"cuda-toolkit", "nvidia-cuda-runtime", "cupy-cuda13x", "cuda-python"} <= set(majors)
    assert lock_problems(LOCK) == []
    assert {m for name, m in majors.items() if name not in gpu_env.OTHER_MAJOR_OK} == {CUDA_MAJOR}
    assert f"CUDA {CUDA_MAJOR} " in LOCK.splitlines()[1]
    assert "NVIDIA driver >= 580.65.06" in (REPO / "envs/gpu.txt").read_text()


def test_a_lock_mixing_majors_is_refused():
    mixed = LOCK.replace("cupy-cuda13x==", "cupy-cuda12x==").replace("nvidia-nccl-cu13==", "nvidia-nccl-cu12==")
    assert lock_problems(mixed) == ["cupy-cuda12x: CUDA 12, not 13", "nvidia-nccl-cu12: CUDA 12, not 13"]


def test_vllm_torch_and_lmcache_pins_are_the_checked_triple():
    # Checked on the wheels (docs/cluster.md): vllm 0.32.0 pins torch 2.13.0; lmcache 0.5.6's
    # cuda_ops needs c10_cuda_check_implementation(int, char const*, char const*, unsigned, bool),
    # which torch 2.13.0 defines and 2.14.0 (vllm 0.33.0's pin) does not. A bump must recheck.
    locked = pins(LOCK)
    assert (locked["vllm"], locked["torch"], locked["lmcache"]) == ("0.32.0", "2.13.0", "0.5.6")


def test_the_container_installs_the_lock_and_imports_kvbench_from_the_bound_checkout():
    definition = (REPO / "envs" / "gpu.def").read_text()
    # The workflow refuses a kvbench from elsewhere (kvbench.checkout): the image imports the checkout's.
    assert 'export PYTHONPATH="${KVBENCH_CHECKOUT:-$PWD}/workflow' in definition
    assert "envs/gpu.lock.txt /opt/kvbench/gpu.lock.txt" in definition
    installs = [line.strip() for line in definition.splitlines() if "pip install" in line and not line.startswith("#")]
    assert installs == ["python -m pip install --no-cache-dir --no-deps --require-hashes -r /opt/kvbench/gpu.lock.txt"]
    python = re.search(r"^From: python:(\d+\.\d+)", definition, flags=re.M).group(1)
    assert f"Python {python}." in LOCK.splitlines()[1]
    conda = yaml.safe_load((REPO / "envs" / "gpu.yaml").read_text())
    assert f"python={python}" in conda["dependencies"]
    # vLLM on CUDA compiles at run time: the image has a compiler and checks it and Python.h at build
    apt = next(line for line in definition.splitlines() if "apt-get install" in line)
    assert "build-essential" in apt.split() and "gcc --version" in definition and "Python.h" in definition


def test_lock_lines_from_a_report_pin_hash_and_name_missing_requirements():
    report = {
        "pip_version": "26.3",
        "environment": {"sys_platform": "linux", "platform_machine": "x86_64", "python_full_version": "3.11.7"},
        "install": [
            {
                "metadata": {"name": "Torch", "version": "2.13.0"},
                "download_info": {"archive_info": {"hashes": {"sha256": "ab" * 32}}},
            },
            {
                "metadata": {"name": "jieba", "version": "0.42.1"},
                "download_info": {"archive_info": {"hash": "sha256=" + "cd" * 32}},
            },
        ],
    }
    lines = lock_lines(report, "torch==2.13.0\n# a comment\njieba==0.42.1\n")
    assert lines[-2:] == [
        f"jieba==0.42.1 \\\n    --hash=sha256:{'cd' * 32}",
        f"torch==2.13.0 \\\n    --hash=sha256:{'ab' * 32}",
    ]
    assert "linux x86_64, Python 3.11.7" in lines[1]
    with pytest.raises(ValueError, match="lacks requirements \\['vllm'\\]"):
        lock_lines(report, "torch==2.13.0\nvllm==0.32.0\n")


@pytest.mark.parametrize(
    "torch_cuda, drivers, gpus, expected",
    [
        ("13.0", ["580.95.05"], ["NVIDIA H200"], []),
        ("13.0", ["580.65.06"], ["NVIDIA A100"], []),  # the floor itself
        ("12.8", ["580.95.05"], ["NVIDIA H200"], ["torch is built for CUDA 12.8, the GPU environment for CUDA 13"]),
        ("13.0", ["570.172.08"], ["NVIDIA H200"], ["NVIDIA driver 570.172.08 is older than 580.65.06"]),
        ("13.0", ["580.65.5"], ["NVIDIA H200"], ["NVIDIA driver 580.65.5 is older than 580.65.06"]),
        (None, ["580.95.05"], ["NVIDIA H200"], ["torch is a CPU build"]),
        ("13.0", [], [], ["no NVIDIA GPU visible"]),
    ],
)
def test_cuda_problems_name_each_mismatch(torch_cuda, drivers, gpus, expected):
    found = cuda_problems(torch_cuda, drivers, gpus)
    assert len(found) == len(expected) and all(line.startswith(want) for line, want in zip(found, expected)), found


def test_a_gpu_job_is_refused_on_a_mismatched_node_and_cpu_jobs_are_not_checked(monkeypatch):
    monkeypatch.setattr(gpu_env, "nvidia_smi", lambda: [{"name": "NVIDIA H200", "driver": "560.35.03"}])
    monkeypatch.setattr(gpu_env, "torch_cuda", lambda: "13.0")
    with pytest.raises(GPUEnvironmentError, match="NVIDIA driver 560.35.03 is older than 580.65.06"):
        gpu_env.require_gpu_environment("cuda")
    with pytest.raises(GPUEnvironmentError):
        gpu_env.require_gpu_environment("cuda:1")
    gpu_env.require_gpu_environment("cpu")  # no check, no error
    assert gpu_env.describe() == "1x NVIDIA H200, driver 560.35.03, torch CUDA 13.0"


def test_load_model_and_vllm_refuse_cuda_here_before_loading_anything(model_dir):
    # This machine has no GPU (nvidia-smi lists none): the refusal names that, not a torch error.
    from kvbench.models import load_model
    from kvbench.vllm_server import vllm_server

    if gpu_env.nvidia_smi():
        pytest.skip("a GPU is visible")
    with pytest.raises(GPUEnvironmentError, match="no NVIDIA GPU visible"):
        load_model(model_dir, device="cuda")
    with pytest.raises(GPUEnvironmentError, match="no NVIDIA GPU visible"):
        with vllm_server(model_dir, {"device": "cuda"}, 0, "/dev/null"):
            pass


def test_torch_cuda_reads_the_installed_build_without_importing_torch():
    import importlib.metadata
    import subprocess
    import sys

    code = "import sys; from kvbench.gpu_env import torch_cuda; print(torch_cuda()); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    import torch

    assert out == [str(torch.version.cuda), "False"]
    assert "+cpu" in importlib.metadata.version("torch")  # this machine's build: version.cuda is None


def test_a_job_drops_the_hub_token_and_goes_offline_before_anything_else():
    # What every workflow script's first import does, in a process standing for a job: Snakemake's
    # `snakemake` object in __main__, a token in the environment the login node passed on.
    import subprocess
    import sys

    script = (
        "import os, types, __main__\n"
        "__main__.snakemake = types.SimpleNamespace(config={'hf_offline': True}, resources={})\n"
        "import kvbench.jobstart\n"
        "print(os.environ.get('HF_TOKEN'), os.environ.get('HUGGING_FACE_HUB_TOKEN'), os.environ['HF_HUB_OFFLINE'])\n"
    )
    env = {**os.environ, "HF_TOKEN": "hf_secret", "HUGGING_FACE_HUB_TOKEN": "hf_secret", "HF_HUB_OFFLINE": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["None", "None", "1"]


@pytest.mark.parametrize(
    "caps, fp8, expected",
    [
        (["9.0"], True, []),  # H100/H200: FP8
        (["8.9"], True, []),  # L40S
        (["8.0"], False, []),  # A100, a 16-bit checkpoint
        (["8.0"], True, ["NVIDIA X (compute capability 8.0) has no FP8"]),
        (["7.0"], False, ["NVIDIA X has compute capability 7.0; CUDA 13's kernels start at 7.5"]),
        (["[N/A]"], True, []),  # an nvidia-smi that cannot say: nothing to check
    ],
)
def test_old_gpus_and_fp8_checkpoints_without_fp8_are_refused(caps, fp8, expected):
    found = cuda_problems("13.0", ["580.95.05"], ["NVIDIA X"], capabilities=caps, fp8=fp8)
    assert len(found) == len(expected) and all(line.startswith(want) for line, want in zip(found, expected)), found


def test_an_fp8_checkpoint_is_known_by_its_config(tmp_path):
    from kvbench.models import fp8_checkpoint

    (tmp_path / "config.json").write_text(
        '{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}'
    )
    assert fp8_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert not fp8_checkpoint(tmp_path) and not fp8_checkpoint(tmp_path / "absent")


def test_a_node_without_compiler_or_python_headers_is_refused_for_vllm(tmp_path):
    assert gpu_env.toolchain_problems() == []  # this machine builds (gcc, Python.h of this venv's Python)
    found = gpu_env.toolchain_problems(which=lambda name: None, include=str(tmp_path))
    assert [line.split(" ")[0] for line in found] == ["no", str(tmp_path / "Python.h")]


def test_a_login_nodes_cuda_toolkit_is_stripped_and_the_driver_kept(tmp_path):
    toolkit, driver, other = tmp_path / "cuda-12.4" / "lib64", tmp_path / "nvidia" / "lib64", tmp_path / "lib"
    for folder, lib in ((toolkit, "libcudart.so.12"), (driver, "libcuda.so.1"), (other, "libfoo.so")):
        folder.mkdir(parents=True)
        (folder / lib).touch()
    paths = os.pathsep.join(map(str, (toolkit, driver, other)))
    env = {"CUDA_HOME": str(toolkit.parent), "LD_LIBRARY_PATH": paths, "PATH": "/usr/bin"}
    removed = gpu_env.strip_login_cuda(env)
    assert env == {"LD_LIBRARY_PATH": f"{driver}{os.pathsep}{other}", "PATH": "/usr/bin"}
    assert removed == [f"CUDA_HOME={toolkit.parent}", f"LD_LIBRARY_PATH entries {toolkit}"]
    kept = {"CUDA_HOME": "/x", "LD_LIBRARY_PATH": str(toolkit), gpu_env.KEEP_CUDA_ENV: "1"}
    assert gpu_env.strip_login_cuda(kept) == [] and kept["CUDA_HOME"] == "/x"


def test_compile_caches_go_to_node_local_scratch_unless_set():
    caches = gpu_env.node_local_caches({"SLURM_TMPDIR": "/local/job7", "TRITON_CACHE_DIR": "/mine"})
    root = f"/local/job7/kvbench-cache-{os.getuid()}"
    assert "TRITON_CACHE_DIR" not in caches and caches["VLLM_CACHE_ROOT"] == f"{root}/vllm"
    assert set(caches) == set(gpu_env.CACHE_VARS) - {"TRITON_CACHE_DIR"}
    assert gpu_env.node_local_caches({})["TORCHINDUCTOR_CACHE_DIR"] == f"/tmp/kvbench-cache-{os.getuid()}/inductor"


def test_a_gpu_job_reexecutes_itself_without_the_login_nodes_cuda_libraries(tmp_path):
    # The loader read LD_LIBRARY_PATH when the process started: the job's first import re-executes
    # it (same pid) with the toolkit left out, so even torch's first dlopen cannot find it.
    import subprocess
    import sys

    toolkit = tmp_path / "cuda-12.4" / "lib64"
    toolkit.mkdir(parents=True)
    (toolkit / "libcudart.so.12").touch()
    script = (
        "import os, types, __main__\n"
        "print('start', os.getpid(), flush=True)\n"
        "__main__.snakemake = types.SimpleNamespace(config={'hf_offline': True}, resources={'gpu': 1})\n"
        "import kvbench.jobstart\n"
        "loader = dict(e.split('=', 1) for e in open('/proc/self/environ').read().split('\\0') if '=' in e)\n"
        "print('env', loader.get('LD_LIBRARY_PATH'), loader.get('CUDA_HOME'), os.environ['TRITON_CACHE_DIR'])\n"
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(toolkit), "CUDA_HOME": str(toolkit.parent), "SLURM_JOB_ID": "7",
           "SLURM_TMPDIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    starts = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("start")]
    assert len(starts) == 2 and starts[0] == starts[1]  # ran twice, in one process
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("env")]
    assert line.split()[1:] == ["None", "None", f"{tmp_path}/kvbench-cache-{os.getuid()}/triton"]
