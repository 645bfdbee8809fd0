import numpy as np
import pytest
import yaml

from kvbench.kv.codecs import BytePlane, Identity, codec_names, get_codec
from kvbench.kv.measure import measure
from kvbench.tinyrun import REPO

RNG = np.random.default_rng(0)
PAYLOADS = {
    "empty": b"",
    "random": RNG.integers(0, 256, 10_000, dtype=np.uint8).tobytes(),
    "fp16-normal": RNG.normal(size=5_000).astype(np.float16).tobytes(),
    "zeros": bytes(8192),
}


# every codec on a 16-bit cache's elements; byte-plane (the only codec that reads the width) on fp32's too
WIDTHS = [(name, 2) for name in codec_names()] + [(n, 4) for n in codec_names() if n.endswith("+byteplane")]


@pytest.mark.parametrize("name, width", WIDTHS, ids=[f"{n}-w{w}" for n, w in WIDTHS])
@pytest.mark.parametrize("payload", PAYLOADS, ids=list(PAYLOADS))
def test_every_codec_round_trips_exactly(name, payload, width):
    codec = get_codec(name, width=width)
    data = PAYLOADS[payload]
    assert codec.decode(codec.encode(data)) == data


def test_byteplane_splits_high_and_low_bytes():
    data = np.array([0x0102, 0x0304, 0x0506], dtype="<u2").tobytes()  # little endian: lo, hi
    planes = BytePlane(Identity(), 2).encode(data)
    assert planes == bytes([0x02, 0x04, 0x06, 0x01, 0x03, 0x05])
    assert BytePlane(Identity(), 2).decode(planes) == data


def test_byteplane_splits_the_four_bytes_of_fp32_elements():
    data = np.array([0x01020304, 0x05060708], dtype="<u4").tobytes()
    planes = BytePlane(Identity(), 4).encode(data)
    assert planes == bytes([4, 8, 3, 7, 2, 6, 1, 5])
    assert BytePlane(Identity(), 4).decode(planes) == data


def test_measure_checks_a_byteplane_round_trip_that_returns_a_view():
    codec = get_codec("lz4+byteplane", 4)
    assert isinstance(codec.decode(codec.encode(PAYLOADS["fp16-normal"])), memoryview)
    row = measure(PAYLOADS["fp16-normal"], codec)
    assert row["error"] is None and row["compressed_bytes"] > 0


def test_byteplane_rejects_a_partial_element():
    with pytest.raises(ValueError, match="not a multiple of width 2"):
        get_codec("zstd-3+byteplane", 2).encode(b"abc")


def test_byteplane_helps_floats():
    # Small-magnitude floats share their exponent byte; planes expose that to the compressor.
    data = (RNG.normal(size=200_000) * 0.01).astype(np.float16).tobytes()
    plain = len(get_codec("zstd-3").encode(data))
    planed = len(get_codec("zstd-3+byteplane", 2).encode(data))
    assert planed < plain


def test_unknown_codec_is_named():
    with pytest.raises(ValueError, match="unknown codec 'brotli'"):
        get_codec("brotli")
    with pytest.raises(ValueError, match="unknown codec 'none\\+byteplane'"):
        get_codec("none+byteplane")


def test_schema_lists_exactly_the_registry():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    enum = schema["properties"]["kv"]["properties"]["codecs"]["items"]["enum"]
    assert sorted(enum) == sorted(codec_names())


def test_measure_reports_sizes_ratio_and_throughput():
    data = bytes(100_000)
    row = measure(data, get_codec("zstd-3"), repeats=2)
    assert row["raw_bytes"] == 100_000 and row["error"] is None
    assert row["ratio"] == pytest.approx(100_000 / row["compressed_bytes"])
    assert row["ratio"] > 100 and row["encode_mb_s"] > 0 and row["decode_mb_s"] > 0
    assert measure(data, get_codec("none"))["ratio"] == 1.0


def test_measure_records_a_broken_round_trip_as_an_error():
    class Lossy:
        name = "lossy"

        def encode(self, data):
            return data[:-1]

        def decode(self, data):
            return data

    row = measure(b"abcd", Lossy())
    assert row["ratio"] is None and row["compressed_bytes"] is None
    assert row["error"] == "lossy: round trip is not byte-exact"
