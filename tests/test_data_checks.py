"""The byte patterns every moved buffer carries, the compare that names the first wrong byte, the memory test and
the judgements of software on the CPU: each shown red by a fault patched into torch from outside (a copy that
spoils one byte, a store that drops a bit), and green without it."""

from __future__ import annotations

import pytest
import torch

from stackproof.judge import data, software
from stackproof.measure import bandwidth, memtest, patterns

CPU = torch.device("cpu")


def test_a_pattern_is_rebuilt_from_its_seed_alone_and_differs_per_seed():
    sent = patterns.made(1 << 16, patterns.seed_of("pair", 0, 1), CPU)
    assert patterns.first_wrong(sent, patterns.seed_of("pair", 0, 1)) is None
    crossed = patterns.first_wrong(sent, patterns.seed_of("pair", 1, 0))  # the other direction's data
    assert crossed is not None and crossed.offset == 0 and crossed.wrong > 60_000


def test_one_flipped_bit_is_named_by_offset_expected_and_found():
    buffer = patterns.made(3 << 20, 11, CPU)
    buffer[2_500_001] ^= 0x04
    wrong = patterns.first_wrong(buffer, 11, chunk_bytes=1 << 20)
    assert (wrong.offset, wrong.found ^ wrong.expected, wrong.wrong, wrong.nbytes) == (2_500_001, 0x04, 1, 3 << 20)
    finding = data.wrong_bytes("host-to-device copy", "512 MiB from pinned memory", wrong, 0, "GPU-x")
    assert (finding.category, finding.severity) == ("interconnect", "isolate")
    assert "byte 2500001 of 3145728" in finding.found and f"0x{wrong.expected:02x}" in finding.expected


def test_buffers_of_other_sizes_are_refused():
    with pytest.raises(ValueError, match="whole 8-byte words"):
        patterns.fill(torch.empty(12, dtype=torch.uint8), 1)


def test_the_memory_test_is_green_on_good_memory():
    result = memtest.run(CPU, 5, chunk_bytes=16 << 20, most_bytes=64 << 20)
    assert result.wrong == [] and result.tested_bytes == 32 << 20


@pytest.mark.parametrize("pattern", memtest.PATTERNS)
def test_the_memory_test_names_a_flipped_bit(monkeypatch, pattern):
    """The second chunk's write of one pattern lands with bit 3 of byte 777 flipped (patched into torch from
    outside: arange for the address pattern, Tensor.copy_ for the others), as a weak cell would."""
    writes = []

    def spoil(tensor):
        writes.append(tensor)
        if len(writes) == 2:  # chunk 1: the writes come chunk by chunk, before any compare
            tensor.reshape(-1).view(torch.uint8)[777] ^= 0x08

    if pattern == "address":
        real = torch.arange

        def arange(*args, out=None, **kwargs):
            result = real(*args, out=out, **kwargs)
            if out is not None and out.numel() * 8 == 16 << 20:
                spoil(out)
            return result
        monkeypatch.setattr(torch, "arange", arange)
    else:
        real_copy, period = torch.Tensor.copy_, {"walking": memtest.WALK_PERIOD, "random": memtest.TILE_WORDS}[pattern]

        def copy_(self, src, non_blocking=False):
            result = real_copy(self, src, non_blocking)
            if self.dim() == 2 and self.shape[1] == period:
                spoil(self)
            return result
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    result = memtest.run(CPU, 5, chunk_bytes=16 << 20, most_bytes=64 << 20)
    assert [(w.pattern, w.chunk, w.wrong.offset, w.wrong.found ^ w.wrong.expected) for w in result.wrong] == [
        (pattern, 1, 777, 0x08)]
    finding = data.wrong_bytes("memory test", "32 MiB", result.wrong[0].wrong, 0)
    assert (finding.category, finding.severity) == ("gpu-hardware", "isolate")


def test_the_sweeps_known_sum_is_exact_and_names_a_wrong_element():
    world, salt = 3, 4096
    shares = [torch.empty(1000) for _ in range(world)]
    for rank, share in enumerate(shares):
        bandwidth.fill_known_sum(share, rank, salt)
    total = sum(shares)
    assert bandwidth.wrong_sum(total, world, salt) is None
    total[517] += 1
    wrong = bandwidth.wrong_sum(total, world, salt)
    assert (wrong.index, wrong.found - wrong.expected, wrong.wrong) == (517, 1.0, 1)
    assert bandwidth.wrong_sum(total[:999], world + 1, salt) is not None  # another world's sum is wrong


def test_compile_must_show_a_graph_built_into_kernels():
    compiled = {"stats": {"unique_graphs": 1}, "inductor": {"fxgraph_cache_hit": 1}}
    assert software.compile_proof(compiled, 3, "Triton") is None
    eager = software.compile_proof({"stats": {}, "inductor": {}}, 0, "Triton")
    assert eager.category == "software-pins" and "dynamo traced no graph" in eager.found
    other = software.compile_proof({"stats": {"unique_graphs": 1}, "inductor": {}}, 0, "Triton")
    assert "inductor built no graph" in other.found


@pytest.mark.parametrize(("arch_list", "capability", "covered"), [
    (["sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"], (9, 0), True),
    (["sm_80"], (8, 6), True),  # a cubin runs on later minors of its major
    (["sm_90a"], (9, 0), True), (["sm_90a"], (9, 1), False),  # arch-specific cubins: that GPU only
    (["sm_80", "sm_86"], (9, 0), False),  # no sm_9x, no PTX: no kernel image for an H100/H200
    (["sm_75", "compute_75"], (9, 0), True),  # PTX is JIT-compiled for later GPUs
    (["sm_100", "sm_120"], (8, 0), False), ([], (9, 0), False),
])
def test_the_arch_list_covers_the_gpu_by_cudas_rules(arch_list, capability, covered):
    assert software.arch_covers(arch_list, capability) is covered
    finding = software.arch_finding(arch_list, capability, 0, "GPU-x", "NVIDIA H200")
    assert (finding is None) is covered
    if finding:
        assert finding.category == "software-pins" and "not broken" in finding.action
