"""What a registry said, as skopeo and cosign pass it on: an image it does not hold is told apart from a registry
that could not be asked, by the words of the registry (OCI distribution error codes) and of the network (Go's
dialer), never by a guess. Each is one line for people: expected, found, and the fix."""

from __future__ import annotations

import re

from stackproof.errors import StackproofError

# The OCI distribution spec's codes for a manifest or repository the registry does not hold (404).
_NOT_HELD = ("manifest unknown", "name unknown", "blob unknown", "404 not found")
# Go's words when no registry answered: nothing listens, no such host, no route, no answer in time.
_NO_ANSWER = ("connection refused", "no such host", "server misbehaving", "network is unreachable",
              "no route to host", "i/o timeout", "context deadline exceeded", "tls handshake timeout",
              "connection reset by peer")


def host(reference: str) -> str:
    """The registry's host[:port] of REPO[:TAG][@sha256:...]."""
    return reference.split("/", 1)[0] if "/" in reference else reference


def _phrase(said: str, phrases: tuple[str, ...]) -> str | None:
    lowered = said.lower()
    return next((phrase for phrase in phrases if phrase in lowered), None)


class NoSuchImage(StackproofError):
    """The registry answered, and holds no such manifest (or repository). Its caller decides the exit code: bad
    input for attest (exit 2), a refusal for verify-image (exit 1)."""

    def __init__(self, reference: str, found: str):
        self.reference, self.found = reference, found
        self.fix = "push it first (make push), or name it as make push printed it (REPO@sha256:...)"
        super().__init__(f"{reference}: expected an image the registry {host(reference)} holds, found none "
                         f"(the registry: {found}); fix: {self.fix}")


class RegistryUnreachable(StackproofError):
    """No registry answered at the reference's host: nothing was judged about the image (exit 1: the registry
    failed, not the input's shape)."""

    def __init__(self, reference: str, found: str):
        self.reference, self.found = reference, found
        self.fix = (f"start the registry at {host(reference)} or correct the host:port in the reference "
                    "(scripts/ci/registry.sh starts one on localhost)")
        super().__init__(f"{reference}: expected the registry {host(reference)} to answer, found no answer "
                         f"({found}); fix: {self.fix}")


def _detail(said: str, phrase: str) -> str:
    """The tool's own clause that holds `phrase` (e.g. 'dial tcp 127.0.0.1:5999: connect: connection refused'),
    without Go's nesting of everything before it."""
    lowered = said.lower()
    end = lowered.index(phrase) + len(phrase)
    start = max(0, *(lowered.rfind(mark, 0, end - len(phrase)) for mark in ('": ', "; ", "| ", "\n", "msg=",
                                                                              "error: ")))
    clause = said[start:end].lstrip('"|;: \n').removeprefix("msg=").removeprefix("Error: ").strip('" ')
    return re.sub(r"\s+", " ", clause) or phrase


def classify(reference: str, said: str) -> StackproofError | None:
    """NoSuchImage or RegistryUnreachable when a tool's failure (`said`: what it printed) says so, else None."""
    phrase = _phrase(said, _NO_ANSWER)
    if phrase:
        return RegistryUnreachable(reference, _detail(said, phrase))
    phrase = _phrase(said, _NOT_HELD)
    if phrase:
        return NoSuchImage(reference, _detail(said, phrase))
    return None
