import numpy as np
import pytest
import torch

from kvbench.kv.storage import FP8_E4M3_MAX, store


@pytest.mark.parametrize(
    "dtype, torch_dtype, size",
    [
        ("fp32", torch.float32, 4),
        ("fp16", torch.float16, 2),
        ("bf16", torch.bfloat16, 2),
        ("fp8_e4m3", torch.float8_e4m3fn, 1),
    ],
)
def test_stored_bytes_are_the_cast_tensor(dtype, torch_dtype, size):
    x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(0))
    stored = store(x, dtype)
    assert stored.itemsize == size and len(stored.data) == x.numel() * size
    back = torch.frombuffer(bytearray(stored.data), dtype=torch_dtype).reshape(x.shape)
    assert torch.equal(back, x.to(torch_dtype))
    view = np.frombuffer(stored.data, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[size])
    assert stored.unique_values == np.unique(view).size
    assert stored.mean_abs == pytest.approx(float(x.to(torch_dtype).float().abs().mean()))


def test_fp8_saturates_instead_of_producing_nan():
    x = torch.tensor([1.0, -1000.0, 500.0, 3.0])
    stored = store(x, "fp8_e4m3")
    back = torch.frombuffer(bytearray(stored.data), dtype=torch.float8_e4m3fn).float()
    assert not torch.isnan(back).any()
    assert back.tolist() == [1.0, -FP8_E4M3_MAX, FP8_E4M3_MAX, 3.0]
    assert stored.clipped == 2


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="unknown storage dtype 'int4'"):
        store(torch.zeros(2), "int4")
