"""What a node remembers between health checks, so evidence is judged since the last look: per GPU (by UUID), the
time its kernel log was read up to (the watermark) and the NVLink error counters read then. A later check judges
only XIDs logged after the watermark and counters that grew since that reading; the first reading of a GPU sets
the baseline and judges no counter as old evidence.

One small JSON file per GPU under <state folder>/<node>/ (--state-dir), replaced atomically (written beside it,
then renamed), so the ranks of one node never write the same file and a reader never sees half of one. A reboot
(a new /proc/sys/kernel/random/boot_id) starts a new kernel log and zeroes the counters: the watermark is then
dropped and the counters' baseline is zero. Nothing here decides; a state that cannot be read or written is
said in `problem`, for judge/health.py to judge."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

BOOT_ID = "/proc/sys/kernel/random/boot_id"
SCHEMA = "stackproof.health-state/1"


@dataclasses.dataclass
class Previous:
    """The last look at one GPU, as far as it still applies to this boot."""
    looked_at: float | None = None  # wall time (s) the kernel log was judged up to; None: never (this boot)
    # {link: {counter: count}} read then; None: no reading to compare with (the first look judges nothing old).
    nvlink: dict[int, dict[str, int]] | None = None
    # Other counters judged as growth since the last look ({name: value}; e.g. DCGM's), None: no reading then.
    counters: dict[str, float] | None = None
    problem: str = ""  # why the state could not be read ("" when it could, or there was none)


def boot_id(path: str = BOOT_ID) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def state_file(state_dir: str | Path, node: str, uuid: str) -> Path:
    return Path(state_dir) / _safe(node) / f"{_safe(uuid)}.json"


def load(state_dir: str | Path, node: str, uuid: str, boot: str | None = None) -> Previous:
    """The last look at this GPU on this node: nothing (a first look) when there is no file; a file from an
    earlier boot keeps no watermark and a zero baseline (the counters restarted with the driver)."""
    path = state_file(state_dir, node, uuid)
    try:
        saved = json.loads(path.read_text())
        looked_at = saved["looked_at"]
        nvlink = {int(link): {name: int(count) for name, count in counts.items()}
                  for link, counts in saved["nvlink"].items()} if saved.get("nvlink") is not None else None
        counters = ({str(name): float(value) for name, value in saved["counters"].items()}
                    if saved.get("counters") is not None else None)
        saved_boot = saved.get("boot_id")
    except FileNotFoundError:
        return Previous()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return Previous(problem=f"{path}: {type(err).__name__}: {err}")
    if boot is not None and saved_boot is not None and saved_boot != boot:
        return Previous(looked_at=None, nvlink={}, counters={})  # rebooted: the log and the counters are new
    return Previous(looked_at=None if looked_at is None else float(looked_at), nvlink=nvlink, counters=counters)


def save(state_dir: str | Path, node: str, uuid: str, looked_at: float | None,
         nvlink: dict[int, dict[str, int | None]] | None, boot: str | None = None,
         counters: dict[str, float | None] | None = None) -> str:
    """Keep this look as the next one's baseline; '' when kept, else why not."""
    path = state_file(state_dir, node, uuid)
    counts = None if nvlink is None else {str(link): {name: count for name, count in values.items()
                                                      if count is not None} for link, values in nvlink.items()}
    record = {"schema": SCHEMA, "node": node, "uuid": uuid, "boot_id": boot, "looked_at": looked_at,
              "nvlink": counts, "counters": None if counters is None else {
                  name: value for name, value in counters.items() if value is not None}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(partial, path)
    except OSError as err:
        return f"{path}: {err.strerror or err}"
    return ""


def merged(before: dict[int, dict[str, int]] | None, now: dict[int, dict[str, int | None]]
           ) -> dict[int, dict[str, int]]:
    """The counters to keep: this reading's, and the previous one's where this one has none (a link down now,
    a counter NVML did not answer), so a link that comes back up is not judged on its whole history."""
    kept = {link: dict(counts) for link, counts in (before or {}).items()}
    for link, counts in now.items():
        kept.setdefault(link, {}).update({name: count for name, count in counts.items() if count is not None})
    return kept


def advance(state_dir: str | Path, node: str, uuid: str, looked_at: float, boot: str | None = None) -> str:
    """Move the watermark on to `looked_at` (NVML watched the GPU's XIDs live until then), keeping the counters;
    '' when kept, else why not."""
    previous = load(state_dir, node, uuid, boot)
    if previous.problem:
        return previous.problem
    if previous.looked_at is not None and previous.looked_at >= looked_at:
        return ""
    return save(state_dir, node, uuid, looked_at, previous.nvlink, boot, previous.counters)


def _safe(name: str) -> str:
    """A node name or UUID as one path component."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "_"


@dataclasses.dataclass(frozen=True)
class Memory:
    """One node's state folder, as the health checks use it (a rank knows its node and the folder)."""
    state_dir: str | Path
    node: str
    boot: str | None = dataclasses.field(default_factory=boot_id)

    def previous(self, uuid: str) -> Previous:
        return load(self.state_dir, self.node, uuid, self.boot)

    def keep(self, uuid: str, looked_at: float | None, nvlink: dict[int, dict[str, int | None]] | None,
             counters: dict[str, float | None] | None = None) -> str:
        return save(self.state_dir, self.node, uuid, looked_at, nvlink, self.boot, counters)

    def advance(self, uuid: str, looked_at: float) -> str:
        return advance(self.state_dir, self.node, uuid, looked_at, self.boot)


def snapshot(state_dir: str | Path, node: str) -> dict[Path, bytes]:
    """Every GPU's last look on this node as it is now (the files' bytes), to `restore` after a run whose
    evidence must be judged again; {} when there is none (or it cannot be read: nothing to restore then)."""
    folder = Path(state_dir) / _safe(node)
    try:
        return {path: path.read_bytes() for path in folder.glob("*.json")}
    except OSError:
        return {}


def restore(taken: dict[Path, bytes], state_dir: str | Path, node: str) -> str:
    """Put this node's last looks back as `snapshot` took them, and drop the GPUs' looks made since (their
    evidence is judged again by the next run); '' when done, else why not."""
    folder = Path(state_dir) / _safe(node)
    try:
        for path in folder.glob("*.json"):
            if path not in taken:
                path.unlink()
        for path, data in taken.items():
            partial = path.with_name(f".{path.name}.{os.getpid()}")
            partial.write_bytes(data)
            os.replace(partial, path)
    except OSError as err:
        return f"{folder}: {err.strerror or err}"
    return ""
