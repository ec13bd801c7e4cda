"""How many GPUs a node must see, and the verdict when it sees fewer: one decision for the launcher, every rank
started by torchrun, srun or Kubernetes directly, and the scripts (`stackproof local-ranks`), so that a rank
without its GPU never passes on CPU by accident. With no flag and no scheduler hint the PCI bus says: a node
that shows N NVIDIA GPUs there must show N to NVML and CUDA, and the ones that fell off are named."""

from __future__ import annotations

from typing import IO

from stackproof import environment
from stackproof.errors import Exit
from stackproof.judge import hardware, reach
from stackproof.judge.expectation import BUS, expected_gpus
from stackproof.judge.findings import Finding
from stackproof.measure import cuda_reach, topology
from stackproof.report import outputs
from stackproof.report.record import Report
from stackproof.run.config import ValidateConfig


def hardware_verdict(settings: ValidateConfig, inventory: topology.Inventory | None, visible: int,
                     out: IO[str]) -> Report | None:
    """Before any rank starts: GPUs NVML counts but cannot reach, and GPUs on the PCI bus that NVML does not
    show, are findings on those GPUs: the record is written with them and the run ends with Exit.FAILED (none
    visible at all: no_gpu_verdict's Exit.NO_GPU)."""
    bus = topology.nvidia_gpus_on_bus(settings.pci_devices) or []
    expected = expected_gpus(settings.expect_gpus, environment.current(), bus)
    lost = inventory.unreachable if inventory else {}
    findings = [hardware.unreachable(index, error) for index, error in lost.items()]
    findings += [hardware.nvml_stalled(inventory.stalled)] if inventory and inventory.stalled else []
    if expected.source == BUS and visible:
        findings += hardware.missing_from_the_bus(topology.missing_from_nvml(bus, inventory),
                                                  len(inventory.gpus) if inventory else 0)
    if not findings:
        return no_gpu_record(settings, visible, out)
    message = (f"{len(findings)} GPU(s) expected but not reachable: " + " | ".join(map(str, findings)))
    return _conclude(settings, Exit.FAILED, message, out, findings, expected_gpus=expected.why,
                     visible_gpus=visible)


def no_gpu_verdict(settings: ValidateConfig, visible: int, out: IO[str], write_report: bool = True) -> Exit | None:
    """A rank's question (it counts CUDA's devices): Exit.NO_GPU when no_gpu_record says so."""
    record = no_gpu_record(settings, visible, out, write_report)
    return None if record is None else record.exit_code


def no_gpu_record(settings: ValidateConfig, visible: int, out: IO[str], write_report: bool = True) -> Report | None:
    """The record of exit 3, after saying so (and writing it, with the judge's finding), when GPUs are expected
    and none is visible (fewer than expected, but some, is the GPU check's failure: it names them)."""
    bus = topology.nvidia_gpus_on_bus(settings.pci_devices)
    expected = expected_gpus(settings.expect_gpus, environment.current(), bus)
    if not expected.count or visible:
        return None
    cause = why_no_gpu(expected.count, expected.why)
    message = (f"no GPU visible, but GPUs were expected ({expected.why}): expected >= {expected.count}, found "
               f"{visible}: {cause.check}: {cause.found}; fix: {cause.action} (or validate on CPU on purpose with "
               "--expect-gpus 0, or -e NVIDIA_VISIBLE_DEVICES=void)")
    return _conclude(settings, Exit.NO_GPU, message, out, [cause], write_report, expected_gpus=expected.count,
                     visible_gpus=visible, reason=expected.why)


def why_no_gpu(expected: int, why: str) -> Finding:
    """Why CUDA shows no GPU here (judge/reach.py): gpu-hardware (drain) only where NVML counts the GPUs, the
    runtime gave them and CUDA still cannot reach them; a CPU-only torch, a missing runtime or a driver/library
    mismatch is configuration (alert), with its fix. The finding of an exit 3, for the record."""
    return reach.no_gpu(cuda_reach.read(), expected, why)


def _conclude(settings: ValidateConfig, code: Exit, message: str, out: IO[str], findings: list[Finding],
              write_report: bool = True, **context) -> Report:
    """The record of a run that ends before its ranks: its findings, on this node; the verdict, then the path."""
    node = settings.node
    report = Report(override=(code, message), complete=True, settings=settings.to_json(),
                    findings=[f.at(node=node) for f in findings])
    report.context.update(context)
    lines = [f"# stackproof validate: {message}", f"# Verdict: {code.verdict} (exit code {int(code)}: "
                                                   f"{code.meaning})"]
    if write_report:
        lines.append(f"# report: {outputs.write(report, settings.reports_dir)}")
    print("\n".join(lines), file=out, flush=True)
    return report
