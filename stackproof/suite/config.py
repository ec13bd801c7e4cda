"""The validation run's settings: one checked dataclass, shared by the launcher and every rank.

The launcher builds it from the command line, checks it, and hands it to the workers as JSON in
STACKPROOF_CONFIG, so every rank runs with exactly the same settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from stackproof.errors import ConfigError

CONFIG_ENV = "STACKPROOF_CONFIG"
# TEMP (per-gpu branch): "sdc" and "slow-gpu" added here until the lead's FAULTS has them.
FAULTS = ("allreduce-add-one", "perturb-grad", "hang", "crash", "sdc", "slow-gpu")


@dataclasses.dataclass(frozen=True)
class ValidateConfig:
    reports: str = "reports"
    # None: decide from the environment (NVIDIA_VISIBLE_DEVICES) — see launcher.expected_gpus.
    expect_gpus: int | None = None
    # Processes on CPU (gloo); on GPUs one process per visible GPU.
    cpu_procs: int = 2
    # Seconds any one collective, rendezvous or cross-rank sync may take before the run fails.
    timeout_s: float = 300.0
    # Seconds the whole run may take.
    run_timeout_s: float = 1800.0
    # Largest all_reduce correctness buffer; None: 256 MiB on GPU, 1 MiB on CPU.
    max_check_bytes: int | None = None
    # Bandwidth sweep; None: 1 MiB..4 GiB on GPU, 64 KiB..4 MiB on CPU.
    sweep_min_bytes: int | None = None
    sweep_max_bytes: int | None = None
    sweep_warmup: int = 5
    sweep_iters: int = 20
    # Pass threshold for busbw at the largest size; None: derived from the measured topology.
    min_busbw_gbps: float | None = None
    # Fraction of the topology's peak per-GPU bandwidth the largest size must reach.
    busbw_fraction: float = 0.5
    # ResNet-50 step: per-rank batch and image size; None: 256 / 224 on GPU, 4 / 64 on CPU.
    train_batch: int | None = None
    train_image_size: int | None = None
    train_steps: int = 3
    bench_steps: int = 20
    # Expected versions: a JSON file of {torch, torchvision, cuda, cudnn, nccl, python}, or a matrix image name.
    expect_file: str | None = None
    image: str | None = None
    pytest_args: tuple[str, ...] = ()
    # Break something on purpose to prove the suite turns red: see FAULTS.
    inject_fault: str | None = None
    fault_rank: int = 1

    def __post_init__(self) -> None:
        problems = []
        if self.expect_gpus is not None and self.expect_gpus < 0:
            problems.append("expect_gpus must be >= 0")
        if self.cpu_procs < 1:
            problems.append("cpu_procs must be >= 1")
        if self.timeout_s <= 0 or self.run_timeout_s <= 0:
            problems.append("timeout_s and run_timeout_s must be > 0")
        if self.timeout_s > self.run_timeout_s:
            problems.append("timeout_s must not exceed run_timeout_s")
        for name in ("max_check_bytes", "sweep_min_bytes", "sweep_max_bytes", "train_batch", "train_image_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be >= 1")
        if self.sweep_min_bytes and self.sweep_max_bytes and self.sweep_min_bytes > self.sweep_max_bytes:
            problems.append("sweep_min_bytes must not exceed sweep_max_bytes")
        if self.sweep_iters < 1 or self.sweep_warmup < 0 or self.train_steps < 2 or self.bench_steps < 1:
            problems.append("sweep_iters >= 1, sweep_warmup >= 0, train_steps >= 2, bench_steps >= 1")
        if self.min_busbw_gbps is not None and self.min_busbw_gbps < 0:
            problems.append("min_busbw_gbps must be >= 0")
        if not 0 < self.busbw_fraction <= 1:
            problems.append("busbw_fraction must be in (0, 1]")
        if self.inject_fault is not None and self.inject_fault not in FAULTS:
            problems.append(f"inject_fault must be one of {', '.join(FAULTS)}")
        if self.expect_file and self.image:
            problems.append("give expect_file or image, not both")
        if problems:
            values = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
            raise ConfigError(f"invalid validate settings: {'; '.join(problems)} (got {values})")

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> ValidateConfig:
        raw = os.environ.get(CONFIG_ENV)
        if not raw:
            return cls()
        values = json.loads(raw)
        values["pytest_args"] = tuple(values.get("pytest_args", ()))
        return cls(**values)

    @property
    def reports_dir(self) -> Path:
        return Path(self.reports)
