"""The node's RDMA NICs as sysfs lists them (/sys/class/infiniband/<device>/ports/<n>/{rate,link_layer}): the
network half of a node class (judge/node_class.py). NVML cannot see NICs; sysfs is what ibstat reads too."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

INFINIBAND = "/sys/class/infiniband"


def survey(root: str | Path = INFINIBAND) -> str | None:
    """'8 x 400 Gb/sec InfiniBand' (ports, grouped by rate and link layer); None when the node shows no RDMA
    device (or sysfs cannot be read): not known, rather than guessed."""
    ports: Counter[str] = Counter()
    try:
        devices = sorted(Path(root).iterdir())
    except OSError:
        return None
    for device in devices:
        for port in sorted((device / "ports").glob("*")):
            try:
                rate = (port / "rate").read_text().split("(")[0].strip()  # "400 Gb/sec (4X NDR)"
                layer = (port / "link_layer").read_text().strip()
            except OSError:
                continue
            ports[f"{rate} {layer}"] += 1
    return ", ".join(f"{count} x {kind}" for kind, count in sorted(ports.items())) or None
