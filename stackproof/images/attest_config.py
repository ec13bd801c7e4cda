"""The flags of `stackproof attest` and `stackproof verify-image`, declared once (stackproof/settings.py)."""

from __future__ import annotations

import dataclasses
import math
import os
import re

from stackproof.settings import Settings, not_blank, option

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'30d', '12h', '90m', '45s' or seconds -> seconds."""
    match = _DURATION.match(str(text).strip().lower())
    if not match:
        raise ValueError(f"expected a duration such as 30d, 12h, 90m, 45s or seconds, found {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def key_file(v: str | None) -> str | None:
    """A cosign key the signing or the verifying reads: a file this user can read (not cosign's many lines)."""
    if v is None or (os.path.isfile(v) and os.access(v, os.R_OK)):
        return None
    found = "a folder" if os.path.isdir(v) else "a file this user may not read" if os.path.exists(v) else \
        "no such file"
    return f"expected a cosign key file (cosign generate-key-pair makes one), found {found}: {v!r}"


def age(v: float | None) -> str | None:
    """An age a result may reach: any positive length (not a wait: the 30-day cap on waits is not its)."""
    return None if v is None or (math.isfinite(v) and v > 0) else \
        f"expected an age > 0 (30d, 12h, 90m, seconds), found {v:g} s"


@dataclasses.dataclass(frozen=True)
class AttestConfig(Settings):
    reports: str = option("reports", "the validation run's reports folder (its report.json)", metavar="DIR",
                          check=not_blank, env="STACKPROOF_REPORTS")
    image: str | None = option(None, "the image the run ran in: REPO@sha256:... or REPO:TAG (its digest is asked "
                                     "of the registry); default: the run's --image-ref", metavar="REF",
                               check=not_blank)
    key: str = option("cosign.key", "cosign private key that signs the result (its password: COSIGN_PASSWORD)",
                      metavar="PATH", check=not_blank, env="STACKPROOF_ATTEST_KEY")
    spec: str | None = option(None, "the node spec the run used, when its recorded path is not readable here (its "
                                    "digest is attested)", metavar="PATH")
    baseline: str | None = option(None, "the baseline the run used, when its recorded path is not readable here",
                                  metavar="PATH")

    def __post_init__(self) -> None:
        self.refuse(self.field_problems(), "stackproof attest --help")


@dataclasses.dataclass(frozen=True)
class VerifyImageConfig(Settings):
    node_class: str | None = option(None, "the node class to hold the image to, as `stackproof node-class` prints "
                                          "it (gpu=...;gpus=...;driver=...;cuda=...); default: this node's, from "
                                          "NVML and sysfs", metavar="CLASS", check=not_blank,
                                    env="STACKPROOF_NODE_CLASS")
    spec: str | None = option(None, "also require the result to name this node spec (its file name, e.g. "
                                    "h200.spec.json)", metavar="NAME", check=not_blank)
    max_age: float | None = option(None, "refuse a PASSED result older than this (30d, 12h, 90m, seconds); "
                                         "default: any age", metavar="AGE", parse=parse_duration, check=age,
                                   env="STACKPROOF_ATTEST_MAX_AGE")
    key: str = option("cosign.pub", "the cosign public key the result must be signed with", metavar="PATH",
                      check=not_blank, env="STACKPROOF_ATTEST_PUB")
    json: bool = option(False, "print what was found as JSON (the verdict's line goes to stderr)")

    def __post_init__(self) -> None:
        self.refuse(self.field_problems(), "stackproof verify-image --help")
