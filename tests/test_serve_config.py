"""Serve settings the schema cannot judge are refused at parse time, naming the key."""

import pytest

from kvbench.checks import check_config
from kvbench.config import ConfigError
from kvbench.serve.backends import server_args, servers, unsupported
from kvbench.tinyrun import REPO, default_config

SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c["serve"].update(codecs=["snapkv"]),
            "serve.codecs: method 'snapkv' (kind snapkv) is not a wire format",
        ),
        (lambda c: c["serve"].update(codecs=["gzip"]), "serve.codecs: 'gzip' is neither a codec"),
        (lambda c: c["serve"].update(hit_miss_ratio="0:0"), "serve.hit_miss_ratio"),
        (lambda c: c["serve"].update(corpora=["imported"]), "serve.corpora: 'imported' needs corpus.imported.path"),
        (
            lambda c: (c["serve"].update(fault_round=True), c["serve"]["valkey"].update(url="redis://10.0.0.1:6379/0")),
            "serve.fault_round: it kills Valkey",
        ),
        (
            lambda c: c["vllm"].update(device="cuda"),
            "serve.backends: 'valkey' (our connector) reads vLLM's CPU cache layout",
        ),
    ],
)
def test_bad_serve_settings_are_refused(edit, message):
    config = default_config()
    edit(config)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(config, SCHEMA)


def test_default_serve_settings_pass_and_need_three_servers_here():
    config = default_config()
    check_config(config, SCHEMA)
    assert servers(config["serve"]["backends"]) == ["main", "example", "fp8", "lmcache"]
    assert servers(["valkey", "recompute", "prefix"]) == ["main"]
    assert unsupported("lmcache", "cpu").startswith("unsupported: LMCache")
    assert unsupported("main", "cpu") is None and unsupported("lmcache", "cuda") is None
    assert server_args("fp8", 256)[-2:] == ["--kv-cache-dtype", "fp8"]
    with pytest.raises(ValueError, match="unknown serve backend 'redis'"):
        servers(["redis"])
