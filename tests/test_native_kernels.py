"""The compiled kernels (lut_kernels.c): every decode layout and width equals the unpacked formula,
on this CPU's vector width and on AVX2; the encode side's codes and packing equal the torch path;
the torch fallback is taken where they cannot run."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbench.methods import native, packing
from kvbench.methods.packing import count_below, lut_dots, lut_sums, pack, pack_planes, pack_sign_magnitude
from kvbench.methods.turboquant import MseQuantizer, TurboBlock

CPU_FLAGS = set(
    next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split()
)
HERE = Path(__file__)
# (layout, bits): FLAT (`pack`), SIGN_MAGNITUDE (3-bit, `pack_sign_magnitude`), PLANES (`pack_planes`)
CASES = [("flat", 1), ("flat", 2), ("flat", 4), ("sign_magnitude", 3), ("planes", 2), ("planes", 4)]


def packed_case(layout: str, bits: int, gen: torch.Generator, groups: int = 3, tokens: int = 300, dim: int = 64):
    """Random codes, their packed form and kernel keywords, and distinct random values per code (a
    wrong bit order, byte position or table entry changes the results)."""
    codes = torch.randint(0, 2**bits, (groups, tokens, dim), generator=gen)
    values = tuple(float(v) for v in torch.randn(2**bits, generator=gen))
    if layout == "sign_magnitude":
        magnitude, signs = pack_sign_magnitude(codes)
        return codes, values, magnitude.view(groups, tokens, -1), {"signs": signs.view(groups, tokens, -1)}
    if layout == "planes":
        return codes, values, pack_planes(codes, bits), {"planes": True}
    return codes, values, pack(codes, bits).view(groups, tokens, -1), {}


def check_against_formula(layout: str, bits: int, dim: int = 64, rows: int = 4) -> None:
    """Dots and sums, one query or one per 20 tokens, one weight per token or per 32 channels."""
    from kvbench.methods import native

    gen = torch.Generator().manual_seed(bits)
    codes, values, packed, kw = packed_case(layout, bits, gen, dim=dim)
    levels = torch.tensor(values)[codes]  # [G, T, D]
    calls = native.CALLS["native"]
    query, weights = torch.randn(3, rows, dim, generator=gen), torch.randn(3, rows, 300, generator=gen)
    assert torch.allclose(lut_dots(packed, bits, values, query, **kw), query @ levels.transpose(-1, -2), atol=1e-4)
    assert torch.allclose(lut_sums(packed, bits, values, weights, **kw), weights @ levels, atol=1e-3)
    # One query per 20 tokens (KIVI's per-group scales folded in); one weight per 32 channels.
    blocks = torch.randn(3, 15, rows, dim, generator=gen)
    expected = torch.einsum("gtrd,gtd->grt", blocks.repeat_interleave(20, dim=1), levels)
    assert torch.allclose(lut_dots(packed, bits, values, blocks, span=20, **kw), expected, atol=1e-4)
    grouped = torch.randn(3, rows, 300, dim // 32, generator=gen)
    expected = torch.einsum("grtd,gtd->grd", grouped.repeat_interleave(32, dim=-1), levels)
    assert torch.allclose(lut_sums(packed, bits, values, grouped, **kw), expected, atol=1e-3)
    assert native.CALLS["native"] - calls == 4  # each ran natively, none fell back


def in_own_process(script: str, cache: Path, **env: str) -> None:
    """Run `script` in a fresh interpreter (the kernels load once per process) with `env` set and
    a kernel cache of its own; it must exit 0."""
    env = os.environ | env | {"KVBENCH_KERNEL_CACHE": str(cache)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.skipif(
    not shutil.which(os.environ.get("CC", "cc")) or "avx2" not in CPU_FLAGS, reason="needs a C compiler and AVX2"
)
def test_the_kernels_build_and_load_on_this_machine():
    """Where they can run they do: a silent fallback would leave the decode budgets unmet unseen."""
    assert native.status().startswith("native"), native.status()
    assert native.status().startswith("native AVX-512" if "avx512f" in CPU_FLAGS else "native AVX2")


@pytest.mark.parametrize("layout, bits", CASES)
def test_kernels_equal_the_unpacked_formula(layout, bits):
    if native.library() is None:
        pytest.skip(native.status())
    check_against_formula(layout, bits)


@pytest.mark.parametrize("dim, rows", [(128, 4), (64, 1), (64, 17), (64, 40)])
def test_other_head_dims_and_more_query_rows_than_one_pass_takes(dim, rows):
    """head_dim 128 (the seeds' GPU models); 17 and 40 query rows per KV head take several passes
    of 16 (many query heads per KV head, or several new tokens)."""
    if native.library() is None:
        pytest.skip(native.status())
    for layout, bits in (("flat", 4), ("sign_magnitude", 3), ("planes", 2)):
        check_against_formula(layout, bits, dim=dim, rows=rows)


def test_results_do_not_depend_on_the_thread_count():
    if native.library() is None:
        pytest.skip(native.status())
    gen = torch.Generator().manual_seed(7)
    _, values, packed, kw = packed_case("sign_magnitude", 3, gen, tokens=3000)
    query, weights = torch.randn(3, 3, 64, generator=gen), torch.randn(3, 3, 3000, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append((lut_dots(packed, 3, values, query, **kw), lut_sums(packed, 3, values, weights, **kw)))
    finally:
        torch.set_num_threads(threads)
    for dots, sums in results[1:]:
        assert torch.equal(dots, results[0][0]) and torch.equal(sums, results[0][1])


def test_a_query_that_does_not_match_the_codes_is_refused():
    """The kernels read raw memory: a broadcastable but smaller query must not reach them."""
    if native.library() is None:
        pytest.skip(native.status())
    codes, values, packed, _ = packed_case("flat", 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="expected x"):
        lut_dots(packed, 2, values, torch.ones(1, 4, 64))
    with pytest.raises(ValueError, match="expected x"):
        lut_dots(packed, 2, values, torch.ones(3, 7, 4, 64), span=20)  # 15 blocks of 20 tokens needed


@pytest.mark.skipif("avx512f" not in CPU_FLAGS or "avx2" not in CPU_FLAGS, reason="AVX2 is the only path here")
def test_the_avx2_build_equals_the_formula_too(tmp_path):
    """Built without AVX-512 (as on the AVX2 machines), in a process of its own: decode and encode."""
    script = (
        f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); import test_native_kernels as t\n"
        "from kvbench.methods import native\n"
        "assert native.status().startswith('native AVX2'), native.status()\n"
        "for layout, bits in t.CASES + [('planes', 1)]:\n"
        "    t.check_against_formula(layout, bits)\n"
        "    t.check_against_formula(layout, bits, dim=128, rows=17)\n"
        "t.check_encode()\n"
    )
    in_own_process(script, tmp_path, KVBENCH_KERNEL_FLAGS="-mno-avx512f")


def test_switched_off_the_callers_get_none_and_the_status_says_so(tmp_path):
    script = (
        "import torch\n"
        "from kvbench.methods import native\n"
        "from kvbench.methods.packing import lut_dots, pack\n"
        "assert native.status().startswith('torch'), native.status()\n"
        "packed = pack(torch.zeros(2, 8, 64, dtype=torch.int64), 2).view(2, 8, -1)\n"
        "assert lut_dots(packed, 2, (0.0, 1.0, 2.0, 3.0), torch.ones(2, 1, 64)) is None\n"
    )
    in_own_process(script, tmp_path, KVBENCH_NATIVE_KERNELS="0")


def test_shapes_the_vector_code_does_not_take_fall_back():
    if native.library() is None:
        pytest.skip(native.status())
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 4, (2, 10, 12), generator=gen)  # 12 channels: not a whole vector
    assert lut_dots(pack(codes, 2).view(2, 10, -1), 2, (0.0, 1.0, 2.0, 3.0), torch.ones(2, 1, 12)) is None


def torch_path(call):
    """`call()` with the native kernels out of reach (the callers' torch path)."""
    saved, packing._encoder = packing._encoder, lambda x: None
    try:
        return call()
    finally:
        packing._encoder = saved


def with_threads(threads: int, call):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


def test_encode_kernels_equal_the_torch_path():
    if native.library() is None:
        pytest.skip(native.status())
    check_encode()


def check_encode() -> None:
    """Packing and a quantizer's codes (count of edges below), natively and in torch: every width,
    lengths that end mid-byte, codes as uint8/int64/bool or a strided view, values on an edge and its
    float32 neighbours, signed zeros, infinities and NaN, on one thread and on two."""
    threads = (1, 2) if native.threads(2) == 2 else (1,)  # two only where the kernels share torch's pool
    gen = torch.Generator().manual_seed(3)
    for bits in (1, 2, 4):
        for n in (0, 1, 7, 9, 1001, 600_001):  # the last is past the kernel's threading threshold
            codes = torch.randint(0, 2**bits, (n,), generator=gen)
            expected = torch_path(lambda: pack(codes, bits))
            for view in (codes, codes.to(torch.uint8), codes.repeat_interleave(2)[::2]):
                for t in threads:
                    assert torch.equal(with_threads(t, lambda: pack(view, bits, check=False)), expected), (bits, n)
    signs = torch.rand(1001, generator=gen) > 0.5
    assert torch.equal(pack(signs, 1), torch_path(lambda: pack(signs, 1)))
    for bits in (1, 2, 3, 4):
        mse = MseQuantizer(torch.linalg.qr(torch.randn(64, 64, generator=gen))[0], bits)
        x = torch.randn(3, 300, 64, generator=gen) / 8
        planted = torch.cat(
            [mse.edges, mse.edges.nextafter(torch.tensor(1.0)), mse.edges.nextafter(torch.tensor(-1.0))]
        )
        flat = x.view(-1)
        flat[: len(planted)] = planted  # on each edge (not below it) and one float32 step either side
        flat[100:106] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30])
        expected = sum((x > edge).to(torch.uint8) for edge in mse.edge_values)
        for t in threads:
            assert torch.equal(with_threads(t, lambda: count_below(x, mse.edges)), expected)
        # whole encodes, a prompt's size and a decode step's (torch's bucketize path), a NaN in each
        for rows in (x, x[0, :2].clone()):
            rows.view(-1)[5] = float("nan")
            assert torch.equal(mse.encode(rows)[0], torch_path(lambda: mse.encode(rows)[0]))


