"""Ship built images: push to a registry under a readable and an immutable tag, sign them and attach their SBOM
with cosign (a key pair you provide, no transparency log), verify, and audit the locks with pip-audit.

    python -m stackproof.images.ship push   --registry HOST[:PORT]/PREFIX --revision REV [--image NAME | --all]
    python -m stackproof.images.ship sign   --registry ... --revision REV --key cosign.key [--image NAME | --all]
    python -m stackproof.images.ship verify --registry ... --key cosign.pub [--revision REV] [--image | --all]
    python -m stackproof.images.ship audit  [--image NAME | --all] [--strict]

stackproof/pytorch:<tag> goes to REGISTRY/pytorch:<tag>, stackproof/validation:<tag> to REGISTRY/validation:<tag>.
Every step is the well-kept tool (docker push, skopeo inspect, cosign, cyclonedx-py, pip-audit) with a timeout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stackproof.errors import ConfigError, StackproofError
from stackproof.images import bake, cosign, registry, sbom
from stackproof.images.locks import VALIDATION_LOCK, lock_digest
from stackproof.images.matrix import NAMESPACE, Image, Matrix, load_matrix
from stackproof.tools import run_tool

PUSH_TIMEOUT_S = 3600
TOOL_TIMEOUT_S = 300
# skopeo inspect reads one manifest: a registry that takes the connection and does not answer in this long is
# unreachable (skopeo's --command-timeout: it says "context deadline exceeded"), well before TOOL_TIMEOUT_S.
INSPECT_TIMEOUT_S = 60
# cosign attest --type: the predicate type recorded for the SBOM attestation.
SBOM_PREDICATE = "cyclonedx"
# Tag characters per the OCI distribution spec; at most 128.
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_REGISTRY = re.compile(r"^[A-Za-z0-9.-]+(:\d+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")


class ShipError(StackproofError):
    """A push, sign, verify or audit step failed (exit 1): the message names the step, the image and the fix."""


@dataclasses.dataclass(frozen=True)
class Shipped:
    """One image as it goes to the registry."""

    image: Image
    layer: str  # runtime | validation (a lab image is one 'runtime' layer)
    local: str  # the tag make build gave it
    repository: str  # REGISTRY/pytorch
    readable: str  # 2.14.1-cu13.0-runtime
    immutable: str  # 2.14.1-cu13.0-runtime-lock.<12 hex>-git.<12 hex>

    @property
    def tags(self) -> tuple[str, str]:
        return (f"{self.repository}:{self.readable}", f"{self.repository}:{self.immutable}")


def immutable_tag(image: Image, layer: str, revision: str) -> str:
    """The readable tag + the content hash of the image's locks + the git revision it was built from."""
    readable = _readable(image, layer)
    if not re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", revision):
        raise ConfigError(f"--revision {revision!r}: expected a git commit hash (git rev-parse HEAD), "
                          "optionally followed by -dirty")
    dirty = "-dirty" if revision.endswith("-dirty") else ""
    return f"{readable}-lock.{lock_digest(image, layer)[:12]}-git.{revision[:12]}{dirty}"


def _readable(image: Image, layer: str) -> str:
    return image.version_tag  # the same for both layers (bake.validation_tag)


def layers(image: Image) -> tuple[str, ...]:
    return ("runtime",) if image.flavor == "lab" else ("runtime", "validation")


def plan(image: Image, registry: str, revision: str, namespace: str = NAMESPACE) -> list[Shipped]:
    if not _REGISTRY.match(registry):
        raise ConfigError(f"REGISTRY={registry!r}: expected host[:port]/prefix, e.g. localhost:5000/stackproof")
    shipped = []
    for layer in layers(image):
        local = bake.validation_tag(image, namespace) if layer == "validation" else image.tag_in(namespace)
        name = local.split(":", 1)[0].rsplit("/", 1)[-1]  # pytorch | validation, whatever the local namespace
        shipped.append(Shipped(image, layer, local, f"{registry.rstrip('/')}/{name}", _readable(image, layer),
                               immutable_tag(image, layer, revision)))
    return shipped


