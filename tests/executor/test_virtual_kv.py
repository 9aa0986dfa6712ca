"""The virtual layout's CPU region against the kernel's own accounting (mincore): reserving commits
nothing, a write commits its pages, a release hands them back and they read as zeros; the GPU region refuses
cleanly where it cannot run."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pagedserve.services.executor.kv_regions import MappedRegion
from pagedserve.services.executor.virtual_kv import os_page_size, tokens_per_page, transparent_hugepages


def resident_bytes(region: MappedRegion) -> int:
    """The region's pages the kernel has in memory (mincore): exact to the range, unlike /proc/self/smaps,
    whose entries can merge the region with a neighbouring anonymous mapping."""
    page = os_page_size()
    length = region.kv.numel() * region.kv.element_size()
    resident = (ctypes.c_ubyte * (length // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    status = libc.mincore(ctypes.c_void_p(region.kv.data_ptr()), ctypes.c_size_t(length), resident)
    assert status == 0, f"mincore: errno {ctypes.get_errno()}"
    return sum(flag & 1 for flag in resident) * page


def test_a_region_commits_pages_as_it_is_written_and_releases_them() -> None:
    page = os_page_size()
    # 3 layers x (K, V) x 4096 tokens x 2 heads x 16 dims in fp32: 128-byte rows, 512 KiB per slab, 3 MiB reserved
    region = MappedRegion((3, 2, 4096, 2, 16), torch.float32, page)
    assert resident_bytes(region) == 0  # address space only
    assert region.ensure(100) == 6 * -(-100 * 128 // page)  # what the forward pass will write: 4 pages per slab
    region.kv[:, :, :100] = 1.0
    assert resident_bytes(region) == region.committed_bytes == 6 * 4 * page
    assert region.ensure(90) == 0 and region.ensure(129) == 6  # one more page per slab
    region.kv[:, :, 100:129] = 2.0
    assert resident_bytes(region) == region.committed_bytes
    region.release()
    assert resident_bytes(region) == 0 and region.committed_bytes == 0
    assert not region.kv[:, :, :129].any()  # the pages came back as zeros (read last: reads map the zero page)


def test_page_arithmetic_and_the_kernel_setting() -> None:
    assert tokens_per_page(128, 4096) == 32  # the tiny model's rows
    assert tokens_per_page(768, 4096) == 16  # SmolLM2 fp32: 3 KV heads x 64 dims x 4 bytes, 16 rows = 3 pages
    assert tokens_per_page(384, 2 << 20) == 16384  # SmolLM2 bf16 on 2 MiB CUDA pages: more than its context
    assert transparent_hugepages() in ("always", "madvise", "never", "unknown")


def test_the_gpu_region_imports_and_refuses_without_a_gpu() -> None:
    from pagedserve.services.executor import cuda_vmm

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the next test runs the region")
    with pytest.raises((NotImplementedError, RuntimeError), match=r"cuda-bindings|CUDA device"):
        cuda_vmm.CudaVmmRegion((1, 2, 4096, 2, 16), torch.float16, torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and pagedserve[gpu])")
def test_the_gpu_region_maps_pages_as_it_grows_and_unmaps_them() -> None:
    pytest.importorskip("cuda.bindings")
    from pagedserve.services.executor.cuda_vmm import CudaVmmRegion, allocation_granularity

    device = torch.device("cuda", 0)
    page = allocation_granularity(device)
    rows = page // 256  # 8 heads x 16 dims in fp16: 256-byte rows
    region = CudaVmmRegion((2, 2, 4 * rows, 8, 16), torch.float16, device)
    assert region.committed_bytes == 0
    assert region.ensure(rows + 1) == 4 * 2  # two pages in each of the 4 slabs
    region.kv[:, :, : rows + 1] = 1.5
    torch.cuda.synchronize()
    assert float(region.kv[:, :, : rows + 1].float().sum()) == 1.5 * 4 * (rows + 1) * 8 * 16
    region.release()
    assert region.committed_bytes == 0
    assert region.ensure(1) == 4  # the reservation is reused: pages mapped again
    region.kv[:, :, :1] = 0.0
    torch.cuda.synchronize()
    region.release()
