"""Wire formats on the real CPU cache layout: blocks written by vLLM's own attention kernel."""

import pytest
import torch

from kvbench.kv.codecs import codec_names
from kvbench.methods.base import ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.methods.fp8 import to_fp8_bytes
from kvbench.methods.kivi import QuantizedBlock
from kvbench.methods.turboquant import TurboBlock, lloyd_max
from kvbench.serve import layout
from kvbench.serve.names import check_codec
from kvbench.serve.wire import ChunkSpec, load_blocks, save_blocks, wire_format

ops = pytest.importorskip("vllm._custom_ops")

LAYERS, HEADS, BLOCK, HEAD = 3, 3, 256, 64


def kernel_chunk(dtype=torch.float32, isa="vec", seed=0):
    """K and V token rows of one block per layer, written into block 1 of a paged cache by
    `cpu_attn_reshape_and_cache`; returns (chunk in cache layout, K rows, V rows)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(LAYERS, BLOCK, HEADS, HEAD, generator=gen).to(dtype)
    values = torch.randn(LAYERS, BLOCK, HEADS, HEAD, generator=gen).to(dtype)
    cache = torch.zeros(LAYERS, 3, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
    for layer in range(LAYERS):
        kc, vc = cache[layer].view(3, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[layer], values[layer], kc, vc, torch.arange(BLOCK, 2 * BLOCK), isa)
    return cache[:, 1].clone(), keys.transpose(1, 2), values.transpose(1, 2)


SPEC = ChunkSpec(LAYERS, HEADS, BLOCK, HEAD, torch.float32)
METHODS = {
    "kivi2": {"kind": "kivi", "bits": 2, "group_size": 32},
    "kivi4": {"kind": "kivi", "bits": 4, "group_size": 32},
    "turboquant3": {"kind": "turboquant", "bits": 3},
    "turboquant4": {"kind": "turboquant", "bits": 4},
    "fp8": {"kind": "fp8"},
    "snapkv": {"kind": "snapkv", "keep_ratio": 0.25},
}


# vLLM's `amx` packing kernel runs on CPUs with AMX tiles (bf16 caches there use it)
AMX = pytest.param(
    torch.bfloat16,
    "amx",
    marks=pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles"),
)


def amx_block(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One head's block as vLLM's AMX kernel writes it, element by element from its index formulas
    (csrc/cpu/cpu_attn_amx.hpp, AttentionImpl<ISA::AMX>::reshape_and_cache): K token t, channel c at
    32-bit word (t // 16) * 16 * (head / 2) + (c // 2) * 16 + t % 16, half c % 2 of it; V at element
    (c // 16) * (block * 16) + (t // 2) * 32 + (c % 16) * 2 + t % 2 of the block's second half."""
    block, head = keys.shape
    flat = torch.zeros(2 * block * head)
    for t in range(block):
        for c in range(head):
            flat[2 * ((t // 16) * 16 * (head // 2) + (c // 2) * 16 + t % 16) + c % 2] = keys[t, c]
            flat[block * head + (c // 16) * (block * 16) + (t // 2) * 32 + (c % 16) * 2 + t % 2] = values[t, c]
    return flat.reshape(block, 2 * head)


@pytest.mark.parametrize("block,head", [(32, 32), (64, 96), (32, 128), (128, 64)])
def test_the_amx_layout_follows_the_kernels_index_formulas_on_every_cpu(block, head):
    # the kernel itself runs only on CPUs with AMX (the test below); these formulas run anywhere
    keys = torch.arange(block * head, dtype=torch.float32).reshape(block, head)
    values = -1 - keys
    packed = amx_block(keys, values)
    k, v = layout.split_amx(packed[None])
    assert torch.equal(k[0], keys) and torch.equal(v[0], values)
    assert torch.equal(layout.join_amx(keys[None], values[None])[0], packed)


@pytest.mark.parametrize(
    "dtype,isa",
    [(torch.float32, "vec"), (torch.float16, "vec"), (torch.bfloat16, "vec"), (torch.float32, "vec16"), AMX],
)
def test_layout_unpacks_the_kernels_blocks_to_token_rows(dtype, isa):
    chunk, keys, values = kernel_chunk(dtype, isa)
    name = layout.CPU_ISA_LAYOUTS[isa]
    k, v = layout.SPLIT[name](chunk)
    assert torch.equal(k, keys) and torch.equal(v, values)
    assert torch.equal(layout.JOIN[name](k, v), chunk)


@pytest.mark.parametrize("name", [n for n in codec_names() if "19" not in n])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lossless_codecs_restore_the_exact_bytes(name, dtype):
    chunk, _, _ = kernel_chunk(dtype)
    wire = wire_format(name, ChunkSpec(LAYERS, HEADS, BLOCK, HEAD, dtype))
    data = wire.encode(chunk)
    out = wire.decode(data)
    assert wire.lossless and out.dtype == dtype
    assert torch.equal(out.view(torch.uint8), chunk.view(torch.uint8))
    if name == "none":
        assert len(data) == chunk.numel() * chunk.element_size()


@pytest.mark.parametrize("dtype,isa", [(torch.float32, "vec"), AMX])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_wire_is_kivis_quantizer_on_key_and_value_rows(bits, dtype, isa):
    chunk, keys, values = kernel_chunk(dtype, isa)
    spec = ChunkSpec(LAYERS, HEADS, BLOCK, HEAD, dtype, layout.CPU_ISA_LAYOUTS[isa])
    wire = wire_format(f"kivi{bits}", spec, METHODS[f"kivi{bits}"])
    k, v = layout.SPLIT[spec.layout](wire.decode(wire.encode(chunk)))
    # exactly the method's own blocks: keys per channel over 32 tokens, values per token over 32 channels
    assert torch.equal(k, QuantizedBlock(keys.float(), bits, 32, True).dequantize().to(dtype))
    assert torch.equal(v, QuantizedBlock(values.float(), bits, 32, False).dequantize().to(dtype))
    if dtype != torch.float32:
        return  # the bound below is the fp32 cache's (a 16-bit cache adds its own rounding)
    # and within half a quantization step of each group's range (plus fp16 scale rounding)
    k_range = keys.reshape(LAYERS, HEADS, BLOCK // 32, 32, HEAD)
    k_step = (k_range.amax(3, keepdim=True) - k_range.amin(3, keepdim=True)) / (2**bits - 1)
    k_err = (k - keys).abs().reshape(k_range.shape)
    assert (k_err <= k_step / 2 * 1.01 + 1e-2).all()


@pytest.mark.parametrize("bits", [3, 4])
def test_turboquant_wire_is_the_methods_blocks_with_their_error(bits):
    chunk, keys, values = kernel_chunk()
    spec = METHODS[f"turboquant{bits}"]
    wire = wire_format(f"turboquant{bits}", SPEC, spec, seed=5)
    k, v = layout.split(wire.decode(wire.encode(chunk)))
    # exactly the blocks of the method's own cache for this seed (its quantizers and sketches)
    layers = build_cache(spec, ModelShape(LAYERS, HEADS, HEADS, HEAD), 5).layers
    for i, layer in enumerate(layers):
        expect_k = TurboBlock(keys[i].contiguous(), layer.key_mse, layer.sketch).decode(layer.key_mse, layer.sketch)
        expect_v = TurboBlock(values[i].contiguous(), layer.value_mse, None).decode(layer.value_mse, None)
        assert torch.equal(k[i], expect_k) and torch.equal(v[i], expect_v)
    # values: relative MSE near the Lloyd-Max distortion of N(0,1) at b bits
    rel = ((v - values) ** 2).sum(-1) / (values**2).sum(-1)
    assert rel.mean() == pytest.approx(lloyd_max(bits)[1], rel=0.25)


def test_blocks_travel_as_tensors_and_json_not_code():
    chunk, keys, _ = kernel_chunk()
    block = QuantizedBlock(keys.float(), 2, 32, True)
    data = save_blocks({"k": [block]})
    back = load_blocks(data, {"k": QuantizedBlock})["k"][0]
    assert torch.equal(back.dequantize(), block.dequantize()) and back.shape == block.shape
    assert b"pickle" not in data and len(data) < block.nbytes() + 1024


def test_fp8_wire_is_the_methods_cast():
    chunk, _, _ = kernel_chunk()
    wire = wire_format("fp8", SPEC, METHODS["fp8"])
    data = wire.encode(chunk)
    assert len(data) == chunk.numel()
    assert torch.equal(wire.decode(data), to_fp8_bytes(chunk).view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_wire_tables_are_the_cast_for_every_16_bit_pattern_and_every_code(dtype):
    spec = ChunkSpec(1, 1, 256, 128, dtype)  # 65,536 elements: every 16-bit pattern once, NaNs included
    wire = wire_format("fp8", spec, METHODS["fp8"])
    chunk = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(dtype).reshape(spec.shape)
    codes = to_fp8_bytes(chunk.float())
    assert bytes(wire.encode(chunk)) == bytes(codes.numpy().data)
    every_code = torch.arange(2**16, dtype=torch.int32).remainder(256).to(torch.uint8)
    cast = every_code.view(torch.float8_e4m3fn).to(dtype).reshape(spec.shape)
    assert torch.equal(wire.decode(bytes(every_code.numpy().data)).view(torch.int16), cast.view(torch.int16))


def test_wire_formats_refuse_what_they_cannot_be():
    with pytest.raises(ValueError, match="kind snapkv.* is not a wire format"):
        check_codec("snapkv", METHODS)
    with pytest.raises(ValueError, match="neither a codec"):
        check_codec("gzip", METHODS)
    with pytest.raises(ValueError, match="already 8-bit"):
        wire_format("kivi2", ChunkSpec(LAYERS, HEADS, BLOCK, HEAD, torch.uint8), METHODS["kivi2"])
    check_codec("zstd-3+byteplane", METHODS)
