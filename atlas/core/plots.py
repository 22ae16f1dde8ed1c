"""Small PNG plots (histogram, lines, scatter, loss curves), written atomically.

Stages write them under ``RUN/report/`` while they run; the HTML report (``atlas.tools.report``) inlines them.
matplotlib is imported only when a plot is drawn, with the Agg backend (no display needed).
"""

from __future__ import annotations

import io
from pathlib import Path

from atlas.core.files import atomic_write_bytes


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=120)
    return plt, fig, ax


def _png(plt, fig) -> bytes:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _save(plt, fig, path: Path) -> None:
    atomic_write_bytes(path, _png(plt, fig))


def histogram(values, path: Path, title: str, xlabel: str, bins=20, log_y: bool = False) -> None:
    plt, fig, ax = _figure()
    ax.hist(values, bins=bins, color="#4c72b0", edgecolor="white")
    ax.set(title=title, xlabel=xlabel, ylabel="count")
    ax.title.set_fontsize(10)
    if log_y:
        ax.set_yscale("log")
    _save(plt, fig, path)


def lines(x, series: dict[str, list], path: Path, title: str, xlabel: str, mark_x=None, log_x: bool = True) -> None:
    """One panel per series (their scales differ), sharing the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 1, figsize=(5.5, 1.9 * len(series)), dpi=120, sharex=True)
    for ax, (name, values) in zip(axes if len(series) > 1 else [axes], series.items()):
        ax.plot(x, values, marker="o", color="#4c72b0")
        ax.set_ylabel(name, fontsize=8)
        if mark_x is not None:
            ax.axvline(mark_x, color="#c44e52", linestyle="--", linewidth=1)
        if log_x:
            ax.set_xscale("log")
    axes_list = axes if len(series) > 1 else [axes]
    axes_list[0].set_title(title, fontsize=10)
    axes_list[-1].set_xlabel(xlabel)
    _save(plt, fig, path)


def scatter(points, sizes, labels: dict[int, str], path: Path, title: str) -> None:
    """A 2-D map; ``labels`` names a few points by index."""
    plt, fig, ax = _figure()
    fig.set_size_inches(7, 5.5)
    ax.scatter(points[:, 0], points[:, 1], s=sizes, alpha=0.5, color="#4c72b0", linewidths=0)
    for i, text in labels.items():
        ax.annotate(text, points[i], fontsize=6, alpha=0.8)
    ax.set(title=title, xticks=[], yticks=[])
    ax.title.set_fontsize(10)
    _save(plt, fig, path)


def curves(x, series: dict[str, list], title: str, xlabel: str) -> bytes:
    """Several series on one axis (a loss curve), as PNG bytes."""
    plt, fig, ax = _figure()
    for name, values in series.items():
        ax.plot(x, values, marker="o", label=name)
    ax.set(title=title, xlabel=xlabel)
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    return _png(plt, fig)
