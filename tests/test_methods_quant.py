"""KIVI, fp8, full, StreamingLLM caches on synthetic tensors: bounds, axes, windows and bytes."""

import pytest
import torch

from kvbench.methods.base import ModelShape, build_cache
from kvbench.methods.kivi import QuantizedBlock

SHAPE = ModelShape(layers=2, kv_heads=3, q_heads=9, head_dim=64)
GEN = torch.Generator().manual_seed(0)


def kv(tokens: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(1, SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=GEN) * scale


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_error_within_the_bound_its_bits_and_group_stats_imply(bits):
    x = kv(96) * torch.logspace(-2, 1, SHAPE.head_dim)  # 3 token groups; channels of very different ranges
    for per_channel in (True, False):
        block = QuantizedBlock(x, bits, 32, per_channel)
        err = (block.dequantize() - x).abs()
        # Half a quantization step of the group the value belongs to (+ fp16 rounding of the stats).
        step = block.scale.float()
        bound = (step / 2 + step * 1e-2 + 1e-3 * x.abs().amax()).expand(block.grouped).reshape(err.shape)
        assert (err <= bound).all()
        assert err.max() > 0


def test_kivi_axes_keys_per_channel_values_per_token():
    x = kv(32)
    keys = QuantizedBlock(x, 2, 32, per_channel=True)
    values = QuantizedBlock(x, 2, 32, per_channel=False)
    assert keys.scale.shape == (1, SHAPE.kv_heads, 1, 1, SHAPE.head_dim)  # one scale per channel per group
    assert values.scale.shape == (1, SHAPE.kv_heads, 32, SHAPE.head_dim // 32, 1)  # per token, per channel group
    # An outlier channel (as keys have) only spoils its own channel under per-channel statistics.
    y = x.clone()
    y[..., 5] *= 100
    clean = (QuantizedBlock(y, 4, 32, True).dequantize() - y)[..., 6].abs().max()
    spoiled = (QuantizedBlock(y, 4, 32, False).dequantize() - y)[..., 6].abs().max()
    assert clean < spoiled / 10


def test_kivi_residual_window_and_measured_bytes():
    cache = build_cache({"kind": "kivi", "bits": 2, "group_size": 32, "residual": 128}, SHAPE)
    layer = cache.layers[0]
    keys, values = layer.update(kv(1000), kv(1000))
    assert keys.shape[-2] == 1000 and layer.get_seq_length() == 1000
    quantized = (1000 - 128) // 32 * 32
    assert layer.quantized_tokens() == quantized and layer.keys.shape[-2] == 1000 - quantized
    for _ in range(40):  # decode: the residual stays within [R, R + G)
        layer.update(kv(1), kv(1))
        assert 128 <= layer.keys.shape[-2] < 128 + 32
    tokens = layer.get_seq_length()
    q = layer.quantized_tokens()
    per_token_values = SHAPE.kv_heads * SHAPE.head_dim
    codes = 2 * q * per_token_values * 2 // 8
    key_stats = (q // 32) * SHAPE.kv_heads * SHAPE.head_dim * 2 * 2  # fp16 scale + zero per channel per group
    value_stats = q * SHAPE.kv_heads * (SHAPE.head_dim // 32) * 2 * 2
    residual = 2 * (tokens - q) * per_token_values * 2
    assert layer.nbytes() == codes + key_stats + value_stats + residual
    full16 = SHAPE.full_bytes(tokens) // SHAPE.layers
    assert 3 < full16 / layer.nbytes() < 8  # below the nominal 8x: scales, zero points and residual


def test_kivi_decode_attends_to_exactly_its_groups_and_residual():
    cache = build_cache({"kind": "kivi", "bits": 4, "group_size": 32, "residual": 64}, SHAPE)
    layer = cache.layers[0]
    prompt = kv(300)
    layer.update(prompt, prompt)
    steps = [kv(1) for _ in range(70)]
    for step in steps:
        keys, values = layer.update(step, step)
    # Prefill quantizes 224 tokens (300 - 64, whole groups); decode flushes 32 at residual 96, twice.
    assert layer.quantized_tokens() == 288 and keys.shape[-2] == 370
    stored = torch.cat([prompt] + steps, dim=-2).half().float()
    for out, per_channel in ((keys, True), (values, False)):
        # One block, appended to at each flush, equals the three flushes quantized separately.
        parts = [QuantizedBlock(stored[..., a:b, :], 4, 32, per_channel).dequantize() for a, b in ((0, 224), (224, 256), (256, 288))]
        assert torch.equal(out, torch.cat(parts + [stored[..., 288:, :]], dim=-2))
        assert (out - stored).abs().max() < 0.5  # 4-bit steps of ~N(0,1) data, not garbage


def test_kivi_refuses_bits_it_cannot_pack_in_planes():
    from kvbench.methods.kinds import KIVI_BITS
    from kvbench.methods.packing import PLANE_BITS

    assert set(KIVI_BITS) == set(PLANE_BITS)  # the config check allows what the packer packs
    with pytest.raises(ValueError, match=r"bits: 3 is not one of \[1, 2, 4, 8\]"):
        build_cache({"kind": "kivi", "bits": 3}, SHAPE)


def test_fp8_cache_holds_one_byte_per_value():
    cache = build_cache({"kind": "fp8"}, SHAPE)
    x = kv(50)
    keys, _ = cache.layers[1].update(x, x)
    assert cache.layers[1].nbytes() == 2 * x.numel()
    assert torch.equal(keys, x.to(torch.float8_e4m3fn).float())


def test_full_cache_is_exact_and_counts_its_dtype():
    cache = build_cache({"kind": "full"}, SHAPE)
    x = kv(10)
    keys, values = cache.layers[0].update(x, x)
    assert torch.equal(keys, x) and cache.layers[0].nbytes() == 2 * x.numel() * 4
    half = build_cache({"kind": "full", "storage": "fp16"}, SHAPE)
    half.layers[0].update(x, x)
    assert half.layers[0].nbytes() == SHAPE.full_bytes(10) // SHAPE.layers


def test_streamingllm_keeps_sinks_and_window():
    cache = build_cache({"kind": "streamingllm", "sinks": 4, "window": 16}, SHAPE)
    layer = cache.layers[0]
    x = torch.arange(100.0).reshape(1, 1, 100, 1).expand(1, SHAPE.kv_heads, 100, SHAPE.head_dim)
    seen, _ = layer.update(x, x)
    assert seen.shape[-2] == 100  # the prefill attends to everything
    kept = layer.keys[0, 0, :, 0].float().tolist()
    assert kept == [0, 1, 2, 3] + list(range(84, 100))
    step = torch.full((1, SHAPE.kv_heads, 1, SHAPE.head_dim), 100.0)
    layer.update(step, step)
    assert layer.keys[0, 0, :, 0].float().tolist() == [0, 1, 2, 3] + list(range(85, 101))


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown method kind 'zip'"):
        build_cache({"kind": "zip"}, SHAPE)


def test_unknown_setting_is_named_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"bitz: unknown setting for kind 'kivi' \(allowed: bits, group_size, residual, storage\)"):
        build_cache({"kind": "kivi", "bitz": 2}, SHAPE)


def test_registry_and_kinds_agree():
    from kvbench.methods import catalog  # noqa: F401
    from kvbench.methods.base import METHODS
    from kvbench.methods.kinds import KIND_SETTINGS

    assert sorted(METHODS) == sorted(KIND_SETTINGS)


def test_every_bit_width_the_config_accepts_builds_and_holds_a_cache():
    from kvbench.methods.kinds import KIVI_BITS, TURBOQUANT_BITS

    for kind, widths in (("kivi", KIVI_BITS), ("turboquant", TURBOQUANT_BITS)):
        for bits in widths:
            cache = build_cache({"kind": kind, "bits": bits, **({"residual": 0} if kind == "kivi" else {})}, SHAPE)
            x = kv(64)
            cache.layers[0].update(x, x)
            assert cache.layers[0].nbytes() > 0, (kind, bits)
