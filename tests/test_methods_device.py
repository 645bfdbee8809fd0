"""Every method keeps to the device and dtype of the K/V it receives (config/gpu.yaml runs them on
CUDA): a tiny Llama on the `meta` device, in fp32 and bf16, prefills and decodes through every
config entry's cache (with CaM's decode schedule compressing within the steps run). Any tensor a
method creates on the CPU and mixes with the model's meets a meta tensor and raises; the test
also checks that every tensor the cache holds afterwards is on the model's device."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbench.methods.base import ModelShape, build_cache
from workflow_helpers import default_config

SPECS = default_config()["methods"] | {
    "cam-decode": {"kind": "cam", "window": 8, "kernel": 7, "interval": 3, "target": 200, "buffer": 16},
    "cam-both": {"kind": "cam", "window": 16, "capacity": 250, "interval": 2, "target": 200, "selection": "per_head"},
    "turboquant3-mse": {"kind": "turboquant", "bits": 3, "variant": "mse"},
}
PROMPT, STEPS = 300, 5  # past KIVI's residual (128) and every eviction budget; CaM compresses in decode


def held_tensors(obj: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `obj` through attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from held_tensors(item, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            yield from held_tensors(item, seen)
    elif hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            yield from held_tensors(item, seen)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def meta_model(request) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, attn_implementation="eager")
    return LlamaForCausalLM(config).eval().to(device="meta", dtype=request.param)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_method_runs_on_the_device_and_dtype_of_its_inputs(meta_model, name):
    cache = build_cache(SPECS[name], ModelShape.of(meta_model.config), seed=0)
    handles = cache.attach(meta_model)
    try:
        with torch.inference_mode():
            out = meta_model(input_ids=torch.zeros(1, PROMPT, dtype=torch.long, device="meta"),
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            for position in range(PROMPT, PROMPT + STEPS):
                out = meta_model(input_ids=torch.zeros(1, 1, dtype=torch.long, device="meta"), past_key_values=cache,
                                 use_cache=True, position_ids=torch.tensor([[position]], device="meta"))
    finally:
        for handle in handles:
            handle.remove()
    assert out.logits.device.type == "meta" and out.logits.dtype == meta_model.dtype
    held = list(held_tensors(cache))
    assert held and {t.device.type for t in held} == {"meta"}
    if name.startswith("cam"):  # the decode schedule really compressed (a CaM merge ran on meta)
        assert cache.layers[0].compressions >= 1


def _decode(model: LlamaForCausalLM, name: str, ids: torch.Tensor) -> tuple[list[torch.Tensor], int, set[str]]:
    """Prefill ids[:, :PROMPT], then teacher-force the rest one token a step through `name`'s
    cache: (each step's last-position logits in fp32 on the CPU, the cache's nbytes, the device
    types of everything it holds)."""
    cache = build_cache(SPECS[name], ModelShape.of(model.config), seed=0)
    handles = cache.attach(model)
    ids = ids.to(model.device)
    try:
        with torch.inference_mode():
            out = model(input_ids=ids[:, :PROMPT], past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = [out.logits[0, -1].float().cpu()]
            for position in range(PROMPT, ids.shape[1]):
                out = model(input_ids=ids[:, position:position + 1], past_key_values=cache, use_cache=True,
                            position_ids=torch.tensor([[position]], device=model.device))
                logits.append(out.logits[0, -1].float().cpu())
    finally:
        for handle in handles:
            handle.remove()
    return logits, cache.nbytes(), {t.device.type for t in held_tensors(cache)}


@pytest.fixture(scope="module")
def cpu_and_cuda_models() -> tuple[LlamaForCausalLM, LlamaForCausalLM, torch.Tensor]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on a GPU host: pytest -m cuda)")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, attn_implementation="eager")
    cpu = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    cuda = LlamaForCausalLM(config).eval()
    cuda.load_state_dict(cpu.state_dict())
    return cpu, cuda.cuda(), ids


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_method_on_cuda_computes_what_it_computes_on_the_cpu(cpu_and_cuda_models, name):
    """config/gpu.yaml's path for real: the same random-weight Llama and tokens on the CPU (native
    kernels where built) and on CUDA (the torch path) give every step's logits within float
    tolerance and the same bytes, and the CUDA cache holds nothing on the CPU."""
    cpu, cuda, ids = cpu_and_cuda_models
    want, want_bytes, _ = _decode(cpu, name, ids)
    got, got_bytes, devices = _decode(cuda, name, ids)
    assert devices == {"cuda"} and got_bytes == want_bytes
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3 * float(w.abs().max()), msg=f"{name}, step {step}")