def _run(step: str, cmd: list[str], fix: str, timeout: float = TOOL_TIMEOUT_S, **kwargs) -> str:
    return run_tool(step, cmd, timeout_s=timeout, fix=fix, error=ShipError, missing_fix=(
        "scripts/ci/registry.sh installs docker-registry, skopeo and cosign (apt-get install skopeo cosign)"),
        **kwargs)


def _insecure(repository: str) -> bool:
    # docker and cosign talk plain HTTP to a loopback registry by themselves; skopeo must be told.
    host = repository.split("/", 1)[0].rsplit(":", 1)[0]
    return host == "localhost" or host.startswith("127.") or host == "[::1]"


def skopeo_inspect(reference: str, template: str) -> str:
    """What skopeo reads of `reference` in the registry; registry.NoSuchImage when the registry answers that it
    holds none, registry.RegistryUnreachable when no registry answers."""
    tls = ["--tls-verify=false"] if _insecure(reference) else []
    try:
        return _run(f"skopeo inspect {reference}", ["skopeo", "--command-timeout", f"{INSPECT_TIMEOUT_S}s", "inspect",
                                                    *tls, "--format", template, f"docker://{reference}"],
                    "check the reference and that the registry answers (make push first?)").strip()
    except ShipError as err:
        raise registry.classify(reference, err.said) or err from None


def digest_of(reference: str) -> str:
    """The manifest digest a tag names in the registry (skopeo asks the registry)."""
    return skopeo_inspect(reference, "{{.Digest}}")


def compressed_size(reference: str) -> int:
    """Bytes the image's layers take in the registry (compressed), from skopeo's layer list."""
    return sum(int(size) for size in skopeo_inspect(reference, "{{range .LayersData}}{{.Size}} {{end}}").split())


def _pushed_digests(item: Shipped, docker: str) -> set[str]:
    """The digests docker recorded for the local image in item.repository (RepoDigests)."""
    recorded = json.loads(_run(f"inspect {item.local}", [docker, "image", "inspect", "--format",
                                                        "{{json .RepoDigests}}", item.local], "rebuild the image"))
    return {ref.split("@", 1)[1] for ref in recorded or [] if ref.split("@", 1)[0] == item.repository}


def _existing_digest(reference: str) -> str | None:
    """The digest a tag names in the registry, or None when the registry has no such tag (MANIFEST_UNKNOWN)."""
    try:
        return digest_of(reference)
    except registry.NoSuchImage:
        return None


def push(item: Shipped, docker: str = "docker") -> dict:
    """docker push both tags; returns what was pushed: digest, seconds, compressed bytes. An immutable tag that
    already names another image is never moved (unless the revision is -dirty: uncommitted work)."""
    _run(f"push {item.local}", [docker, "image", "inspect", "--format", "{{.Id}}", item.local],
         f"build it first: make build IMAGE={item.image.name}")
    immutable = item.tags[1]
    existing = None if item.immutable.endswith("-dirty") else _existing_digest(immutable)
    if existing and existing not in _pushed_digests(item, docker):
        raise ShipError(f"push {item.local}: the immutable tag {immutable} already names {existing}, another image "
                        "than this one (same lock and revision, different build); an immutable tag is never moved. "
                        f"fix: pull {item.repository}@{existing} instead of pushing, or commit a change and push that")
    started = time.monotonic()
    for tag in item.tags:
        _run(f"tag {tag}", [docker, "tag", item.local, tag], "check the REGISTRY value")
        _run(f"push {tag}", [docker, "push", "--quiet", tag],
             "is the registry up and writable? (scripts/ci/registry.sh starts one on localhost)", PUSH_TIMEOUT_S)
    seconds = time.monotonic() - started
    # The digest the registry holds, from docker's own record of the push (RepoDigests), checked with skopeo.
    digests = _pushed_digests(item, docker)
    in_registry = {digest_of(tag) for tag in item.tags}
    if len(in_registry) != 1 or not in_registry <= digests:
        raise ShipError(f"push {item.local}: the registry holds {sorted(in_registry)} under {list(item.tags)}, "
                        f"docker pushed {sorted(digests)}; fix: push again (was the tag moved meanwhile?)")
    digest = in_registry.pop()
    return {"image": item.image.name, "layer": item.layer, "reference": f"{item.repository}@{digest}",
            "tags": list(item.tags), "digest": digest, "push_s": round(seconds, 1),
            "compressed_bytes": compressed_size(f"{item.repository}@{digest}")}


