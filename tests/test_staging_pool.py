"""The staging copies' pinned-buffer pool (kvbench.serve.staging.PinnedPool) and the holds that
decide when a copy's buffer goes back: the logic runs here on unpinned CPU buffers; the CUDA path
that uses it (copy_out / copy_in with a pool) runs in the `cuda` tests of test_serve_cuda_layout."""

from __future__ import annotations

import torch

from kvbench.serve.staging import MIB, HostCopy, PinnedPool


class Event:
    """A stand-in for torch.cuda.Event: done when the test says so."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_pool_reuses_its_buffers_and_never_one_a_copy_still_uses():
    pool = PinnedPool(pin=False)
    first = pool.take(3 * MIB)
    assert first.numel() == 4 * MIB and first.dtype == torch.uint8  # powers of two from 1 MiB
    busy = Event()
    pool.give(first, busy)
    second = pool.take(2 * MIB)  # the only free buffer is still being copied: a new one
    assert second.data_ptr() != first.data_ptr() and (pool.allocations, pool.reuses) == (2, 0)
    busy.done = True
    again = pool.take(4 * MIB)
    assert again.data_ptr() == first.data_ptr() and (pool.allocations, pool.reuses) == (2, 1)
    pool.give(second)
    pool.give(again)
    assert pool.take(1).numel() == 2 * MIB  # the smallest that fits
    assert pool.take(5 * MIB).numel() == 8 * MIB and pool.allocations == 3  # none fits: allocated


def test_a_pool_over_its_budget_frees_what_comes_back():
    pool = PinnedPool(pin=False, keep_bytes=3 * MIB)
    a, b = pool.take(2 * MIB), pool.take(2 * MIB)  # 4 MiB owned
    pool.give(a)
    pool.give(b)  # the pool's share went down with a
    assert pool.take(2 * MIB).data_ptr() == b.data_ptr()
    assert pool.take(2 * MIB).data_ptr() not in (a.data_ptr(), b.data_ptr())


def test_a_view_is_the_buffers_first_bytes_in_shape():
    pool = PinnedPool(pin=False)
    buffer = pool.take(6 * 2).zero_()
    view = pool.view(buffer, (2, 3), torch.bfloat16)
    view.fill_(1.0)  # bf16 1.0: bytes 0x80 0x3f
    assert view.shape == (2, 3) and view.data_ptr() == buffer.data_ptr() and view.is_contiguous()
    assert buffer[:12].tolist() == [0x80, 0x3F] * 6 and not buffer[12:].any()


def test_a_copy_goes_back_once_its_last_hold_is_released():
    given = []
    copy = HostCopy([torch.zeros(4)], release_to=lambda: given.append(1))
    copy.acquire()  # a store job of one codec
    copy.acquire()  # and of another
    copy.release()  # the first job finished before the worker released its own hold
    copy.release()
    assert given == [] and copy.nbytes() == 16
    copy.release()  # the last hold
    assert given == [1] and copy.chunks == []
    copy.release()  # a stray release hands nothing back twice
    assert given == [1]
    HostCopy([torch.zeros(1)]).release()  # an unpooled copy (CPU, gather): nothing to hand back
