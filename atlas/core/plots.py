"""Small PNG plots (histogram, lines, scatter, loss curves, reliability), written atomically.

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


def _png(plt, fig, layout: bool = True) -> bytes:
    if layout:
        fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _save(plt, fig, path: Path, layout: bool = True) -> None:
    atomic_write_bytes(path, _png(plt, fig, layout))


def histogram(values, path: Path, title: str, xlabel: str, bins=20, log_y: bool = False, log_x: bool = False) -> None:
    """``log_x``: a logarithmic x axis (give bins spaced evenly in log, e.g. ``np.geomspace``, so they look even)."""
    plt, fig, ax = _figure()
    ax.hist(values, bins=bins, color="#4c72b0", edgecolor="white")
    ax.set(title=title, xlabel=xlabel, ylabel="count")
    ax.title.set_fontsize(10)
    if log_y:
        ax.set_yscale("log")
    if log_x:
        ax.set_xscale("log")
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


def scatter(points, sizes, labels: dict[int, str], path: Path, title: str) -> dict[int, tuple[float, ...]]:
    """A 2-D map; ``labels`` names a few points by index, most important first. A label goes beside its point
    (right or left, above or below), inside the frame, where it overlaps no label placed before it; a label that
    fits nowhere is left out. Returns the shown labels' boxes in pixels: {index: (x0, y0, x1, y1)}."""
    plt, fig, ax = _figure()
    fig.set_size_inches(7, 5.5)
    ax.scatter(points[:, 0], points[:, 1], s=sizes, alpha=0.5, color="#4c72b0", linewidths=0)
    ax.set(title=title, xticks=[], yticks=[])
    ax.title.set_fontsize(10)
    fig.tight_layout()  # first: the layout fixes where each point lands in pixels
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    shown: dict[int, tuple[float, ...]] = {}
    for i, text in labels.items():
        for dx, dy in ((3, 2), (3, -2), (-3, 2), (-3, -2)):
            note = ax.annotate(text, points[i], xytext=(dx, dy), textcoords="offset points", fontsize=6, alpha=0.85,
                               ha="left" if dx > 0 else "right", va="bottom" if dy > 0 else "top")
            box = note.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            gap = 4  # pixels between two labels, so that neighbours do not read as one name
            if inside and not any(box.x0 < b[2] + gap and b[0] < box.x1 + gap and box.y0 < b[3] + gap
                                  and b[1] < box.y1 + gap for b in shown.values()):
                shown[i] = (box.x0, box.y0, box.x1, box.y1)
                break
            note.remove()
    _save(plt, fig, path, layout=False)  # no second layout pass: it could move the points under the labels
    return shown


def curves(x, series: dict[str, list], title: str, xlabel: str, marks: dict[str, tuple] | None = None) -> bytes:
    """Several series on one axis (a loss curve), as PNG bytes; ``marks``: single points {label: (x, y)}."""
    plt, fig, ax = _figure()
    for name, values in series.items():
        ax.plot(x, values, marker="o", label=name)
    for name, (mark_x, mark_y) in (marks or {}).items():
        ax.plot([mark_x], [mark_y], marker="*", markersize=11, linestyle="none", label=name)
    ax.set(title=title, xlabel=xlabel)
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    return _png(plt, fig)


def reliability(curves: dict[str, tuple[list, list]], path: Path, title: str, xlabel: str, ylabel: str,
                grey: set[str] = frozenset()) -> None:
    """Reliability diagram: one (mean probability, observed rate) curve per label, and the diagonal of perfect
    calibration; curves named in ``grey`` are drawn grey (e.g. before calibration)."""
    plt, fig, ax = _figure()
    fig.set_size_inches(5.5, 4.2)
    ax.plot([0, 1], [0, 1], color="#888888", linestyle="--", linewidth=1, label="perfect calibration")
    for name, (x, y) in curves.items():
        style = {"marker": ".", "color": "#bbbbbb"} if name in grey else {"marker": "o"}
        ax.plot(x, y, label=name, **style)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    _save(plt, fig, path)
