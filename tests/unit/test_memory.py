"""commopt.reuse_freed_memory: a freed 64 MiB tensor stays with the process for reuse.

What the function controls is where glibc puts a large block and whether free() hands it
back: by default a 64 MiB tensor is a fresh mapping, unmapped when freed; afterwards it
comes from the heap, which keeps its size after the free. (Whether the kernel then keeps
the pages resident is the kernel's business; the benchmarks measure the effect.)
"""

import subprocess
import sys

import pytest

PROBE = r"""
import sys, torch
if sys.argv[1] == "reuse":
    import commopt
    assert commopt.reuse_freed_memory() is True, "glibc mallopt refused"

def mapping_of(address):
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return (fields[5] if len(fields) > 5 else "anonymous"), lo, hi
    return "unmapped", 0, 0

t = torch.ones(16 << 20)  # 64 MiB: above glibc's largest mmap threshold
kind, lo, hi = mapping_of(t.data_ptr())
end = t.data_ptr() + t.numel() * 4
del t
after, _, hi_after = mapping_of(end - 1)
print(kind, after, int(hi_after >= end))
"""


def _probe(mode: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_large_tensors_come_from_the_heap_and_stay_after_free():
    import ctypes.util

    if "libc.so" not in (ctypes.util.find_library("c") or ""):
        pytest.skip("not glibc: reuse_freed_memory does nothing here")
    kind, after, kept = _probe("default")
    assert kind == "anonymous" and after == "unmapped", (
        f"glibc's default should map a 64 MiB block apart and unmap it on free; got {kind}, {after}"
    )
    kind, after, kept = _probe("reuse")
    assert kind == "[heap]", f"reuse_freed_memory: the 64 MiB block came from {kind}, not the heap"
    assert after == "[heap]" and kept == "1", "reuse_freed_memory: the heap shrank after free()"
