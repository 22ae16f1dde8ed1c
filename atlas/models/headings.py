"""Library of Congress Subject Headings: human names that offline concept naming prefers (``library.name_headings``).

A cluster's most representative and distinctive tag is often one specific member ("austrian infantry" for a
cluster of army, infantry, coalition army, military history). When one of its top tags is also a subject heading
a cataloguer wrote ("army" <- "Armies", "prime minister" <- "Prime ministers", "museum" <- "Museums"), the labeler
prefers it (``HEADING_BONUS`` in ``atlas.models.labeler``). The paper maps its library onto the Library of Congress
Classification; this borrows the subject headings' wording only.

The headings come from the ``invenio-subjects-lcsh`` wheel on PyPI (MIT; the headings are public domain), whose
CSV holds 463k headings. Its declared dependencies (Invenio's web stack) have nothing to do with the file and
conflict with ours, so ``scripts/get_lcsh.sh`` downloads the wheel alone and ``install_lcsh`` keeps what naming
can use: headings that are one plain term, lowercased. A subdivided heading ("Art--History"), an inverted one
("Art, Modern") or a qualified one ("Mercury (Planet)", whose sense a bare tag cannot show) is left out.
"""

from __future__ import annotations

import csv
import io
import os
import zipfile
from pathlib import Path

from atlas.core.files import atomic_write_bytes
from atlas.models.embedder import cache_root

LCSH_PACKAGE = "invenio-subjects-lcsh==2026.6.4.3"
LCSH_CSV = "invenio_subjects_lcsh/vocabularies/subjects_lcsh.csv"
HEADING_SETS = ("none", "lcsh")  # the values of library.name_headings


def lcsh_file() -> Path:
    return cache_root() / "vocabularies" / f"lcsh-{LCSH_PACKAGE.split('==')[1]}.txt"


def plain_headings(rows) -> list[str]:
    """The plain headings of the CSV's ``subject`` column, lowercased with single spaces, sorted and unique."""
    kept = set()
    for row in rows:
        heading = row["subject"]
        if "--" in heading or "," in heading or "(" in heading:
            continue
        heading = " ".join(heading.lower().split())
        if heading:
            kept.add(heading)
    return sorted(kept)


def install_lcsh(wheel: Path) -> Path:
    """Write the plain headings of the ``invenio-subjects-lcsh`` wheel to ``lcsh_file()``, one per line."""
    with zipfile.ZipFile(wheel) as zf:
        if LCSH_CSV not in zf.namelist():
            raise RuntimeError(f"{wheel}: no {LCSH_CSV} in it (is it {LCSH_PACKAGE}?)")
        text = zf.read(LCSH_CSV).decode("utf-8")
    headings = plain_headings(csv.DictReader(io.StringIO(text)))
    target = lcsh_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, ("\n".join(headings) + "\n").encode("utf-8"))
    return target


def load_headings(name: str) -> list[str]:
    """The heading set ``name`` (``HEADING_SETS``): none, or the installed LCSH headings."""
    if name == "none":
        return []
    if name != "lcsh":
        raise ValueError(f"library.name_headings must be one of {HEADING_SETS}, not {name!r}")
    path = lcsh_file()
    if not path.is_file():
        raise FileNotFoundError(f"library.name_headings: lcsh needs the Library of Congress Subject Headings, not "
                                f"found at {path} (ATLAS_CACHE={os.environ.get('ATLAS_CACHE', 'unset')}): install "
                                f"them once with `bash scripts/get_lcsh.sh` (a 6 MB download), or set "
                                f"library.name_headings: none")
    return path.read_text(encoding="utf-8").splitlines()
