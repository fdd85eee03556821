"""The KV pool asks for transparent huge pages before its first touch."""

from __future__ import annotations

import sys

import pytest
import torch

from shared.model.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages, huge_zeros

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")


def vm_flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_pool_is_zeros_on_pages_advised_huge() -> None:
    # 12 MiB: its middle lies in a whole huge page wherever the allocator put it (heap or mmap)
    pool = huge_zeros((4, 2, 256, 16, 3, 64), torch.bfloat16, torch.device("cpu"))
    assert pool.shape == (4, 2, 256, 16, 3, 64) and pool.dtype == torch.bfloat16
    assert not pool.any()
    middle = pool.data_ptr() + pool.numel() * pool.element_size() // 2
    assert "hg" in vm_flags_at(middle)  # MADV_HUGEPAGE: the kernel backs it with huge pages where it has them


def test_only_whole_huge_pages_inside_a_tensor_are_advised() -> None:
    assert advise_huge_pages(torch.empty(1024, dtype=torch.uint8)) == 0  # spans no whole huge page
    tensor = torch.empty(5 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    advised = advise_huge_pages(tensor)
    assert advised % HUGE_PAGE_BYTES == 0 and 4 * HUGE_PAGE_BYTES <= advised <= 5 * HUGE_PAGE_BYTES
