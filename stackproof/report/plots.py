"""The page's plots, drawn by matplotlib as inline SVG (no JavaScript, no network: the page opens anywhere)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from stackproof.errors import ConfigError

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter
except ImportError as err:  # a host-side extra, not in the images
    raise ConfigError(f"stackproof report draws with matplotlib, which is not installed ({err}); fix: "
                      "pip install 'stackproof[report]'") from None

matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "stackproof", "font.size": 9,
                            "axes.grid": True, "grid.alpha": 0.3})


def _svg(fig: Any) -> str:
    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = out.getvalue()
    return text[text.index("<svg"):]  # inline: no XML prolog or DOCTYPE


def _bytes(value: float, _pos: Any = None) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def sweep(lines: Sequence[tuple[str, list[int], list[float], str]], levels: Sequence[tuple[str, float]],
          title: str, ylabel: str, log_y: bool = False) -> str:
    """A figure against message size (log x); `lines` are (label, sizes, values, style), `levels` horizontal lines
    (label, value): the pass bar."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, sizes, values, style in lines:
        ax.plot(sizes, values, style, label=label, marker="o" if style == "-" else None, markersize=3)
    for label, value in levels:
        ax.axhline(value, color="tab:red", linestyle="--", linewidth=1, label=label)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_bytes))
    ax.set_xlabel("message size (bytes, log scale)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    return _svg(fig)


def bars(labels: Sequence[str], values: Sequence[float], unit: str, title: str, bar: float | None,
         better: str) -> str:
    """One figure per GPU (or rank), with the check's pass bar as a line when it has one."""
    # Wide enough that side-by-side labels (about 0.055 in per character at font size 7) do not overlap.
    longest = max((len(line) for label in labels for line in label.splitlines()), default=1)
    per_label = 0.55 if len(labels) > 4 else max(0.55, 0.055 * longest)
    fig, ax = plt.subplots(figsize=(max(3.5, per_label * len(labels) + 1.5), 3))
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(values)), labels, rotation=45 if len(labels) > 4 else 0, ha="right"
                  if len(labels) > 4 else "center", fontsize=7)
    if bar is not None:
        ax.axhline(bar, color="tab:red", linestyle="--", linewidth=1, label=f"bar {bar:g} {unit}")
        ax.legend(loc="lower right", fontsize=7)
    ax.set_ylabel(f"{unit} ({better} is better)")
    ax.set_title(title, fontsize=9)
    return _svg(fig)


def over_time(lines: Sequence[tuple[str, list[float], list[float]]], levels: Sequence[tuple[str, float, str]],
              title: str, ylabel: str) -> str:
    """A quantity over the seconds of a soak: one line per GPU (label, seconds, values), and its bars as
    horizontal lines (label, value, colour name) -- one per GPU when the bars differ."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for label, seconds, values in lines:
        ax.plot(seconds, values, "-", label=label, linewidth=1.2)
    for label, value, colour in levels:
        ax.axhline(value, color=colour, linestyle="--", linewidth=1, label=label)
    ax.set_xlabel("second of the soak")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if lines or levels:
        ax.legend(loc="lower left", fontsize=7, ncol=2)
    return _svg(fig)