def sign(item: Shipped, key: Path, key_password: str | None = None) -> dict:
    """Sign the pushed digest and attach the image's SBOM as a signed CycloneDX attestation (no tlog)."""
    cosign.readable_key(key)
    digest = digest_of(f"{item.repository}:{item.immutable}")
    reference = f"{item.repository}@{digest}"
    env = cosign.password_env(key_password)
    fix = "check that the registry takes pushes (and COSIGN_PASSWORD)"
    try:
        _run(f"sign {reference}", ["cosign", "sign", "--key", str(key), "--tlog-upload=false", "--yes", reference],
             fix, env=env)
        document = sbom.ensure(item.image, item.layer)
        _run(f"attest the SBOM of {reference}", ["cosign", "attest", "--key", str(key), "--tlog-upload=false",
                                                 "--yes", "--type", SBOM_PREDICATE, "--predicate", str(document),
                                                 reference], fix, env=env)
    except ShipError as err:  # a key cosign cannot use or a wrong password: bad input, one line
        raise cosign.refused(err, reference, key, private=True) from None
    return {"reference": reference, "sbom": str(document),
            "sbom_components": len(sbom.read(document).get("components", []))}


def verify(reference: str, public_key: Path) -> dict:
    """cosign verify (signature) and verify-attestation (SBOM) of a tag or digest, offline (no tlog)."""
    fix = (f"{reference} was not pushed (make push), is not signed with this key (make sign), or the tag now names "
           "another image (tampered or re-pushed): pull by the digest that make push printed")
    cosign.readable_key(public_key)
    try:
        _run(f"verify the signature of {reference}", ["cosign", "verify", "--key", str(public_key),
                                                      "--insecure-ignore-tlog=true", "--output", "json", reference],
             fix)
        out = _run(f"verify the SBOM attestation of {reference}",
                   ["cosign", "verify-attestation", "--key", str(public_key), "--insecure-ignore-tlog=true",
                    "--type", SBOM_PREDICATE, "--output", "json", reference], fix)
    except ShipError as err:  # a key cosign cannot use: bad input; no registry there, or no such image: said so
        raise cosign.refused(err, reference, public_key, private=False) from None
    return {"reference": reference, "attestations": len([line for line in out.splitlines() if line.strip()])}


