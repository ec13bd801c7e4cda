"""cosign, pinned: attach a signed in-toto statement to an image digest and verify it, offline (a key pair, no
transparency log). The version is written here once and checked before any call: cosign 3.x deprecates
--tlog-upload and changes the bundle format, so the flags below are 2.x's."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from typing import Any

from stackproof import environment
from stackproof.errors import ConfigError, StackproofError
from stackproof.images import registry
from stackproof.tools import run_tool

COSIGN_VERSION = "2.5.0"  # Debian trixie's cosign (2.5.0-2); `cosign version` of a Debian build says "devel"
TIMEOUT_S = 120
INSTALL_FIX = (f"install cosign {COSIGN_VERSION} (Debian trixie: apt-get install -t trixie cosign; "
               "scripts/ci/registry.sh does it)")


class CosignError(StackproofError):
    """A cosign call failed (exit 1): the message names the call, what cosign said and the fix."""


def _run(step: str, argv: list[str], fix: str, **kwargs: Any) -> str:
    return run_tool(step, argv, timeout_s=TIMEOUT_S, fix=fix, error=CosignError, missing_fix=INSTALL_FIX, **kwargs)


def installed_version() -> str:
    """The cosign on PATH's version: its own word, or the Debian package's when the build says 'devel'."""
    said = json.loads(_run("cosign version", ["cosign", "version", "--json"], INSTALL_FIX))["gitVersion"]
    if re.fullmatch(r"v?\d+\.\d+\.\d+", said):
        return said.removeprefix("v")
    package = _run("dpkg-query cosign", ["dpkg-query", "-W", "-f", "${Version}", "cosign"],
                   f"cosign says its version is {said!r}; {INSTALL_FIX}")
    return re.sub(r"^\d+:", "", package).split("-")[0]  # epoch:upstream-debian -> upstream


def require_pinned_version() -> str:
    found = installed_version()
    if found != COSIGN_VERSION:
        raise ConfigError(f"cosign: expected version {COSIGN_VERSION} (stackproof/images/cosign.py: its flags), "
                          f"found {found}; fix: {INSTALL_FIX}, or change COSIGN_VERSION after checking the flags")
    return found


def password_env(password: str | None) -> dict[str, str]:
    # cosign reads the key's password from COSIGN_PASSWORD; an empty one is a valid choice for CI keys.
    given = password if password is not None else environment.COSIGN_PASSWORD.get()
    return {**os.environ, "COSIGN_PASSWORD": given}


def readable_key(key: Path) -> None:
    """The key cosign is given: a file this user can read, or one line, exit 2 (not cosign's many lines)."""
    from stackproof.images.attest_config import key_file

    problem = key_file(str(key))
    if problem:
        raise ConfigError(f"--key {key}: {problem}; fix: pass --key the cosign key (or set its variable)")


def _key_refused(said: str, key: Path, private: bool) -> ConfigError | None:
    """cosign's failure to open --key, in one line (exit 2): a password that does not open a private key, or a
    file that is not the key asked for (a public key to sign with, a private one to verify with, not a key)."""
    reason = re.search(r"(?:reading key|loading public key): ([^\n|;]+?)(?:\. Are you|\n|$)", said)
    if not reason:
        return None
    if private and "decrypt" in reason.group(1):
        return ConfigError(f"--key {key}: expected the password that opens it (COSIGN_PASSWORD), found one that "
                           "does not (cosign: decryption failed); fix: set COSIGN_PASSWORD to the key's password, "
                           "or pass the key made with it")
    wanted, pair_file = ("private", "cosign.key") if private else ("public", "cosign.pub")
    return ConfigError(f"--key {key}: expected a cosign {wanted} key ({pair_file} of cosign generate-key-pair), "
                       f"found a file cosign cannot use as one ({reason.group(1).strip()}); fix: pass --key the "
                       f"{wanted} key of the pair ({pair_file})")


def refused(err: StackproofError, reference: str, key: Path, private: bool) -> StackproofError:
    """What a failed cosign call means, in one line: the key refused (exit 2), the image not in the registry or
    the registry not answering (registry.py), else cosign's own error."""
    return _key_refused(err.said, key, private) or registry.classify(reference, err.said) or err


def attest(reference: str, predicate: Path, predicate_type: str, key: Path, password: str | None = None) -> None:
    """Sign `predicate` as an in-toto statement about `reference` (REPO@sha256:...) and attach it there."""
    readable_key(key)
    try:
        _run(f"attest {reference}", ["cosign", "attest", "--key", str(key), "--tlog-upload=false", "--yes", "--type",
                                     predicate_type, "--predicate", str(predicate), reference],
             "check that the registry takes pushes", env=password_env(password))
    except CosignError as err:
        raise refused(err, reference, key, private=True) from None


class NotVerified(Exception):
    """cosign verified no attestation of the type. `why`: "none" (the digest holds none), "other key" (it holds
    some, none signed by this key: cosign's 'Found: 0'), or "policy" (one fails the CUE policy)."""

    def __init__(self, why: str, said: str):
        super().__init__(said)
        self.why, self.said = why, said


def verify(reference: str, predicate_type: str, public_key: Path, policy: Path) -> list[dict[str, Any]]:
    """The in-toto statements of `predicate_type` on `reference` signed by `public_key`, every one passing the
    CUE `policy`. NotVerified when cosign verifies none; CosignError when cosign itself could not run."""
    readable_key(public_key)
    try:
        out = _run(f"verify the attestations of {reference}",
                   ["cosign", "verify-attestation", "--key", str(public_key), "--insecure-ignore-tlog=true", "--type",
                    predicate_type, "--policy", str(policy), "--output", "json", reference],
                   "check --key, the registry, and the reference")
    except CosignError as err:
        said = str(err)
        if "validation errors occurred" in said:
            raise NotVerified("policy", _cosign_lines(said)) from None
        if "no matching attestations" in said:
            raise NotVerified("other key" if "Found: 0" in said else "none", _cosign_lines(said)) from None
        raise refused(err, reference, public_key, private=False) from None
    return [_statement(line) for line in out.splitlines() if line.strip().startswith("{")]


def _cosign_lines(said: str) -> str:
    """cosign's own findings from a failed call's message: without the command, its tlog warning, its
    'Error:' summaries and the fix."""
    said = said.split("exited 1: ", 1)[-1].rsplit("; fix: ", 1)[0]
    skip = ("WARNING", "error during", "will be", "There are", "Error:")
    lines = [line.strip().removeprefix("- ") for line in said.splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith(skip))


def _statement(envelope_line: str) -> dict[str, Any]:
    envelope = json.loads(envelope_line)
    return json.loads(base64.b64decode(envelope["payload"]))
