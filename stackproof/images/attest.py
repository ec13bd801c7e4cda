"""The proof travels with the image (docs/attest.md): `stackproof attest` signs a validation run's result as an
in-toto test-result statement about the image digest it ran in, per node class, and attaches it in the registry
(cosign, a key pair, no transparency log); `stackproof verify-image` says whether a digest holds a signed PASSED
result for a node class, recent enough, from a trusted key: exit 0, or exit 1 and one line naming what is missing.

cosign checks the signatures and the statement's shape (the CUE policy beside this file: every attestation of
the type must pass it); which result counts for which class, and how old it may be, is decided here.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from stackproof import __version__
from stackproof.errors import ConfigError, Exit
from stackproof.images import cosign, registry
from stackproof.images.ship import digest_of
from stackproof.judge.node_class import NodeClass, differences, of_gpus, of_run
from stackproof.measure import nics, topology
from stackproof.report.attestation import RECORD_FILE, read_record, record_line, write_record
from stackproof.report.record import Report, read_report

__all__ = ["PREDICATE_TYPE", "RECORD_FILE", "attest", "read_record", "record_line", "verify_image"]

PREDICATE_TYPE = "https://in-toto.io/attestation/test-result/v0.1"
POLICY = Path(__file__).with_name("test-result.cue")  # the statement's shape, run by cosign verify-attestation
PREDICATE_FILE = "attestation.predicate.json"  # the predicate as signed, kept beside it
RUN_CHECK = "stackproof::run"  # failedTests' entry for a run that failed without a failed check (a rank died)
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class DigestMismatch(Exception):
    """The tag of REPO:TAG@sha256:D names another digest than D now: the tag moved."""


@dataclasses.dataclass(frozen=True)
class Image:
    repository: str  # 127.0.0.1:5000/stackproof/validation
    digest: str  # sha256:...
    tag: str | None = None

    @property
    def pinned(self) -> str:
        return f"{self.repository}@{self.digest}"


def _split(reference: str) -> tuple[str, str | None, str | None]:
    """REPO[:TAG][@sha256:...] -> (REPO, TAG, DIGEST)."""
    name, _, digest = reference.partition("@")
    last = name.rsplit("/", 1)[-1]
    repository, tag = (name.rsplit(":", 1) if ":" in last else (name, None))
    if digest and not _DIGEST.match(digest):
        raise ConfigError(f"{reference}: expected @sha256:<64 hex> after the repository, found @{digest}; fix: copy "
                          "the digest make push printed")
    return repository, tag, digest or None


def resolve(reference: str) -> Image:
    """The digest a reference names in the registry: its own @sha256:... (checked against its tag, when it has
    both: DigestMismatch when the tag moved), else what the registry says the tag names. The registry is always
    asked (cosign would attach to, and find nothing on, a digest it does not hold): registry.NoSuchImage, or
    registry.RegistryUnreachable."""
    repository, tag, digest = _split(reference)
    if tag is None and digest is None:
        raise ConfigError(f"{reference}: expected REPO:TAG or REPO@sha256:..., found neither a tag nor a digest; fix: "
                          "name the image as make push printed it")
    tagged = digest_of(f"{repository}:{tag}") if tag else None
    if digest and tagged and tagged != digest:
        raise DigestMismatch(f"{repository}:{tag} now names {tagged}, not {digest}")
    if digest and not tagged:
        digest_of(f"{repository}@{digest}")  # held, or NoSuchImage
    return Image(repository, digest or str(tagged), tag)


def this_node_class(pci_root: str = topology.PCI_DEVICES, infiniband: str = nics.INFINIBAND) -> NodeClass:
    """This node's class from NVML (every GPU it shows, not only the visible ones) and sysfs (NICs). No NVML and no
    NVIDIA GPU on the PCI bus: the CPU class; no NVML but GPUs on the bus: exit 2 (the class cannot be known)."""
    try:
        inventory = topology.inventory(pci_root)
    except topology.NvmlUnavailable as err:
        if topology.nvidia_gpus_on_bus(pci_root):
            raise ConfigError(f"this node's class: expected NVML to describe the NVIDIA GPUs on its PCI bus, found "
                              f"{err}; fix: run where the driver is visible (NVIDIA_DRIVER_CAPABILITIES=utility), "
                              "or pass --node-class") from None
        return of_gpus([], None, None, None)
    models = [g.name for g in inventory.gpus] + ["unreachable GPU"] * len(inventory.unreachable)
    return of_gpus(models, inventory.driver_version, inventory.cuda_driver_version, nics.survey(infiniband))


# Attesting a run.

def _file_digest(path: str | None, what: str) -> dict[str, Any] | None:
    if not path:
        return None
    try:
        content = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"the run's --{what} {path}: expected the file the run used, to record its digest, found "
                          f"{err.strerror or err}; fix: pass --{what} FILE with that file") from None
    return {"name": what, "uri": Path(path).name, "digest": {"sha256": hashlib.sha256(content).hexdigest()}}


def predicate(data: dict[str, Any], image: Image, attested: datetime.datetime, spec: str | None = None,
              baseline: str | None = None) -> tuple[dict[str, Any], NodeClass]:
    """The test-result predicate of a finished run's record (read_report's data) and its node class. A run that
    was not OK is FAILED: the evidence is attested too, never hidden."""
    report = Report.from_json(data)
    made = of_run(report.ranks, report.context, report.settings)
    passed = report.exit_code == Exit.OK
    failed = [c.name for c in report.checks if c.outcome == "failed"]
    if not passed and not failed:
        failed = [RUN_CHECK]  # incomplete, interrupted: the run itself failed
    run = {"node": ",".join(sorted({str(r.get("node")) for r in report.ranks})), "finished": data.get("created"),
           "started": data.get("started"), "attested": attested.isoformat(timespec="seconds"),
           "verdict": data.get("verdict"), "exit_code": int(report.exit_code), "message": report.message,
           "tier": report.settings.get("tier"), "select": report.settings.get("select"),
           "skipped": [c.name for c in report.checks if c.outcome == "skipped"]}
    configuration = [
        {"name": "image", "uri": f"oci://{image.repository}", "digest": {"sha256": image.digest.split(":", 1)[1]}},
        {"name": "node-class", "annotations": {k: v for k, v in made.to_json().items() if v is not None}},
        {"name": "stackproof", "annotations": {"version": data.get("stackproof"), "attested_by": __version__}},
        *filter(None, (_file_digest(spec or report.settings.get("spec"), "spec"),
                       _file_digest(baseline or report.settings.get("baseline"), "baseline"))),
        {"name": "run", "annotations": run},
    ]
    return {"result": "PASSED" if passed else "FAILED", "configuration": configuration, "passedTests":
            [c.name for c in report.checks if c.outcome == "passed"], "warnedTests": [], "failedTests": failed}, made


def attest(reports: Path, image_ref: str | None, key: Path, spec: str | None = None, baseline: str | None = None,
           password: str | None = None) -> dict[str, Any]:
    """Sign the run of `reports` as a test result on its image digest and attach it; the record written beside
    report.json (RECORD_FILE) is returned."""
    data = read_report(reports)
    folder = reports if reports.is_dir() else reports.parent
    ran_in = (data.get("settings") or {}).get("image_ref")
    ref = image_ref or ran_in
    if not ref:
        raise ConfigError(f"{folder}: expected the image digest the run ran in (the run's --image-ref, which make "
                          "test-gpu sets from the image's RepoDigest), found none; fix: pass --image "
                          "REPO@sha256:... (the digest make push printed) or --image REPO:TAG")
    given = f"--image {ref}" if image_ref else f"the run's --image-ref {ref}"
    recorded = _split(ran_in)[2] if ran_in else None

    def ran_there(digest: str | None) -> None:  # a result is about the image it ran in, never another
        if recorded and digest and digest != recorded:
            raise ConfigError(f"--image {ref}: expected the digest the run ran in ({recorded}, its --image-ref "
                              f"{ran_in}), found {digest}; fix: attest the image the run ran in (--image "
                              f"{ran_in}), or validate this image and attest that run")

    ran_there(_split(ref)[2])  # before asking the registry: the reference's own digest says it
    try:
        image = resolve(ref)  # an unreachable registry is its failure, exit 1: nothing is wrong with the input
    except registry.NoSuchImage as err:
        raise ConfigError(f"{given}: expected an image digest the registry {registry.host(ref)} holds, found none "
                          f"(the registry: {err.found}); fix: {err.fix}") from None
    except DigestMismatch as err:
        raise ConfigError(f"{given}: expected the digest its tag names, found {err} (the tag moved); fix: attest "
                          "the digest the run ran in alone (REPO@sha256:...)") from None
    ran_there(image.digest)
    cosign.require_pinned_version()
    now = datetime.datetime.now(datetime.timezone.utc)
    made, node = predicate(data, image, now, spec, baseline)
    # Signed first, then in place: a failed attest leaves the predicate of the last one that succeeded, which
    # the record beside it describes.
    signing = folder / f".{PREDICATE_FILE}.signing"
    signing.write_text(json.dumps(made, indent=2) + "\n")
    try:
        cosign.attest(image.pinned, signing, PREDICATE_TYPE, key, password)
    except BaseException:
        signing.unlink(missing_ok=True)
        raise
    os.replace(signing, folder / PREDICATE_FILE)
    record = {"reference": image.pinned, "predicate_type": PREDICATE_TYPE, "result": made["result"],
              "node_class": node.text(), "attested": now.isoformat(timespec="seconds"),
              "predicate": PREDICATE_FILE}
    write_record(folder, record)
    return record


# Verifying an image.

@dataclasses.dataclass(frozen=True)
class Result:
    """One verified attestation, as verify-image reads it."""

    result: str
    node_class: NodeClass
    finished: datetime.datetime
    node: str
    failed: list[str]
    subject: str  # the digest the statement is about

    def to_json(self) -> dict[str, Any]:
        return {"result": self.result, "node_class": self.node_class.text(), "finished": self.finished.isoformat(),
                "node": self.node, "failed": self.failed, "subject": self.subject}


def _result(statement: dict[str, Any]) -> Result:
    predicate = statement["predicate"]
    parts = {c.get("name"): c for c in predicate["configuration"]}
    run = parts["run"]["annotations"]
    return Result(predicate["result"], NodeClass.from_json(parts["node-class"]["annotations"]),
                  datetime.datetime.fromisoformat(run["finished"] or run["attested"]), str(run.get("node")),
                  list(predicate.get("failedTests", [])), "sha256:" + statement["subject"][0]["digest"]["sha256"])


@dataclasses.dataclass
class Verdict:
    reference: str
    wanted: NodeClass
    ok: bool = False
    reason: str = ""
    digest: str | None = None
    found: list[Result] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        if self.ok:
            return f"verified {self.reference}: {self.reason}"
        return f"refused {self.reference}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "digest": self.digest, "node_class": self.wanted.text(), "ok": self.ok,
                "reason": self.reason, "attestations": [r.to_json() for r in self.found]}


def _unregistered(err: registry.NoSuchImage | registry.RegistryUnreachable) -> str:
    """verify-image's line when the registry holds no such image, or no registry answers: told apart."""
    where = registry.host(err.reference)
    if isinstance(err, registry.NoSuchImage):
        return f"no such image: the registry {where} holds none ({err.found}); fix: {err.fix}"
    return (f"registry unreachable: expected the registry {where} to answer, found no answer ({err.found}); "
            f"fix: {err.fix}")


