"""Attention known answers, judged: scaled_dot_product_attention through each backend this torch and GPU offer
(flash, memory-efficient, cuDNN, math), forward and backward, against a float64 reference computed on the CPU
by another path (explicit softmax(Q K^T / sqrt(d)) V). Pure: the suite hands in what it measured per case.

The tolerance is derived per element, not picked: the output's own rounding (one unit of the dtype times |the
reference|) plus ATTENTION_ULPS units of the dtype times the element's magnitude, the same computation taken over
absolute values (measure/attention.py: P |V| for the output; for the gradients the chain dS = P o (dP - D) over
|dO| |V|^T, |K|, |Q|), each scaled by 1 + 2 max|S| for the rounding of the scores. Every rounding a kernel makes
(P rounded to the dtype before P V, dS before dS K, the output) moves an element by at most one unit times such a
magnitude; a head computed with the wrong scale, a wrong mask or a stale tile moves it by the magnitude itself.
"""

from __future__ import annotations

import dataclasses

BACKENDS = ("flash", "efficient", "cudnn", "math")
TENSORS = ("out", "dq", "dk", "dv")
ATTENTION_ULPS = 4  # roundings a kernel may make per element (P, dP, dS, the output), each at most one unit
# The words sdpa raises when a backend does not serve this shape, dtype or device: a reading, not a failure.
WRONG_ANSWER = ("an attention kernel gave a wrong answer: the image's flash-attention / cuDNN / CUTLASS build for "
                "this GPU, or the GPU itself (run the burn tier)")
UNSUPPORTED = ("No available kernel", "No viable backend")


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    seq: int
    causal: bool

    def __str__(self) -> str:
        return f"{self.dtype} d={self.head_dim} seq={self.seq} {'causal' if self.causal else 'full'}"


def cases(dtypes: tuple[str, ...], head_dims: tuple[int, ...], seqs: tuple[int, ...]) -> list[Case]:
    """Every pair of values of (dtype, head size, length, mask) in some case, not every combination: a backend
    picks its kernel per shape and dtype, and a pairwise cover meets each such pairing at a fraction of the cost
    (on one H200 the cuDNN backend built a plan per case, ~1.2 s each: 24 cases took 27.7 s). Built in parameter
    order (IPOG): every combination of the two settings with the most values, then each further setting's value
    picked per case to cover the most pairs still open (the first value on a tie), and a case added for any pair
    left. For 2 dtypes x 3 head sizes x 2 lengths x 2 masks that is 6 cases, the fewest possible (the dtype x
    head size pairs alone need 6); a greedy pick over the full product took 7."""
    values = (dtypes, head_dims, seqs, (False, True))  # Case's field order
    order = sorted(range(len(values)), key=lambda i: -len(values[i]))  # stable: ties keep the field order
    first, second = order[:2]
    rows = [{first: a, second: b} for a in range(len(values[first])) for b in range(len(values[second]))]
    for n, setting in enumerate(order[2:], start=2):
        done = order[:n]
        left = {(other, a, b) for other in done for a in range(len(values[other]))
                for b in range(len(values[setting]))}
        for row in rows:
            row[setting] = max(range(len(values[setting])),
                               key=lambda b, row=row: (sum((other, row[other], b) in left for other in done), -b))
            left -= {(other, row[other], row[setting]) for other in done}
        for other, a, b in sorted(left):  # vertical growth: a case for each pair still open
            rows.append({**{q: 0 for q in done}, other: a, setting: b})
    return [Case(*(values[i][row[i]] for i in range(len(values)))) for row in rows]


def seq_lengths(tile: int) -> tuple[int, int]:
    """One length a multiple of the kernels' tiles and one that leaves a ragged last tile (and is odd)."""
    return (2 * tile, 2 * tile - tile // 2 + 1)


def tolerance(reference_abs, magnitude, underflow_magnitude, eps: float, tiny: float):
    """Per element (array-likes): the output's rounding plus ATTENTION_ULPS roundings of the magnitude, and as many
    of the dtype's subnormal spacing (`tiny`) times the magnitude with every attention weight 1 (a weight below
    the smallest normal number is rounded absolutely, not relatively: fp16's below 6.1e-5; so is an output
    there, by up to `tiny`)."""
    return eps * reference_abs + tiny + ATTENTION_ULPS * (eps * magnitude + tiny * underflow_magnitude)


def unsupported(error: str) -> bool:
    return any(words in error for words in UNSUPPORTED)


@dataclasses.dataclass
class Reading:
    """One backend on one case: the error it raised (''), else each tensor's worst |found - reference| / bound,
    and the head it is in (a kernel wrong for one head shows as one head)."""
    case: Case
    error: str = ""
    worst: dict[str, float] = dataclasses.field(default_factory=dict)
    head: dict[str, int] = dataclasses.field(default_factory=dict)  # the head each tensor's worst element is in


@dataclasses.dataclass(frozen=True)
class Verdict:
    ran: list[str]  # the cases the backend served
    not_served: list[str]  # cases it refused (sdpa had no kernel): readings
    wrong: list[str]  # a wrong answer or an error where an answer was due, in words
    worst_ratio: float  # the largest error / tolerance over the cases it ran (1 is the tolerance)


def judge(readings: list[Reading]) -> Verdict:
    ran, not_served, wrong, worst = [], [], [], 0.0
    for reading in readings:
        if reading.error and unsupported(reading.error):
            not_served.append(str(reading.case))
            continue
        if reading.error:
            wrong.append(f"{reading.case}: {reading.error}")
            continue
        ran.append(str(reading.case))
        worst = max([worst, *reading.worst.values()])
        off = [f"{name} {ratio:.3g}x (head {reading.head.get(name, '?')})"
               for name, ratio in reading.worst.items() if not ratio <= 1]
        if off:
            wrong.append(f"{reading.case}: error / tolerance {', '.join(off)}")
    return Verdict(ran, not_served, wrong, worst)


def not_served_reason(backend: str, readings: list[Reading]) -> str:
    """Why a backend is a reading rather than a pass: it served none of the cases."""
    first = next((r.error for r in readings if r.error), "")
    return f"the {backend} attention backend served none of the {len(readings)} cases here: {first[:300]}"
