"""What the machine itself shows, read by healthcheck on the node: NVIDIA GPUs on the PCI bus (sysfs), the
evidence that a run which saw no GPU (exit 3) is the node's fault and not the launch's."""

from __future__ import annotations

from pathlib import Path

PCI_DEVICES = Path("/sys/bus/pci/devices")
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers (data-centre GPUs are 3D controllers)


def nvidia_gpus_on_pci(root: Path = PCI_DEVICES) -> int:
    """How many NVIDIA display / 3D controllers the PCI bus lists; 0 where sysfs cannot be read."""
    count = 0
    try:
        devices = list(root.iterdir())
    except OSError:
        return 0
    for device in devices:
        try:
            vendor = (device / "vendor").read_text().strip().lower()
            klass = (device / "class").read_text().strip().lower()
        except OSError:
            continue
        count += vendor == NVIDIA_VENDOR and klass.startswith(GPU_CLASSES)
    return count