def _age(seconds: float) -> str:
    return f"{seconds / 86400:.1f} d" if seconds >= 86400 else f"{seconds / 3600:.1f} h" if seconds >= 3600 \
        else f"{seconds:.0f} s"


def verify_image(reference: str, wanted: NodeClass, public_key: Path, max_age_s: float | None = None,
                 now: datetime.datetime | None = None) -> Verdict:
    """Whether `reference` holds a signed PASSED result for the `wanted` class: the newest result for the class
    decides (a later FAILED withdraws an earlier PASSED), and it must be no older than `max_age_s`."""
    cosign.require_pinned_version()
    verdict = Verdict(reference, wanted)
    try:
        image = resolve(reference)
    except DigestMismatch as err:
        verdict.reason = f"digest mismatch: {err} (the tag moved); fix: run the digest that was proven"
        return verdict
    except (registry.NoSuchImage, registry.RegistryUnreachable) as err:
        verdict.reason = _unregistered(err)
        return verdict
    verdict.digest = image.digest
    try:
        statements = cosign.verify(image.pinned, PREDICATE_TYPE, public_key, POLICY)
    except (registry.NoSuchImage, registry.RegistryUnreachable) as err:
        verdict.reason = _unregistered(err)
        return verdict
    except cosign.NotVerified as err:
        verdict.reason = {
            "none": f"no attestation: {image.pinned} holds no signed test result ({PREDICATE_TYPE}); fix: validate "
                    "it on this node class and attest the run (stackproof attest, make test-gpu ATTEST=1)",
            "other key": f"wrong key: {image.pinned} holds test results, none signed by the key {public_key}; fix: "
                         "verify with the public key of the key pair that attests your images (--key)",
            "policy": f"not a stackproof test result: an attestation on {image.pinned} fails {POLICY.name} "
                      f"({err.said}); fix: attach test results with stackproof attest only, or verify with a key "
                      "that signs nothing else of this type",
        }[err.why]
        return verdict
    verdict.found = [_result(s) for s in statements]
    others = [r for r in verdict.found if r.subject != image.digest]
    if others:
        verdict.reason = (f"digest mismatch: an attestation on {image.pinned} is about {others[0].subject}; fix: "
                          "validate this image itself and attest that run")
        return verdict
    mine = [r for r in verdict.found if not differences(r.node_class, wanted)]
    if not mine:
        attested = "; ".join(sorted({f"{r.result} for {r.node_class.text()}" for r in verdict.found}))
        closest = min(verdict.found, key=lambda r: len(differences(r.node_class, wanted)))
        verdict.reason = (f"wrong class: no result for {wanted.text()}; attested: {attested} (differs in "
                          f"{', '.join(differences(closest.node_class, wanted))}); fix: validate this image on a "
                          "node of this class and attest that run, or run the image on the class it was proven on")
        return verdict
    newest = max(mine, key=lambda r: r.finished)
    when = f"on {newest.node} at {newest.finished.isoformat(timespec='seconds')}"
    if newest.result != "PASSED":
        verdict.reason = (f"FAILED: the newest result for {wanted.text()} ({when}) failed "
                          f"{', '.join(newest.failed[:5]) or 'the run'}; fix: the image did not pass on this node "
                          "class: see that run's report, fix it and validate again")
        return verdict
    age = ((now or datetime.datetime.now(datetime.timezone.utc)) - newest.finished).total_seconds()
    if max_age_s is not None and age > max_age_s:
        verdict.reason = (f"too old: the newest PASSED result for {wanted.text()} ({when}) is {_age(age)} old, "
                          f"--max-age {_age(max_age_s)}; fix: validate the image on this node class again and "
                          "attest the run")
        return verdict
    verdict.ok, verdict.reason = True, f"PASSED for {wanted.text()} ({when}, {_age(age)} ago)"
    return verdict
