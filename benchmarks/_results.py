"""Machine-readable results shared by the bench scripts: ``--json PATH`` writes a list of rows (see :func:`row`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here as a list of rows "
                        "(benchmark, case, atlas, baseline, unit, ratio, better, baseline_name, note)")


def row(benchmark: str, case: str, atlas: float, baseline: float | None, unit: str, baseline_name: str,
        better: str = "higher", ratio_is: str = "atlas/baseline", note: str = "") -> dict:
    """One comparison. ``ratio_is`` says which way the ratio is taken ("atlas/baseline" or "baseline/atlas") and
    ``better`` which direction of the ratio is good for atlas; the ratio is None when there is no baseline."""
    if better not in ("higher", "lower") or ratio_is not in ("atlas/baseline", "baseline/atlas"):
        raise ValueError(f"better={better!r}, ratio_is={ratio_is!r}")
    ratio = None
    if baseline is not None and atlas is not None:
        num, den = (atlas, baseline) if ratio_is == "atlas/baseline" else (baseline, atlas)
        ratio = float(num) / float(den) if den else None
    return {"benchmark": benchmark, "case": case, "atlas": _num(atlas), "baseline": _num(baseline), "unit": unit,
            "ratio": ratio, "ratio_is": ratio_is, "better": better, "baseline_name": baseline_name, "note": note}


def write_json(path: Path | None, rows: list[dict]) -> None:
    """Write ``rows`` to ``path`` (nothing when ``path`` is None)."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=2) + "\n")


def _num(x):
    return None if x is None else float(x)
