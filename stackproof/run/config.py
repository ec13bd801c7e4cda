"""The validation run's settings: one checked dataclass. The command line is generated from it (each flag is
declared once, here, with its help and its check), and the launcher hands it to every rank as that same
command line, so every rank runs with exactly the same settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from stackproof import environment
from stackproof.errors import ConfigError
from stackproof.files import folder_problem
from stackproof.judge.promise import TIERS
from stackproof.judge.spec import problem as spec_problem  # a bad file: exit 2 before any rank starts
from stackproof.measure.fabric import SYSFS
from stackproof.measure.health import KERNEL_LOG
from stackproof.measure.topology import PCI_DEVICES
from stackproof.report.baseline import problem as baseline_problem  # a bad file: exit 2 before any rank starts
from stackproof.run import launch_env
from stackproof.run.warm import DEFAULT_SOCKET as WARM_SOCKET
from stackproof.run.warm import SOCKET_ENV as WARM_SOCKET_ENV
from stackproof.settings import (
    Settings,
    at_least,
    between,
    flag_of,
    fraction,
    node_name,
    not_blank,
    option,
    parse_bytes,
    positive,
    seconds,
)

__all__ = ["ValidateConfig", "flag_of", "parse_bytes"]

FAULTS = ("allreduce-add-one", "perturb-grad", "hang", "crash", "sdc", "slow-gpu", "slow-node", "slow-link")
# The burn-in soak's length: long enough that the judge has a ramp, first sustained seconds and a last part of
# at least a sample each (judge/burn.py), short enough that a mistyped hour-long soak is refused, not run.
BURN_DEFAULT_S, BURN_MIN_S, BURN_MAX_S = 60.0, 5.0, 3600.0
# Time the burn tier needs beyond its soak: the fast tier's checks, warm-up, gathering the series.
BURN_HEADROOM_S = 120.0
REPORTS_ENV = environment.REPORTS.name
NODE_NAME_ENV = environment.NODE_NAME.name
STATE_DIR_ENV = "STACKPROOF_STATE_DIR"
STATE_UNDER_REPORTS = "state"  # the state folder's default place: beside the runs, kept with them
# A check may run this much longer than --timeout before the watchdog names the rank holding it up: the
# collective's own timeout and the cross-rank sync get the first chance to say it.
WATCHDOG_GRACE_S = 10.0
STRAGGLER_TOLERANCE_GPU = 0.10
PAIR_TOLERANCE_GPU = 0.25



# An OCI reference as `stackproof attest` reads it: REPO[:TAG][@sha256:<64 hex>], no spaces.
_REFERENCE = re.compile(r"(?:[A-Za-z0-9.-]+(?::\d+)?/)?[a-z0-9][a-z0-9._/-]*(?::[A-Za-z0-9_.-]+)?"
                        r"(?:@sha256:[0-9a-f]{64})?")


# CUDA_VISIBLE_DEVICES' entries: an index, a GPU or MIG UUID (or its GPU- prefix), a UUID without "GPU-".
_DEVICE = r"(?:\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9A-Za-z/-]+|[0-9a-fA-F]{8}-[0-9a-fA-F-]+)"
_DEVICES = re.compile(rf"{_DEVICE}(?:,{_DEVICE})*")


def device_list(v: str | None) -> str | None:
    return None if v is None or _DEVICES.fullmatch(v.replace(" ", "")) else \
        f"expected GPU indices or UUIDs, comma-separated (0,1 or GPU-8f6a...), found {v!r}"


def image_reference(v: str | None) -> str | None:
    return None if v is None or _REFERENCE.fullmatch(v) else \
        f"expected an image reference REPO@sha256:<64 hex> (or REPO:TAG), found {v!r}"

@dataclasses.dataclass(frozen=True)
class ValidateConfig(Settings):
    expect_gpus: int | None = option(
        None, "GPUs that must be visible on each node (default: >= 1 when NVIDIA_VISIBLE_DEVICES requests GPUs, "
              "else whatever is there; 0 validates on CPU)", metavar="N", check=at_least(0))
    pci_devices: str = option(PCI_DEVICES, "where sysfs lists the PCI bus's functions: the NVIDIA GPUs there are "
                                           "the GPUs the node must show when nothing else says how many, and each "
                                           "GPU's own PCIe width (LnkCap) is read there", metavar="DIR")
    kernel_log: str = option(KERNEL_LOG, "the kernel log searched for the GPUs' XID lines (a file works too; where "
                                         "it is not readable, journalctl -k is asked)", metavar="PATH")
    state_dir: str | None = option(None, "where each node keeps what its last health check read (the kernel log's "
                                         "watermark, the NVLink error counters), so evidence is judged since the "
                                         "last look; keep it between runs (the DaemonSet: a hostPath) (default: "
                                         f"{STATE_UNDER_REPORTS} under --reports)", metavar="DIR", check=not_blank,
                                   env=STATE_DIR_ENV)
    sysfs: str = option(SYSFS, "where sysfs is mounted: the NICs (class/infiniband, class/net), nvidia_peermem "
                               "(module/) and the PCI paths between GPUs and NICs are read there", metavar="DIR")
    max_link_downed: int = option(3, "times an RDMA port's link may have gone down (its link_downed counter) before "
                                     "it is a flapping link", metavar="N", check=at_least(0))
    emulated_nodes: bool = option(False, "test only: the nodes of this run are emulated on one machine (one launcher "
                                         "per node, a distinct NCCL_HOSTID each: docs/launchers.md) and share its "
                                         "GPUs; per-GPU checks then run once per GPU, and no bar is derived from "
                                         "NICs the emulated links do not cross", env="STACKPROOF_EMULATED_NODES")
    nproc: int = option(2, "CPU ranks when no GPU is visible", metavar="N", check=at_least(1))
    tier: str = option("full", "full: every check; fast: host, GPU identity and health, the per-GPU "
                               "checks and the local GPU pair matrix; burn: the fast tier, then every GPU "
                               "loaded at once for --burn-seconds, known answers checked throughout and each "
                               "GPU's sustained figures judged over time", choices=TIERS)
    burn_seconds: float = option(BURN_DEFAULT_S, f"--tier burn: how long every GPU is loaded at once "
                                                 f"({BURN_MIN_S:g} to {BURN_MAX_S:g} s)", metavar="S",
                                 check=between(BURN_MIN_S, BURN_MAX_S))
    burn_fraction: float = option(0.5, "--tier burn: fraction of the NVML-derived bf16 dense peak the last part "
                                       "of the soak must sustain (judge/burn.py)", metavar="F", check=fraction)
    burn_sag: float | None = option(None, "--tier burn: how far a GPU's last part may fall below its own first "
                                          "sustained seconds, as a fraction (default 0.10 on GPUs, 0.5 on CPU "
                                          "ranks, which share the host's cores)", metavar="F", check=fraction)
    nnodes: int = option(1, "nodes in the run; every node runs this same command (with --node-rank and "
                            "--master-addr, or --rdzv-endpoint)", metavar="N", check=at_least(1))
    node_rank: int | None = option(None, "this node's rank, 0..nnodes-1, for a static rendezvous at --master-addr",
                                   metavar="R", check=at_least(0))
    master_addr: str | None = option(None, "node 0's address (static rendezvous; node 0 hosts the store)",
                                     metavar="HOST")
    master_port: int = option(29500, "node 0's store port (static rendezvous)", metavar="PORT", check=at_least(1))
    rdzv_endpoint: str | None = option(None, "host:port of a c10d rendezvous (any node, usually the first): nodes "
                                             "join in any order and get node ranks in join order", metavar="HOST:PORT")
    rdzv_id: str = option("stackproof", "the run's name at --rdzv-endpoint: nodes join the run with their id",
                          metavar="ID")
    rendezvous_timeout: float = option(600.0, "seconds every rank may take to join at start-up (a large job's "
                                              "start-up skew)", metavar="S", check=seconds)
    timeout: float = option(300.0, "seconds one collective or cross-rank sync may take", metavar="S",
                            check=seconds)
    check_timeout: float | None = option(
        None, f"seconds one check may take before the watchdog names the rank holding it up (default: "
              f"--timeout + {WATCHDOG_GRACE_S:g})", metavar="S", check=seconds)
    run_timeout: float = option(1800.0, "seconds the whole run may take", metavar="S", check=seconds)
    min_busbw: float | None = option(None, "all_reduce busbw (GB/s) the largest size must reach (default: derived "
                                           "from the NVLink/PCIe topology on one node)", metavar="GBPS",
                                     check=at_least(0))
    busbw_fraction: float = option(0.5, "fraction of the topology's peak link bandwidth required when deriving",
                                   metavar="F", check=fraction)
    hbm_fraction: float = option(0.7, "fraction of the NVML-derived memory bandwidth a GPU's device copy must "
                                      "reach", metavar="F", check=fraction)
    pcie_fraction: float = option(0.7, "fraction of the NVML-derived PCIe bandwidth pinned host<->device copies "
                                       "must reach", metavar="F", check=fraction)
    gemm_fraction: float = option(0.6, "fraction of the NVML-derived bf16 dense peak an 8192^3 GEMM must reach",
                                  metavar="F", check=fraction)
    gpu_spread: float = option(0.10, "a GPU slower than the median of the job's GPUs of its model by more than "
                                     "this fraction fails", metavar="F", check=fraction)
    max_check_bytes: int | None = option(None, "largest all_reduce correctness buffer (default 256M on GPU, 16M on "
                                               "CPU)", metavar="SIZE", parse=parse_bytes, check=at_least(1))
    sweep_min: int | None = option(None, "bandwidth sweep start (default 8 on GPU, as nccl-tests -b 8; 64K on CPU)",
                                   metavar="SIZE", parse=parse_bytes, check=at_least(1))
    sweep_max: int | None = option(None, "bandwidth sweep end (default 4G on GPU, 4M on CPU)", metavar="SIZE",
                                   parse=parse_bytes, check=at_least(1))
    graph_max: int = option(64 << 20, "CUDA-graph sweep end (as nccl-tests -G, from --sweep-min; 0: none)",
                            metavar="SIZE", parse=parse_bytes, check=at_least(0))
    iters: int = option(20, "timed iterations per sweep size", metavar="N", check=at_least(1))
    warmup: int = option(5, "warm-up iterations per sweep size", metavar="N", check=at_least(0))
    train_batch: int | None = option(None, "ResNet-50 batch per rank (default 256 on GPU, 4 on CPU)", metavar="N",
                                     check=at_least(1))
    train_image_size: int | None = option(None, "ResNet-50 input size (default 224 on GPU, 64 on CPU)",
                                          metavar="PX", check=at_least(1))
    train_steps: int = option(3, "ResNet-50 training steps compared across ranks", metavar="N", check=at_least(2))
    bench_steps: int = option(20, "timed ResNet-50 steps for img/s", metavar="N", check=at_least(1))
    baseline: str | None = option(None, "fail a GPU's own figure worse than its median in this baseline (made by "
                                        "`stackproof baseline`) by more than its tolerance; the baseline must have "
                                        "an entry for this run's GPU model and topology (else exit 2)",
                                  metavar="PATH", check=baseline_problem)
    baseline_tolerance: float | None = option(None, "how much worse than its baseline any figure may be, as a "
                                                    "fraction of the baseline (default: each figure's own, derived "
                                                    "from the spread of the known-good runs, at least a floor per "
                                                    "unit)", metavar="F", check=positive)
    spec: str | None = option(None, "hold each node's GPUs to this node spec (made by `stackproof spec` from "
                                    "known-good runs; docs/spec.md): count, model, memory, NVLinks, PCIe, ECC, "
                                    "persistence, MIG, driver, VBIOS, power limit", metavar="PATH", check=spec_problem)
    job: str | None = option(None, "the job this node's GPUs were given to (a Slurm Prolog's SLURM_JOB_ID): another "
                                   "process holding one of them keeps the job off the node (a drain naming the pid) "
                                   "instead of an alert", metavar="ID", check=not_blank, env="SLURM_JOB_ID")
    skipped_gpus: str | None = option(None, "the node's GPUs this run leaves alone because a job uses them (their "
                                            "UUIDs, comma-separated; healthcheck --skip-busy-gpus sets it): a "
                                            "--spec counts them among the node's GPUs without judging them",
                                      metavar="UUIDS", check=not_blank)
    image: str | None = option(None, "compare runtime pins with this images/matrix.toml entry", metavar="NAME")
    expect_file: str | None = option(None, "compare runtime pins with this JSON (inside stackproof images: "
                                           "/etc/stackproof/expected.json)", metavar="PATH")
    image_ref: str | None = option(None, "the image this run is in, by digest (REPO@sha256:...), recorded in the "
                                         "report for `stackproof attest` (make test-gpu passes the image's RepoDigest)",
                                   metavar="REF", check=image_reference, env="STACKPROOF_IMAGE_REF")
    reports: str = option("reports", "where report.json, junit.xml and rank logs go; one run at a time per folder",
                          metavar="DIR", env=REPORTS_ENV, check=folder_problem)
    keep_runs: int = option(0, "keep each run in its own folder under --reports (runs/<started>-<pid>, the link "
                               "latest to the newest, last-acted to the one healthcheck last acted on), the newest "
                               "N and the one last acted on; 0: the run writes into --reports itself (one node "
                               "only: a multi-node run's folder is the job's)", metavar="N", check=at_least(0))
    warm_socket: str = option(WARM_SOCKET, "where a warm agent (`stackproof warm-agent`) listens: one node's ranks "
                                           "are forked from it, torch already imported; where none answers, "
                                           "they start cold, and the run says so", metavar="PATH",
                              check=not_blank, env=WARM_SOCKET_ENV)
    cold: bool = option(False, "start the ranks cold (each imports torch), even when a warm agent listens")
    min_shm: int = option(1 << 30, "bytes /dev/shm must hold, for NCCL's shared-memory transport and DataLoader "
                                   "workers", metavar="SIZE", parse=parse_bytes, check=positive,
                          env="STACKPROOF_MIN_SHM_BYTES")
    expect_declared: bool = option(False, "with no --image, --expect-file or baked-in expected.json, compare the "
                                          "runtime pins with what the image's ENV declares (PYTORCH_VERSION, "
                                          "CUDA_VERSION, ...; stackproof's validation layer sets it)",
                                   env="STACKPROOF_EXPECT_DECLARED")
    visible_devices: str | None = option(None, "check only these GPUs (indices or UUIDs, comma-separated, as "
                                               "CUDA_VISIBLE_DEVICES; the launcher hands them to its ranks so); "
                                               "default: every GPU this process sees", metavar="LIST",
                                         check=device_list)
    node_name: str | None = option(None, "this node's name in the report (what a drain or a taint names; default "
                                         "SLURMD_NODENAME, else the host name)", metavar="NAME", check=node_name,
                                   env=NODE_NAME_ENV)
    pair_bytes: int | None = option(None, "bytes each pair of ranks sends each way per exchange in the pairwise "
                                          "pass (default 256M on GPU, 1M on CPU)", metavar="SIZE", parse=parse_bytes,
                                    check=at_least(4))
    min_pair_gbps: float | None = option(None, "bandwidth (GB/s, each direction) every node pair, and every local "
                                               "pair without an NVML link (CPU ranks), must reach in the pairwise pass "
                                               "(default: --pair-tolerance below the job's reference)",
                                         metavar="GBPS", check=at_least(0))
    pair_tolerance: float | None = option(
        None, f"a pair slower than the job's reference (the median over nodes, or GPUs, of each one's best pair) by "
              f"more than this fraction is slow (default {PAIR_TOLERANCE_GPU:g} on GPUs; CPU ranks share the host's "
              f"cores, so there pair figures are reported and judged only when this or --min-pair-gbps is given)",
        metavar="F", check=fraction)
    straggler_tolerance: float | None = option(
        None, f"a rank whose own work before a collective (or DDP step) takes this fraction longer than the job's "
              f"median is a straggler (default {STRAGGLER_TOLERANCE_GPU:g} on GPUs; CPU ranks share the host's "
              f"cores, so there the timings are reported and judged only when this is given)", metavar="F",
        check=positive)
    inject_fault: str | None = option(None, "break something on purpose on --fault-rank, to prove the suite "
                                            "fails when it should; slow-node: every pair with a rank on the fault "
                                            "rank's node moves its data 10 times per exchange, and those ranks' timed "
                                            "work is 10x slower; slow-link: only pairs between the fault rank's node "
                                            "and the next node (node+1 mod nodes) do (on one node: the fault rank "
                                            "and the next local rank)", choices=FAULTS)
    fault_rank: int = option(1, "rank that --inject-fault breaks", metavar="R", check=at_least(0))
    select: str | None = option(None, "run only checks matching this pytest -k expression", flag="-k",
                                metavar="EXPR")
    pytest_args: tuple[str, ...] = option((), "extra pytest arguments, after --", metavar="PYTEST_ARGS",
                                          positional=True)

    def __post_init__(self) -> None:
        problems = self.field_problems()
        if self.timeout > self.run_timeout:
            problems.append(f"--timeout {self.timeout:g} must not exceed --run-timeout {self.run_timeout:g}")
        if self.tier == "burn" and self.burn_seconds + BURN_HEADROOM_S > self.run_timeout:
            problems.append(f"--burn-seconds {self.burn_seconds:g} needs --run-timeout of at least "
                            f"{self.burn_seconds + BURN_HEADROOM_S:g} (the soak + {BURN_HEADROOM_S:g} s for the "
                            f"other checks), found {self.run_timeout:g}; fix: raise --run-timeout (under healthcheck: "
                            "--deadline, which cuts it)")
        if self.sweep_min and self.sweep_max and self.sweep_min > self.sweep_max:
            problems.append(f"--sweep-min {self.sweep_min} must not exceed --sweep-max {self.sweep_max}")
        if self.expect_file and self.image:
            problems.append("--image and --expect-file: give one of them, not both")
        if self.nnodes > 1 and not self.rdzv_endpoint and (self.node_rank is None or not self.master_addr):
            problems.append(f"--nnodes {self.nnodes}: expected --rdzv-endpoint HOST:PORT (c10d) or --node-rank and "
                            "--master-addr (static), found neither")
        if self.keep_runs and self.nnodes > 1:
            problems.append(f"--keep-runs {self.keep_runs}: expected one node, found --nnodes {self.nnodes}; fix: "
                            "give a multi-node run a folder of its own (e.g. reports/slurm-<jobid>), --keep-runs 0")
        if self.baseline_tolerance is not None and not self.baseline:
            problems.append(f"--baseline-tolerance {self.baseline_tolerance:g}: expected with --baseline FILE (the "
                            "figures it loosens), found no --baseline")
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            problems.append(f"--node-rank {self.node_rank}: expected 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        self.refuse(problems, "stackproof validate --help")

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Any = None) -> ValidateConfig:
        """The settings, and what a launcher tells a rank through the environment (launch_env.told), checked
        with them: a value that is neither a switch nor a time is bad input here, before anything starts."""
        environ = environment.current() if environ is None else environ
        launched = environ.get(launch_env.LAUNCHED_ENV)
        try:
            launch_env.told(environ)
        except ValueError as err:
            cls.refuse([f"{launch_env.LAUNCHED_ENV}={launched!r} (set by the launcher that starts the ranks): {err}; "
                        "fix: unset it, or set it to 1 only where a launcher settles the verdict afterwards "
                        "(stackproof's own sets its start time)"], "stackproof validate --help")
        return super().from_args(args, environ)

    def pair_tolerance_on(self, gpu: bool) -> float | None:
        """--pair-tolerance, or the GPUs' default (also CPU ranks' when --min-pair-gbps asks them to be judged);
        None on CPU ranks otherwise: they share the host's cores, so their pair figures are reported only."""
        if self.pair_tolerance is not None:
            return self.pair_tolerance
        return PAIR_TOLERANCE_GPU if gpu or self.min_pair_gbps is not None else None

    def straggler_tolerance_on(self, gpu: bool) -> float | None:
        """--straggler-tolerance, or the GPUs' default; None on CPU ranks unless given (they share the cores)."""
        if self.straggler_tolerance is not None:
            return self.straggler_tolerance
        return STRAGGLER_TOLERANCE_GPU if gpu else None

    @property
    def watchdog_s(self) -> float:
        base = self.check_timeout if self.check_timeout is not None else self.timeout + WATCHDOG_GRACE_S
        return base + (self.burn_seconds if self.tier == "burn" else 0.0)  # the soak runs inside one check

    @property
    def skipped_gpu_count(self) -> int:
        return len([u for u in (self.skipped_gpus or "").split(",") if u.strip()])

    @property
    def health_state_dir(self):
        """The folder the health checks keep their last look in (measure/watermark.py)."""
        from pathlib import Path

        return Path(self.state_dir) if self.state_dir else self.reports_dir / STATE_UNDER_REPORTS

    @property
    def reports_dir(self):
        from pathlib import Path

        return Path(self.reports)

    @property
    def node(self) -> str:
        """This node's name, resolved in one place: --node-name, else the scheduler's in the environment, else the
        host's (measure/identity.py node_name)."""
        from stackproof.measure.identity import node_name

        return self.node_name or node_name(environment.current())

    def torchrun_rendezvous(self) -> list[str]:
        """torchrun's flags for this run's rendezvous (the launcher starts one torchrun agent per node)."""
        if self.rdzv_endpoint:
            wait = f"{self.rendezvous_timeout:.0f}"
            return [f"--nnodes={self.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.rdzv_endpoint}",
                    f"--rdzv-id={self.rdzv_id}",
                    f"--rdzv-conf=join_timeout={wait},read_timeout={wait},close_timeout=60"]
        if self.node_rank is not None and self.master_addr:
            return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                    f"--master-port={self.master_port}", f"--rdzv-conf=timeout={self.rendezvous_timeout:.0f}"]
        return ["--standalone", "--nnodes=1"]

    def check_world(self, world_size: int) -> None:
        """What can be judged only once the world's size is known: exit 2 before anything runs."""
        if self.inject_fault and self.fault_rank >= world_size:
            raise ConfigError(f"--fault-rank {self.fault_rank}: expected a rank of this run (0..{world_size - 1}), "
                              f"found {self.fault_rank}; a fault on a rank that does not exist proves nothing")