def audit(image: Image, output_dir: Path) -> list[dict]:
    """pip-audit over each lock of `image`: the findings, one dict per vulnerable package (printed by the caller)."""
    findings = []
    paths = [image.lock_path] + ([VALIDATION_LOCK] if image.flavor != "lab" else [])
    for path in paths:
        report = output_dir / f"{path.stem}.pip-audit.json"
        cmd = [sys.executable, "-m", "pip_audit", "--disable-pip", "--requirement", str(path), "--format", "json",
               "--output", str(report), "--progress-spinner", "off"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
        # pip-audit exits 1 when it found something: its JSON report says what; anything else is a failure.
        if not report.exists():
            raise ShipError(f"audit {path.name}: pip-audit wrote no report (exit {proc.returncode}): "
                            f"{proc.stderr.strip()[-2000:]}\nfix: pip install pip-audit (make dev); it needs PyPI")
        dependencies = json.loads(report.read_text()).get("dependencies", [])
        # A package pip-audit could not look up is not a pass: the audit itself failed for it.
        skipped = [d for d in dependencies if d.get("skip_reason")]
        if skipped:
            raise ShipError(f"audit {path.name}: pip-audit could not audit {len(skipped)} of {len(dependencies)} "
                            f"packages, e.g. {skipped[0]['skip_reason']!r}; fix: pip-audit reads PyPI's JSON API "
                            "(/pypi/<name>/<version>/json) for vulnerabilities: let this host reach it")
        for dependency in dependencies:
            for vuln in dependency.get("vulns", []):
                findings.append({"lock": path.name, "package": dependency["name"],
                                 "version": dependency["version"], "id": vuln["id"],
                                 "fixed_in": vuln.get("fix_versions", [])})
    return findings


def _chosen(matrix: Matrix, args: argparse.Namespace) -> list[Image]:
    if args.all:
        return [image for image in matrix.images]
    return [matrix.get(args.image) if args.image else matrix.default_image]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stackproof.images.ship", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {name: sub.add_parser(name) for name in ("push", "sign", "verify", "audit")}
    for name, command in commands.items():
        which = command.add_mutually_exclusive_group()
        which.add_argument("--image", metavar="NAME", help="a matrix image (default: the matrix default)")
        which.add_argument("--all", action="store_true", help="every image of the matrix")
        if name != "audit":
            command.add_argument("--registry", required=True, metavar="HOST[:PORT]/PREFIX")
            command.add_argument("--namespace", default=NAMESPACE, help="the local images' tag namespace "
                                 "(make build NAMESPACE=...; default: %(default)s)")
            command.add_argument("--revision", required=name != "verify", default="",
                                 help="git revision the images were built from (its first 12 hex go in the tag)")
    commands["sign"].add_argument("--key", required=True, type=Path, help="cosign private key (cosign.key)")
    commands["verify"].add_argument("--key", required=True, type=Path, help="cosign public key (cosign.pub)")
    commands["verify"].add_argument("--reference", action="append", default=[],
                                    help="verify this tag or digest instead of the image's pushed tags")
    commands["audit"].add_argument("--strict", action="store_true", help="exit 1 when any lock has a finding")
    commands["audit"].add_argument("--output-dir", type=Path, default=None, help="keep pip-audit's JSON reports here")
    args = parser.parse_args(argv)
    try:
        images = _chosen(load_matrix(), args)
        if args.command == "audit":
            return _audit(images, args)
        if args.command == "verify" and args.reference:
            for reference in args.reference:
                print(f"verified {reference}: signature and SBOM attestation ({verify(reference, args.key)})")
            return 0
        for image in images:
            for item in plan(image, args.registry, args.revision or "0" * 12, args.namespace):
                if args.command == "push":
                    pushed = push(item)
                    print(f"pushed {pushed['reference']}  tags: {', '.join(pushed['tags'])}  "
                          f"({pushed['compressed_bytes'] / 1e9:.2f} GB compressed, {pushed['push_s']} s)", flush=True)
                elif args.command == "sign":
                    signed = sign(item, args.key)
                    print(f"signed {signed['reference']} and attached its SBOM ({signed['sbom_components']} "
                          f"components, {signed['sbom']})", flush=True)
                else:
                    tags = item.tags if args.revision else item.tags[:1]
                    for tag in tags:
                        verify(tag, args.key)
                        print(f"verified {tag} ({digest_of(tag)}): signature and SBOM attestation", flush=True)
        return 0
    except StackproofError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


def _audit(images: list[Image], args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        output = args.output_dir or Path(scratch)
        output.mkdir(parents=True, exist_ok=True)
        findings = [f for image in images for f in audit(image, output)]
    unique = {(f["lock"], f["package"], f["id"]): f for f in findings}.values()
    for finding in unique:
        fixed = ", ".join(finding["fixed_in"]) or "no fixed version yet"
        print(f"{finding['lock']}: {finding['package']}=={finding['version']}: {finding['id']} (fixed in {fixed})")
    names = ", ".join(image.name for image in images)
    print(f"# pip-audit: {len(unique)} finding(s) in the locks of {names}"
          + ("" if unique or not args.strict else "; --strict: none, OK"))
    if unique and args.strict:
        print("# --strict: failing; fix: raise the pins in images/matrix.toml and make lock, or accept the risk",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
