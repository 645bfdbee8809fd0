"""TurboQuant: Lloyd-Max distortion, rotated MSE, unbiased inner products, packed bytes."""

import math

import pytest
import torch

from kvbench.methods.base import ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.methods.turboquant import MseQuantizer, TurboBlock, lloyd_max, random_rotation

# Known optimal MSE of N(0,1) scalar quantizers (Max 1960): 1, 2, 3, 4 bits.
KNOWN_DISTORTION = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
D = 64


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_matches_the_known_distortion(bits):
    centroids, distortion = lloyd_max(bits)
    assert distortion == pytest.approx(KNOWN_DISTORTION[bits], rel=2e-3)
    assert list(centroids) == sorted(centroids) and centroids[0] == pytest.approx(-centroids[-1])
    if bits == 1:
        assert centroids[1] == pytest.approx(math.sqrt(2 / math.pi), rel=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rotated_mse_is_near_lloyd_max_distortion(bits):
    gen = torch.Generator().manual_seed(bits)
    mse = MseQuantizer(random_rotation(D, gen), bits)
    x = torch.randn(4000, D, generator=gen) * torch.logspace(-1, 1, D)  # anisotropic, like real keys
    unit = x / x.norm(dim=-1, keepdim=True)
    codes, norms = mse.encode(unit)
    err = ((mse.decode(codes, norms) - unit) ** 2).sum(-1).mean().item()
    # Rotated coordinates are ~N(0, 1/d): total distortion of a unit vector ~ D(b) (fp16 norms aside).
    assert err == pytest.approx(lloyd_max(bits)[1], rel=0.15)


def test_qjl_inner_product_estimator_is_unbiased():
    gen = torch.Generator().manual_seed(0)
    rotation = random_rotation(D, gen)
    mse = MseQuantizer(rotation, 2)
    key = torch.randn(1, D, generator=gen)
    query = torch.randn(1, D, generator=gen)
    truth = (query @ key.T).item()
    estimates, mse_only = [], []
    for _ in range(3000):  # fresh sketch each draw: expectation over S
        sketch = torch.randn(D, D, generator=gen)
        block = TurboBlock(key, mse, sketch)
        estimates.append((query @ block.decode(mse, sketch).T).item())
        mse_only.append((query @ block.decode(mse, None).T).item())
    mean = sum(estimates) / len(estimates)
    spread = torch.tensor(estimates).std().item() / math.sqrt(len(estimates))
    assert abs(mean - truth) < 4 * spread  # unbiased
    assert abs(mse_only[0] - truth) > abs(mean - truth)  # the MSE stage alone is biased here


@pytest.mark.parametrize("bits, variant", [(3, "prod"), (4, "prod"), (3, "mse"), (4, "mse")])
def test_turboquant_layer_decodes_within_the_lloyd_max_distortion(bits, variant):
    shape = ModelShape(layers=2, kv_heads=3, q_heads=9, head_dim=D)
    layer = build_cache({"kind": "turboquant", "bits": bits, "variant": variant}, shape, seed=1).layers[0]
    x = torch.randn(1, 3, 100, D)
    keys, values = layer.update(x, 2 * x)
    assert torch.equal(keys, x) and torch.equal(values, 2 * x)  # the prompt attends in full precision
    key_bits = bits - 1 if variant == "prod" else bits
    codes = layer.key_block
    assert codes.packed.numel() + (codes.code_signs.numel() if key_bits == 3 else 0) == x.numel() * key_bits / 8
    assert (layer.key_block.signs is not None) == (variant == "prod")
    decoded_keys, decoded_values = layer.decoded()
    rel = ((decoded_values - 2 * x).norm() / (2 * x).norm()).item()
    assert rel**2 == pytest.approx(lloyd_max(bits)[1], rel=0.25)
    mse_keys = layer.key_block.decode(layer.key_mse, None)  # the keys' MSE stage alone
    assert ((mse_keys - x).norm() / x.norm()).item() ** 2 == pytest.approx(lloyd_max(key_bits)[1], rel=0.25)


def attached_layer(spec: dict, shape: ModelShape, seed: int):
    layer = build_cache(spec, shape, seed=seed).layers[0]
    layer.attached = True  # as cache.attach(model) marks it; these tests call its attention directly
    return layer


@pytest.mark.parametrize("bits, variant", [(3, "prod"), (4, "prod"), (3, "mse"), (2, "prod")])
def test_rotated_attention_equals_attention_over_decoded_keys_and_values(bits, variant):
    """Decode scores [R q, S q] against the stored codes: the same scores as q . k_hat, and values
    summed in the rotated domain and rotated back once give sum_t p_t v_hat_t."""
    shape = ModelShape(layers=1, kv_heads=3, q_heads=9, head_dim=D)
    layer = attached_layer({"kind": "turboquant", "bits": bits, "variant": variant}, shape, 4)
    layer.update(torch.randn(1, 3, 40, D), torch.randn(1, 3, 40, D))
    for _ in range(3):  # several blocks: the prompt's and one per decode step
        layer.update(torch.randn(1, 3, 1, D), torch.randn(1, 3, 1, D))
    keys, values = layer.decoded()
    query = torch.randn(1, 9, 2, D)
    expected = query @ keys.repeat_interleave(3, dim=1).transpose(-1, -2)
    assert torch.allclose(layer.scores(query), expected, atol=1e-4)
    probs = torch.softmax(torch.randn(1, 9, 2, 43), dim=-1)
    expected = (probs @ values.repeat_interleave(3, dim=1)).transpose(1, 2)
    assert torch.allclose(layer.weighted_values(probs), expected, atol=1e-5)
    # The attention function: softmax of scaled scores, causal among the new tokens.
    out, _ = layer.attend(None, None, query, None, None, None, scaling=0.125)
    causal = torch.arange(43) > torch.arange(41, 43)[:, None]
    probs = (layer.scores(query) * 0.125).masked_fill(causal, float("-inf")).softmax(-1)
    assert torch.allclose(out, (probs @ values.repeat_interleave(3, dim=1)).transpose(1, 2), atol=1e-5)


def test_qjl_is_unbiased_through_the_layer_and_mse_only_is_not():
    """Scores the layer's decode attention computes for a fixed key and query, over sketches (one
    cache seed each): the product variant's mean is the true score; the MSE variant shrinks it."""
    shape = ModelShape(layers=1, kv_heads=1, q_heads=1, head_dim=D)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(1, 1, 1, D, generator=gen)
    query = key + 0.5 * torch.randn(1, 1, 1, D, generator=gen)  # correlated, as attention's winners are
    truth = (query * key).sum().item()
    scores = {"prod": [], "mse": []}
    for seed in range(1500):
        for variant, out in scores.items():
            layer = attached_layer({"kind": "turboquant", "bits": 2, "variant": variant}, shape, seed)
            layer.update(key, key)
            out.append(layer.scores(query)[0, 0, 0, 0].item())
    prod, mse = torch.tensor(scores["prod"]), torch.tensor(scores["mse"])
    assert abs(prod.mean().item() - truth) < 4 * prod.std().item() / math.sqrt(len(prod))  # unbiased
    assert truth - mse.mean().item() > 8 * mse.std().item() / math.sqrt(len(mse))  # biased toward 0
    assert prod.std() > mse.std()  # the price of unbiasedness: more variance per score


def test_decode_needs_the_cache_attached():
    shape = ModelShape(layers=1, kv_heads=3, q_heads=9, head_dim=D)
    layer = build_cache({"kind": "turboquant", "bits": 4}, shape).layers[0]
    layer.update(torch.randn(1, 3, 10, D), torch.randn(1, 3, 10, D))
    with pytest.raises(RuntimeError, match="run the model with the cache attached"):
        layer.update(torch.randn(1, 3, 1, D), torch.randn(1, 3, 1, D))


def test_three_bit_codes_round_trip_in_sign_magnitude_planes():
    from kvbench.methods.packing import pack_sign_magnitude, unpack_sign_magnitude, unpack_sign_magnitude_as

    codes = torch.randint(0, 8, (1003,), generator=torch.Generator().manual_seed(0))
    magnitude, signs = pack_sign_magnitude(codes)
    assert magnitude.numel() + signs.numel() == math.ceil(1003 / 4) + math.ceil(1003 / 8)  # 3 bits per code
    assert torch.equal(unpack_sign_magnitude(magnitude, signs, 1003).long(), codes)
    levels = tuple(float(v) for v in range(10, 18))
    assert torch.equal(unpack_sign_magnitude_as(magnitude, signs, 1003, levels), codes.float() + 10)


@pytest.mark.parametrize("bits, variant", [(3, "prod"), (4, "mse")])
def test_decode_tokens_append_as_if_encoded_with_the_prompt(bits, variant):
    """One block per layer: each decode token's codes are appended (no repacking), and the block
    decodes exactly as the same tokens encoded at once."""
    from kvbench.methods.turboquant import TurboBlock

    shape = ModelShape(layers=1, kv_heads=3, q_heads=9, head_dim=D)
    layer = attached_layer({"kind": "turboquant", "bits": bits, "variant": variant}, shape, 2)
    tokens = torch.randn(1, 3, 70, D)
    layer.update(tokens[..., :50, :], tokens[..., :50, :])
    for i in range(50, 70):
        layer.update(tokens[..., i : i + 1, :], tokens[..., i : i + 1, :])
    assert layer.get_seq_length() == 70 and layer.key_block.packed.shape[-2] == 70
    whole = TurboBlock(tokens, layer.key_mse, layer.sketch)
    assert torch.equal(layer.key_block.codes(), whole.codes()) and torch.equal(layer.key_block.norms, whole.norms)
    assert torch.allclose(layer.decoded()[0], whole.decode(layer.key_mse, layer.sketch), atol=1e-5)


def test_the_model_decodes_the_same_through_the_rotated_domain(model_dir, tokenizer):
    """Through the real model: decode attending in the rotated domain gives the logits of decode
    attending to keys and values rebuilt in the original domain (the previous implementation),
    while both caches hold the same codes. The two paths differ in the last bits of their outputs
    (1e-5 here), so a later layer's new key can land on the other side of a bucket edge in one of
    them: from that token on the caches differ and so may the logits (on one CPU the 6th decoded
    token's codes differ and the logits move by 0.8, on another none do in 8 tokens). The logits
    are compared up to that token, over at least 4 decode steps."""
    from pathlib import Path

    from kvbench.harness import generate
    from kvbench.methods.turboquant import TurboLayer
    from kvbench.models import load_model

    class Rebuilt(TurboLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            out = super().update(key_states, value_states)
            if not self.pending:
                return out
            self.pending = False  # attention runs the model's own function, on rebuilt K/V
            return self.decoded(key_states.dtype)

    caches = []

    def kept(spec, shape, seed):
        caches.append(build_cache(spec, shape, seed))
        return caches[-1]

    def rebuilt(spec, shape, seed):
        cache = kept(spec, shape, seed)
        for layer in cache.layers:
            layer.__class__ = Rebuilt
        return cache

    model = load_model(model_dir)
    ids = tokenizer((Path(__file__).parent / "data" / "legal-contract-00.txt").read_text()).input_ids[:400]
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out[0, -1].clone()))
    try:
        spec = {"kind": "turboquant", "bits": 4}
        rotated = generate(model, spec, ids, 8, seed=5, make_cache=kept)["tokens"]
        rotated_logits, logits[:] = list(logits), []
        reference = generate(model, spec, ids, 8, seed=5, make_cache=rebuilt)["tokens"]
    finally:
        hook.remove()
    # logits[i] (i >= 1) come from the step that cached token len(ids) + i - 1
    same = _same_code_tokens(*caches) - len(ids) + 1
    assert same >= 5, f"the caches' codes differ from decode step {same}: too early to compare"
    assert rotated[:same] == reference[:same]
    for ours, ref in zip(rotated_logits[:same], logits[:same]):
        assert torch.allclose(ours, ref, atol=2e-3, rtol=0)
    assert any(not torch.equal(a, b) for a, b in zip(rotated_logits[:same], logits[:same]))  # two paths, not one


