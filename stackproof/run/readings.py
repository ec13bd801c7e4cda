"""Readings that disturb no figure, taken beside a rank's other work instead of inside its first checks: from the
rank's session start, a thread of its own opens NVML for the rest of the rank's life (every later NVML session of
the checks is then a reference count, not NVML's start and shutdown) and reads the node's GPU inventory, while
the rank creates its CUDA context and joins the world. A check that needs the inventory waits for it, at most
WAIT_S, and gets the reading (or the error) it would have taken itself; not ready by then, it reads its own, as
before. The same evidence, judged the same way: only when it was read moves."""

from __future__ import annotations

import contextlib
import threading

from stackproof.measure import topology

# As long as the launcher's own NVML survey may take: past it NVML is stuck in the driver, and the check's own
# reading meets the same stall under the watchdog, which names it.
WAIT_S = topology.SURVEY_DEADLINE_S


class Early:
    """NVML held open, and the GPU inventory under `pci_root`, read in a thread started here."""

    def __init__(self, pci_root: str):
        self.pci_root = pci_root
        self._read = threading.Event()
        self._answer: dict[str, object] = {}
        self._held = contextlib.ExitStack()
        threading.Thread(target=self._take, name="stackproof-readings", daemon=True).start()

    def _take(self) -> None:
        try:
            self._held.enter_context(topology.nvml_session())  # left open: the process's exit ends it
            self._answer["inventory"] = topology.inventory(self.pci_root)
        except BaseException as err:  # NvmlUnavailable, or any error: the check raises it, as its own read would
            self._answer["error"] = err
        finally:
            self._read.set()

    def inventory(self, pci_root: str, wait_s: float = WAIT_S) -> topology.Inventory:
        """The inventory read early; raises what reading it raised (NvmlUnavailable). Read here when it is not
        there within `wait_s` or was read under another root."""
        if pci_root != self.pci_root or not self._read.wait(wait_s):
            return topology.inventory(pci_root)
        if "error" in self._answer:
            raise self._answer["error"]  # type: ignore[misc]
        return self._answer["inventory"]  # type: ignore[return-value]

    def close(self) -> None:
        """Give NVML back (a pytest run in a process that goes on; a rank leaves with os._exit instead)."""
        if self._read.wait(0):
            self._held.close()
