import pytest
import torch

from kvbench.methods.packing import pack, packed_bytes, unpack


@pytest.mark.parametrize("bits, n, expected_bytes", [(2, 4, 1), (2, 5, 2), (4, 2, 1), (4, 7, 4), (3, 8, 3),
                                                     (3, 9, 4), (1, 8, 1), (1, 17, 3), (8, 5, 5)])
def test_packed_size_is_exactly_bits_times_codes(bits, n, expected_bytes):
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(n))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == expected_bytes == packed_bytes(n, bits)
    assert torch.equal(unpack(packed, bits, n), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_round_trip_on_large_tensors(bits):
    codes = torch.randint(0, 2**bits, (3, 17, 64), generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack(pack(codes, bits), bits, codes.numel()).reshape(codes.shape), codes.to(torch.uint8))


def test_known_layout_for_two_bits():
    assert pack(torch.tensor([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4]


def test_out_of_range_codes_are_refused():
    with pytest.raises(ValueError, match="out of range for 2 bits"):
        pack(torch.tensor([4]), 2)
