"""KIVI, fp8, full, StreamingLLM caches on synthetic tensors: bounds, axes, windows and bytes; and
KIVI's decode attention through the real model."""

from pathlib import Path

import pytest
import torch

from kvbench.methods.base import ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.methods.kivi import QuantizedBlock

SHAPE = ModelShape(layers=2, kv_heads=3, q_heads=9, head_dim=64)
GEN = torch.Generator().manual_seed(0)


def kv(tokens: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(1, SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=GEN) * scale


def reference_quantize(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> torch.Tensor:
    """An independent, straightforward KIVI quantize-dequantize (the reference's min/max scheme with
    fp16 statistics), looping over groups: G tokens per channel, or G channels per token."""
    out = torch.empty_like(x)
    levels = 2**bits - 1
    if per_channel:
        spans = [(slice(a, a + group), slice(None)) for a in range(0, x.shape[-2], group)]
    else:
        spans = [(slice(None), slice(a, a + group)) for a in range(0, x.shape[-1], group)]
    for tokens, channels in spans:
        part = x[..., tokens, channels]
        dim = -2 if per_channel else -1
        lo, hi = part.amin(dim, keepdim=True), part.amax(dim, keepdim=True)
        scale, zero = ((hi - lo) / levels).half().float(), lo.half().float()
        codes = torch.clamp(torch.round((part - zero) / torch.where(scale > 0, scale, 1.0)), 0, levels)
        out[..., tokens, channels] = codes * scale + zero
    return out


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_error_within_half_a_step_of_its_own_group(bits):
    x = kv(96) * torch.logspace(-2, 1, SHAPE.head_dim)  # 3 token groups; channels of very different ranges
    for per_channel in (True, False):
        block = QuantizedBlock(x, bits, 32, per_channel)
        err = (block.dequantize() - x).abs()
        # Half a step of the group the value belongs to, plus the fp16 rounding of that group's own
        # statistics (2^-11 relative): slack scales with each group, not with the largest channel.
        step, zero = block.scale.float(), block.zero.float()
        bound = step / 2 + 2**-10 * (zero.abs() + (2**bits - 1) * step) + 1e-7
        assert (err <= bound.expand(block.grouped).reshape(err.shape)).all()
        assert torch.allclose(block.dequantize(), reference_quantize(x, bits, 32, per_channel), rtol=0, atol=1e-6)
    # Per channel, the smallest channel (1000x smaller range) keeps errors at its own scale.
    err = (QuantizedBlock(x, bits, 32, True).dequantize() - x).abs()
    assert err[..., 0].max() < 0.01 * err[..., -1].max()


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


class ReferenceResidual:
    """The reference's residual bookkeeping (jy-yuan/KIVI models/llama_kivi.py), written out: which
    tokens a step attends to quantized, and how many stay at full precision after it."""

    def __init__(self, prompt: int, residual: int) -> None:
        self.r = residual
        self.full_keys = prompt % residual  # prefill quantizes all but T mod R keys ...
        self.full_values = min(prompt, residual)  # ... and all but the R newest values
        self.keys_q, self.values_q = prompt - self.full_keys, prompt - self.full_values

    def step(self) -> tuple[int, int]:
        """One decode token: returns (keys, values) attended quantized, then flushes."""
        seen = self.keys_q, self.values_q
        self.full_keys += 1
        if self.full_keys == self.r:  # the R full-precision keys are quantized together
            self.keys_q, self.full_keys = self.keys_q + self.r, 0
        self.full_values += 1
        if self.full_values > self.r:  # the oldest value is quantized
            self.values_q, self.full_values = self.values_q + 1, self.r
        return seen


@pytest.mark.parametrize("prompt", [1000, 1024, 100])
def test_kivi_full_precision_tokens_follow_the_reference_rule(prompt):
    layer = build_cache({"kind": "kivi", "bits": 2, "group_size": 32, "residual": 128}, SHAPE).layers[0]
    ref = ReferenceResidual(prompt, 128)
    keys, values = layer.update(kv(prompt), kv(prompt))
    assert keys.shape[-2] == prompt and layer.get_seq_length() == prompt
    for step in range(170):  # two key flushes for every prompt length
        # after every step: keys keep T mod R at full precision, values min(T, R)
        tokens = prompt + step
        assert (
            (layer.keys.shape[-2], layer.values.shape[-2])
            == (ref.full_keys, ref.full_values)
            == (tokens % 128, min(tokens, 128))
        )
        assert layer.quantized_tokens() == (ref.keys_q, ref.values_q)
        assert layer.get_seq_length() == tokens
        layer.update(kv(1), kv(1))
        ref.step()


def test_kivi_decode_attends_like_the_reference():
    layer = build_cache({"kind": "kivi", "bits": 4, "group_size": 32, "residual": 64}, SHAPE).layers[0]
    prompt_keys, prompt_values = kv(300), kv(300, scale=2.0)
    layer.update(prompt_keys, prompt_values)
    ref = ReferenceResidual(300, 64)
    stored_keys, stored_values = [prompt_keys.half().float()], [prompt_values.half().float()]
    for _ in range(70):
        step_keys, step_values = kv(1), kv(1, scale=2.0)
        keys, values = layer.update(step_keys, step_values)
        stored_keys.append(step_keys.half().float())
        stored_values.append(step_values.half().float())
        keys_q, values_q = ref.step()
        seen_keys, seen_values = torch.cat(stored_keys, dim=-2), torch.cat(stored_values, dim=-2)
        # Quantized parts equal the reference quantizer on the same tokens (keys: groups of 32 tokens
        # aligned at 0; values: each token alone); the rest is the stored token itself.
        assert torch.allclose(
            keys[..., :keys_q, :], reference_quantize(seen_keys[..., :keys_q, :], 4, 32, True), rtol=0, atol=1e-6
        )
        assert torch.equal(keys[..., keys_q:, :], seen_keys[..., keys_q:, :])
        assert torch.allclose(
            values[..., :values_q, :],
            reference_quantize(seen_values[..., :values_q, :], 4, 32, False),
            rtol=0,
            atol=1e-6,
        )
        assert torch.equal(values[..., values_q:, :], seen_values[..., values_q:, :])
    assert (keys - seen_keys).abs().max() < 0.5  # 4-bit steps of ~N(0,1) data, not garbage


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("kernels", ["native", "dequantized"])
@pytest.mark.parametrize("new_tokens", [1, 3])
def test_kivi_attention_over_packed_codes_equals_attention_over_rebuilt_kv(bits, kernels, new_tokens, monkeypatch):
    """Decode through the cache's own attention (scales folded into the query and the weights, codes
    read packed; or the blocks dequantized, as for a shape the kernels do not take) gives causal
    softmax attention over the K/V an unattached twin rebuilds, step after step across key flushes."""
    from kvbench.methods import kivi, native

    if native.library() is None:
        pytest.skip(native.status())  # the cache routes its attention only where the kernels run
    if kernels == "dequantized":
        monkeypatch.setattr(kivi, "lut_dots", lambda *args, **kwargs: None)
        monkeypatch.setattr(kivi, "lut_sums", lambda *args, **kwargs: None)
    spec = {"kind": "kivi", "bits": bits, "group_size": 32, "residual": 64}
    routed, rebuilt = (build_cache(spec, SHAPE).layers[0] for _ in range(2))
    routed.attached = True  # as cache.attach(model) marks it; the test calls its attention directly
    prompt_keys, prompt_values = kv(150), kv(150, scale=2.0)
    routed.update(prompt_keys, prompt_values)
    rebuilt.update(prompt_keys, prompt_values)
    calls = native.CALLS["native"]
    for _ in range(70 // new_tokens):  # 150 + 70 tokens: the keys flush at 192
        step_keys, step_values = kv(new_tokens), kv(new_tokens, scale=2.0)
        routed.update(step_keys, step_values)
        keys, values = rebuilt.update(step_keys, step_values)
        query = torch.randn(1, SHAPE.q_heads, new_tokens, SHAPE.head_dim, generator=GEN)
        out, _ = routed.attend(None, None, query, None, None, None, scaling=0.125)
        t = keys.shape[-2]
        later = torch.arange(t) > torch.arange(t - new_tokens, t)[:, None]  # each new token sees up to itself
        logits = (query @ keys.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.125).masked_fill(later, float("-inf"))
        expected = (logits.softmax(-1) @ values.repeat_interleave(3, dim=1)).transpose(1, 2)
        assert torch.allclose(out, expected, atol=1e-5)
        assert routed.quantized_tokens() == rebuilt.quantized_tokens()
    assert routed.quantized_tokens()[0] == 192
    assert (native.CALLS["native"] > calls) == (kernels == "native")  # the path named is the path taken


def test_kivi_refuses_bits_it_cannot_pack_in_planes_and_misaligned_residuals():
    from kvbench.methods.kinds import KIVI_BITS
    from kvbench.methods.packing import PLANE_BITS

    assert set(KIVI_BITS) == set(PLANE_BITS)  # the config check allows what the packer packs
    with pytest.raises(ValueError, match=r"bits: 3 is not one of \[1, 2, 4, 8\]"):
        build_cache({"kind": "kivi", "bits": 3}, SHAPE)
    with pytest.raises(ValueError, match="residual: 100 must be a positive multiple of group_size 32"):
        build_cache({"kind": "kivi", "bits": 2, "residual": 100}, SHAPE)


def test_fp8_cache_prefill_sees_its_input_and_decode_the_fp8_codes():
    layer = build_cache({"kind": "fp8"}, SHAPE).layers[1]
    x, step = kv(50, scale=3.0), kv(1, scale=3.0)
    keys, _ = layer.update(x, x)
    assert torch.equal(keys, x)  # the prompt attends at compute precision, as every method's
    keys, _ = layer.update(step, step)
    stored = torch.cat([x, step], dim=-2)
    assert torch.equal(keys, stored.to(torch.float8_e4m3fn).float())
    rel = (keys - stored).abs() / stored.abs().clamp_min(2**-6)
    assert rel.max() <= 2**-4 and rel.max() > 0  # e4m3: 3 mantissa bits, round to nearest


@pytest.mark.parametrize("storage, dtype", [(None, torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_full_cache_prefill_sees_its_input_and_decode_the_stored_dtype(storage, dtype):
    spec = {"kind": "full"} | ({"storage": storage} if storage else {})
    layer = build_cache(spec, SHAPE).layers[0]
    x, step = kv(10), kv(1)
    keys, _ = layer.update(x, x)
    assert torch.equal(keys, x)
    keys, _ = layer.update(step, step)
    assert torch.equal(keys, torch.cat([x, step], dim=-2).to(dtype).float())
    assert layer.keys.dtype == dtype


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
    with pytest.raises(
        ValueError, match=r"bitz: unknown setting for kind 'kivi' \(allowed: bits, group_size, residual, storage\)"
    ):
        build_cache({"kind": "kivi", "bitz": 2}, SHAPE)


def test_registry_and_kinds_agree():
    from kvbench.methods import catalog  # noqa: F401
    from kvbench.methods.base import METHODS
    from kvbench.methods.kinds import KINDS

    assert sorted(METHODS) == sorted(KINDS)


def test_every_bit_width_the_config_accepts_holds_exactly_its_packed_bytes():
    # 64 prompt tokens, head_dim 64, 3 KV heads: the bytes each layout holds, counted from the
    # papers' layouts (codes at `bits` a coordinate, fp16 statistics), for every accepted width.
    from kvbench.methods.kinds import KIVI_BITS, TURBOQUANT_BITS

    heads, d, t = SHAPE.kv_heads, SHAPE.head_dim, 64
    for bits in KIVI_BITS:  # group 32, residual 32: every key quantized (64 mod 32 = 0), 32 values
        layer = build_cache({"kind": "kivi", "bits": bits, "group_size": 32, "residual": 32}, SHAPE).layers[0]
        layer.update(kv(t), kv(t))
        keys = t * d * bits // 8 + (t // 32) * d * 2 * 2  # codes; fp16 scale + zero per channel per 32 tokens
        values = 32 * d * 2 + 32 * d * bits // 8 + 32 * (d // 32) * 2 * 2  # fp16 residual; codes; statistics
        assert layer.nbytes() == heads * (keys + values), ("kivi", bits)
    for bits in TURBOQUANT_BITS:
        for variant in ("prod", "mse") if bits > 1 else ("mse",):
            layer = build_cache({"kind": "turboquant", "bits": bits, "variant": variant}, SHAPE).layers[0]
            layer.update(kv(t), kv(t))
            key_bits = bits - 1 if variant == "prod" else bits
            keys = d * key_bits // 8 + 2 + ((d // 8 + 2) if variant == "prod" else 0)  # codes, norm, QJL signs + |r|
            values = d * bits // 8 + 2
            codebooks = 4 * ((2**key_bits + 2**key_bits - 1) + (2**bits + 2**bits - 1))  # fp32 levels and edges
            assert layer.nbytes() == heads * t * (keys + values) + codebooks, ("turboquant", bits, variant)


def test_kivi_attention_on_the_real_model_equals_the_models_own_over_rebuilt_kv(model_dir, tokenizer):
    """On the real model's queries and K/V, every decode step of every layer: KIVI's attention over
    its packed codes (the native kernels) equals the model's own attention function over the K/V an
    unattached twin cache rebuilds from the same inputs. (Comparing two whole generations instead
    would compare different caches: float-order differences of ~1e-6 flip 2-bit codes on rounding
    edges.)"""
    from kvbench.harness import generate
    from kvbench.methods import native
    from kvbench.methods.kivi import KiviLayer
    from kvbench.models import load_model

    if native.library() is None:
        pytest.skip(native.status())
    gaps: list[float] = []

    class Checked(KiviLayer):
        """Steps an unattached twin in lockstep (it rebuilds K/V, then flushes, in its own update)."""

        def update(self, key_states, value_states, *args, **kwargs):
            if not hasattr(self, "twin"):
                self.twin = KiviLayer(self.bits, self.group, self.residual, self.storage)
            self.twin_kv = self.twin.update(key_states, value_states)
            return super().update(key_states, value_states, *args, **kwargs)

        def attend(self, original, module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
            expected = None
            if self.pending:
                expected, _ = original(module, query, *self.twin_kv, attention_mask, *args, scaling=scaling, **kwargs)
            out, weights = super().attend(
                original, module, query, key, value, attention_mask, *args, scaling=scaling, **kwargs
            )
            if expected is not None:
                gaps.append((out - expected).abs().max().item())
            return out, weights

    def checked(spec, shape, seed):
        cache = build_cache(spec, shape, seed)
        for layer in cache.layers:
            layer.__class__ = Checked
        return cache

    model = load_model(model_dir)
    ids = tokenizer((Path(__file__).parent / "data" / "legal-contract-00.txt").read_text()).input_ids[:500]
    spec = {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 128}
    calls = native.CALLS["native"]
    generate(model, spec, ids, 16, make_cache=checked)  # 500 + 16 tokens: the keys flush at 512
    assert len(gaps) == 15 * model.config.num_hidden_layers  # every decode step of every layer checked
    assert native.CALLS["native"] - calls == 2 * len(gaps)  # key scores and value sums each step: no fallback
    assert max(gaps) < 1e-4 and max(gaps) > 0  # fp32 summation order only; two paths, not one
