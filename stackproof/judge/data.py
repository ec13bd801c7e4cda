"""Wrong data on a path that moved it: a finding on the GPU or the link that moved the bytes, with where the
first wrong byte is and what it held. Pure functions on what measure/patterns.py compared (no torch).

Whose fault a wrong byte is follows the path: a device-to-device copy or a memory test touches only the GPU's
own memory and copy engines (the GPU: isolate, RMA); a host <-> device copy crosses the PCIe link, its riser,
switch and the host's IOMMU (the link: isolate the GPU's node, since both ends are in it); data between ranks
crosses NVLink / PCIe / the network (the link between the two ranks). Wrong data is never a slow figure: a
GPU or link that delivers it must not train."""

from __future__ import annotations

from stackproof.judge.findings import RMA, Finding

# path: (category, severity, the fix)
PATHS = {
    "device-to-device copy": ("gpu-hardware", "isolate",
                              "a copy inside the GPU's memory came back wrong (an HBM channel or a copy engine): "
                              + RMA),
    "memory test": ("gpu-hardware", "isolate",
                    "the GPU's memory did not hold what was written (dcgmi diag -r 3 repeats DCGM's memory test): "
                    + RMA),
    "host-to-device copy": ("interconnect", "isolate",
                            "pinned host memory arrived on the GPU wrong: check the PCIe slot, riser and cable, the "
                            "IOMMU settings, and the host's memory (edac-util); reseat the GPU, and if it recurs RMA "
                            "the riser or the GPU"),
    "device-to-host copy": ("interconnect", "isolate",
                            "the GPU's data arrived in pinned host memory wrong: check the PCIe slot, riser and "
                            "cable, the IOMMU settings, and the host's memory (edac-util); reseat the GPU"),
    "send/recv": ("interconnect", "isolate",
                  "data between two ranks arrived wrong: check the link between them (nvidia-smi nvlink -e; across "
                  "nodes the NIC, cable and switch port: ibstat, perfquery), then run the pair again"),
    "collective": ("interconnect", "isolate",
                   "a collective's result was wrong: check the driver/NCCL pair, NCCL_PROTO/NCCL_ALGO overrides and "
                   "each GPU's ECC, then run the pair checks to name the link"),
}


def wrong_data(path: str, what: str, where: str, expected: str, found: str, gpu_index: int | None = None,
               uuid: str = "") -> Finding:
    """`path` (a PATHS key) moved `what` (e.g. '1 GiB, 50 copies') and the first wrong byte is at `where`."""
    category, severity, action = PATHS[path]
    return Finding(gpu_index, uuid, f"data through {path}", f"{what} delivered intact ({where}: {expected})",
                   f"{where}: {found}", category, severity, action)


def wrong_bytes(path: str, what: str, wrong, gpu_index: int | None = None, uuid: str = "") -> Finding:
    """A finding from measure.patterns.WrongBytes (offset, expected, found, wrong, nbytes)."""
    return wrong_data(path, what, f"byte {wrong.offset} of {wrong.nbytes}", f"0x{wrong.expected:02x}",
                      f"0x{wrong.found:02x} ({wrong.wrong} byte(s) wrong in that chunk)", gpu_index, uuid)


def wrong_values(path: str, what: str, wrong, gpu_index: int | None = None, where: str = "") -> Finding:
    """A finding from measure.known_answers.Mismatch (index, found, expected, wrong): the first element off its
    known answer. `where`: the element, when more than its index says (which rank sent it)."""
    return wrong_data(path, what, where or f"index {wrong.index}", f"{wrong.expected}",
                      f"{wrong.found} ({wrong.wrong} element(s) wrong)", gpu_index)