def _same_code_tokens(a, b) -> int:
    """How many leading tokens two TurboQuant caches hold with identical codes in every layer."""
    tokens = a.layers[0].key_block.shape[-2]
    for la, lb in zip(a.layers, b.layers):
        for block_a, block_b in ((la.key_block, lb.key_block), (la.value_block, lb.value_block)):
            for name in ("packed", "code_signs", "signs"):
                x, y = getattr(block_a, name), getattr(block_b, name)
                if x is not None:
                    differs = (x != y).flatten(0, -3).any(0).any(-1)  # per token
                    if differs.any():
                        tokens = min(tokens, int(differs.nonzero()[0]))
    return tokens


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_byte_scores_equal_unpacked_codes_times_the_query(bits):
    """Per-query byte tables score the packed bytes as the unpacked codes would: distinct values
    per code and a random query, so a wrong bit order or byte position changes every score."""
    from kvbench.methods.packing import byte_scores, pack, unpack_as

    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (2, 3, 50, D), generator=gen)
    packed = pack(codes, bits).view(2, 3, 50, -1)
    values = tuple(float(v) for v in torch.randn(2**bits, generator=gen))
    query = torch.randn(2, 3, 4, D, generator=gen)
    expected = query @ unpack_as(packed, bits, codes.numel(), values).view(codes.shape).transpose(-1, -2)
    assert torch.allclose(byte_scores(packed, bits, values, query), expected, atol=1e-5)
    flipped = torch.flip(packed, dims=[-1])  # bytes of a row in the wrong order
    assert not torch.allclose(byte_scores(flipped, bits, values, query), expected, atol=1e-2)


