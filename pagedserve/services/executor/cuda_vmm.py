"""The virtual layout's region on a GPU: CUDA virtual memory management through the `cuda-bindings` driver API
(`pip install 'pagedserve[gpu]'`). NOT RUN YET: written against the driver's documented calls, imported and
refused cleanly without a GPU by the tests; docs/layouts.md says what a GPU run must check.

A region reserves address space for the whole slab layout once (`cuMemAddressReserve`) and maps physical
pages of the allocation granularity (2 MiB on current GPUs) into it as the sequence grows (`cuMemCreate`,
`cuMemMap`, `cuMemSetAccess`): a kernel touching an unmapped page faults, so `ensure` maps before the forward
pass writes. `release` unmaps and frees the pages; the reservation stays for the next sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from .kv_regions import KVRegion

MISSING = ("the virtual KV layout on a GPU needs the CUDA driver bindings: pip install 'pagedserve[gpu]'"
           " (cuda-bindings)")


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise NotImplementedError(f"{MISSING}; importing them failed: {exc}") from None
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA virtual memory management needs a CUDA device, and torch sees none")
    return driver


def _call(result: Any, what: str) -> Any:
    """cuda-bindings returns (CUresult, *values): raise on an error, else the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: CUresult {int(err)} ({err})")
    return values[0] if len(values) == 1 else values


def _allocation_prop(driver: Any, device_index: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


def allocation_granularity(device: torch.device) -> int:
    """The page size of CUDA VMM on this device (the smallest size cuMemCreate maps)."""
    driver = _driver()
    torch.empty(1, device=device)  # torch makes the primary context current on this thread
    option = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_call(driver.cuMemGetAllocationGranularity(_allocation_prop(driver, device.index or 0), option),
                     "cuMemGetAllocationGranularity"))


class _CudaArray:
    """A device pointer that torch.as_tensor can wrap (__cuda_array_interface__), as int16 words: the
    interface has no bfloat16 type string, so the caller views the words as its dtype."""

    def __init__(self, pointer: int, num_words: int) -> None:
        self.__cuda_array_interface__ = {"shape": (num_words,), "typestr": "<i2", "data": (pointer, False),
                                         "version": 3}


class CudaVmmRegion(KVRegion):
    def __init__(self, shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        num_layers, two, capacity, num_kv_heads, head_dim = shape
        self.driver = driver = _driver()
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.page_size = allocation_granularity(torch.device("cuda", self.device_index))
        element = torch.empty((), dtype=dtype).element_size()
        self.token_bytes = num_kv_heads * head_dim * element
        self.slab_bytes = capacity * self.token_bytes
        if self.slab_bytes % self.page_size:
            raise ValueError(f"a slab of {self.slab_bytes} bytes is not whole {self.page_size}-byte CUDA pages")
        self.num_slabs = num_layers * two
        self.reserved = self.num_slabs * self.slab_bytes
        self.base = int(_call(driver.cuMemAddressReserve(self.reserved, self.page_size, 0, 0), "cuMemAddressReserve"))
        self.prop = _allocation_prop(driver, self.device_index)
        self.handles: list[list[Any]] = [[] for _ in range(self.num_slabs)]  # mapped pages per slab, in order
        words = torch.as_tensor(_CudaArray(self.base, self.reserved // 2), device=device)
        self.kv = words.view(dtype).view(shape)
        self.num_tokens = 0

    def pages_per_slab(self, num_tokens: int) -> int:
        return -(-num_tokens * self.token_bytes // self.page_size)

    def ensure(self, num_tokens: int) -> int:
        if num_tokens <= self.num_tokens:
            return 0
        driver, wanted, mapped = self.driver, self.pages_per_slab(num_tokens), 0
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device_index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for slab, pages in enumerate(self.handles):
            while len(pages) < wanted:
                address = self.base + slab * self.slab_bytes + len(pages) * self.page_size
                handle = _call(driver.cuMemCreate(self.page_size, self.prop, 0), "cuMemCreate")
                _call(driver.cuMemMap(driver.CUdeviceptr(address), self.page_size, 0, handle, 0), "cuMemMap")
                _call(driver.cuMemSetAccess(driver.CUdeviceptr(address), self.page_size, [access], 1),
                      "cuMemSetAccess")
                pages.append(handle)
                mapped += 1
        self.num_tokens = num_tokens
        return mapped

    def release(self) -> None:
        torch.cuda.synchronize(self.device_index)  # no kernel may still read a page being unmapped
        driver = self.driver
        for slab, pages in enumerate(self.handles):
            for i, handle in enumerate(pages):
                address = self.base + slab * self.slab_bytes + i * self.page_size
                _call(driver.cuMemUnmap(driver.CUdeviceptr(address), self.page_size), "cuMemUnmap")
                _call(driver.cuMemRelease(handle), "cuMemRelease")
            pages.clear()
        self.num_tokens = 0

    @property
    def committed_bytes(self) -> int:
        return sum(len(pages) for pages in self.handles) * self.page_size
