"""TurboQuant: Lloyd-Max distortion, rotated MSE, unbiased inner products, packed bytes."""

import math

import pytest
import torch

from kvbench.methods.base import ModelShape, build_cache
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


@pytest.mark.parametrize("bits", [3, 4])
def test_turboquant_cache_bytes_are_its_packed_tensors(bits):
    shape = ModelShape(layers=2, kv_heads=3, q_heads=9, head_dim=D)
    cache = build_cache({"kind": "turboquant", "bits": bits}, shape, seed=1)
    x = torch.randn(1, 3, 100, D)
    keys, values = cache.layers[0].update(x, x)
    assert torch.equal(keys, x) and torch.equal(values, x)  # the prompt attends in full precision
    n = x.numel()
    expected = (math.ceil(n * (bits - 1) / 8) + 2 * 300  # key codes + fp16 norms
                + math.ceil(n / 8) + 2 * 300  # QJL signs + fp16 residual norms
                + math.ceil(n * bits / 8) + 2 * 300)  # value codes + fp16 norms
    assert cache.layers[0].nbytes() == expected
    assert cache.nbytes() == expected + 4 * D * D * 2  # two rotations + two sketches, fp16, once
    step = torch.randn(1, 3, 1, D)
    _, values = cache.layers[0].update(step, step)  # decode attends to the dequantized cache
    rel = ((values[..., :100, :] - x).norm() / x.norm()).item()
    assert rel ** 2 == pytest.approx(lloyd_max(bits)[1], rel=0.25)


def test_decode_blocks_merge_without_changing_what_attention_sees():
    from kvbench.methods.turboquant import MERGE_AFTER

    shape = ModelShape(layers=1, kv_heads=3, q_heads=9, head_dim=D)
    layer = build_cache({"kind": "turboquant", "bits": 3}, shape, seed=2).layers[0]
    layer.update(torch.randn(1, 3, 50, D), torch.randn(1, 3, 50, D))
    previous = None
    for i in range(2 * MERGE_AFTER + 3):
        step = torch.randn(1, 3, 1, D)
        keys, values = layer.update(step, step)
        if previous is not None:  # earlier tokens dequantize identically across merges
            assert torch.allclose(keys[..., :-1, :], previous, atol=1e-5)  # matmul shapes differ
        previous = keys
        assert len(layer.key_blocks) <= MERGE_AFTER + 1
    assert layer.get_seq_length() == 50 + 2 * MERGE_AFTER + 3
