import pytest
import torch

from kvbench.methods.packing import pack, pack_planes, packed_bytes, unpack, unpack_as, unpack_planes_into


@pytest.mark.parametrize(
    "bits, n, expected_bytes",
    [(2, 4, 1), (2, 5, 2), (4, 2, 1), (4, 7, 4), (3, 8, 3), (3, 9, 4), (1, 8, 1), (1, 17, 3), (8, 5, 5)],
)
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


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_planes_round_trip_into_a_strided_float_view(bits):
    codes = torch.randint(0, 2**bits, (1, 3, 40, 64), generator=torch.Generator().manual_seed(bits))
    packed = pack_planes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == codes.numel() * bits // 8
    buffer = torch.full((1, 3, 50, 64), -1.0)
    unpack_planes_into(packed, bits, buffer[..., 5:45, :])  # a slice along tokens: not contiguous
    assert torch.equal(buffer[..., 5:45, :], codes.float())
    assert (buffer[..., :5, :] == -1).all() and (buffer[..., 45:, :] == -1).all()


def test_known_plane_layout_and_refusals():
    # w = 4 // 4 = 1: the byte holds codes 0..3 of the row at shifts 0, 2, 4, 6.
    assert pack_planes(torch.tensor([[1, 2, 3, 0]]), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    with pytest.raises(ValueError, match="in planes along an axis of 6"):
        pack_planes(torch.zeros(6), 2)
    with pytest.raises(ValueError, match="out of range for 4 bits"):
        pack_planes(torch.tensor([16, 0]), 4)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_unpack_as_maps_every_code_to_its_value(bits):
    codes = torch.randint(0, 2**bits, (1001,), generator=torch.Generator().manual_seed(bits))
    values = tuple(float(v) for v in torch.linspace(-1.5, 2.0, 2**bits).tolist())
    decoded = unpack_as(pack(codes, bits), bits, codes.numel(), values)
    assert torch.equal(decoded, torch.tensor(values)[codes])


def test_byte_scores_refuse_codes_that_straddle_bytes():
    from kvbench.methods.packing import byte_scores

    with pytest.raises(ValueError, match="3-bit"):
        byte_scores(torch.zeros(1, 4, 24, dtype=torch.uint8), 3, tuple(range(8)), torch.zeros(1, 1, 64))