@pytest.mark.parametrize("variant", ["prod", "mse"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_layer_scores_equal_rotated_query_times_unpacked_codes(bits, variant):
    """The decode scores (byte tables where the codes are 1-bit) equal the plain formula
    n_t (R q) . levels_t + sqrt(pi/2)/d |r_t| (S q) . signs_t over the unpacked codes."""
    shape = ModelShape(layers=1, kv_heads=3, q_heads=9, head_dim=D)
    layer = attached_layer({"kind": "turboquant", "bits": bits, "variant": variant}, shape, 3)
    layer.update(torch.randn(1, 3, 60, D), torch.randn(1, 3, 60, D))
    layer.update(torch.randn(1, 3, 1, D), torch.randn(1, 3, 1, D))
    query = torch.randn(1, 9, 1, D)
    rotated, sketched = (x.view(1, 3, 3, D) if x is not None else None for x in layer.rotate_query(query))
    block = layer.key_block
    expected = (rotated @ block.levels(layer.key_mse).transpose(-1, -2)) * block.norms.float()[..., 0][:, :, None]
    if variant == "prod":
        expected += (sketched @ block.qjl_signs().transpose(-1, -2)) * block.qjl_weights()[:, :, None]
    assert torch.allclose(layer.scores(query), expected.view(1, 9, 1, 61), atol=1e-5)