def test_turboquant_blocks_are_the_same_bytes_natively_and_in_torch():
    if native.library() is None:
        pytest.skip(native.status())
    gen = torch.Generator().manual_seed(4)
    sketch = torch.randn(64, 64, generator=gen)
    for x in (torch.randn(3, 256, 64, generator=gen), torch.randn(3, 1, 64, generator=gen)):  # a prompt, a step
        for bits in (3, 4):  # 3: sign-magnitude planes of 2 and 1 bits; 4: whole nibbles
            mse = MseQuantizer(torch.linalg.qr(torch.randn(64, 64, generator=gen))[0], bits)
            ours, theirs = TurboBlock(x, mse, sketch), torch_path(lambda: TurboBlock(x, mse, sketch))
            for name in ("packed", "code_signs", "norms", "signs", "residual_norms"):
                a, b = getattr(ours, name), getattr(theirs, name)
                assert (a is None and b is None) or torch.equal(a, b), name


ENCODE_SCRIPT = (
    "import hashlib, torch\n"
    "from kvbench.methods import native\n"
    "from kvbench.methods.turboquant import MseQuantizer, TurboBlock\n"
    "gen = torch.Generator().manual_seed(5)\n"
    "x, sketch = torch.randn(3, 256, 64, generator=gen), torch.randn(64, 64, generator=gen)\n"
    "mse = MseQuantizer(torch.linalg.qr(torch.randn(64, 64, generator=gen))[0], 3)\n"
    "block = TurboBlock(x, mse, sketch)\n"
    "parts = [block.packed, block.code_signs, block.norms, block.signs, block.residual_norms]\n"
    "print(native.status().split(' ')[0], hashlib.sha256(b''.join(p.numpy().tobytes() for p in parts)).hexdigest())\n"
)


def test_an_encode_with_the_kernels_switched_off_writes_the_same_bytes(tmp_path):
    """The encode side in a process of its own with KVBENCH_NATIVE_KERNELS=0 against one with the
    kernels: the same TurboQuant block, byte for byte (`torch_path` above only hides them)."""
    if native.library() is None:
        pytest.skip(native.status())
    env = os.environ | {"KVBENCH_KERNEL_CACHE": str(tmp_path)}
    run = [sys.executable, "-c", ENCODE_SCRIPT]
    on = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300, check=True).stdout.split()
    off = subprocess.run(
        run, env=env | {"KVBENCH_NATIVE_KERNELS": "0"}, capture_output=True, text=True, timeout=300, check=True
    ).stdout.split()
    assert (on[0], off[0]) == ("native", "torch") and on[1] == off[1]
