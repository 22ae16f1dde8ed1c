"""Which folders are Atlas's: a record written when Atlas creates a run, an export or a local copy.

Atlas deletes or overwrites files only in folders it owns. A folder is Atlas's when it holds ``.atlas-owner.json``
of the same kind (``{"kind": "run"}``), written when Atlas first writes into it. A folder that does not exist, or
an empty one, becomes Atlas's on its first write; any other folder is refused with ``NotOwned``, which names it,
before a single file in it is touched. A familiar file name is never proof: a folder holding ``export.json`` or
``chunks/`` of its own is the user's until it holds the record.

Runs made before the record existed are adopted once: a folder whose ``manifest.json`` is an Atlas manifest (its
recorded packages name ``atlas-concepts``, and it has ``config`` and ``stages``) gets the record on its next run.

The record is a dot-file: pandas, pyarrow datasets and ``datasets.load_dataset`` skip it.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

from atlas.core.files import InputError, atomic_write_json

OWNER_FILE = ".atlas-owner.json"
KINDS = ("run", "export", "export-tokens")  # a run's local copy is a run; a --push-to-hub folder an export


class NotOwned(InputError):
    """A folder Atlas did not create was named as a place Atlas writes to (a run directory, an export's OUT)."""


def owner(folder: str | Path) -> str | None:
    """The kind recorded in ``folder``'s record; None when it has no readable record."""
    try:
        record = json.loads((Path(folder) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record.get("kind") if isinstance(record, dict) else None


def _is_atlas_manifest(folder: Path) -> bool:
    try:
        return is_atlas_manifest((folder / "manifest.json").read_bytes())
    except OSError:
        return False


def is_atlas_manifest(data: bytes) -> bool:
    """Whether ``data`` is a manifest an Atlas run wrote (how runs made before the record are recognised)."""
    try:
        manifest = json.loads(data)
    except ValueError:
        return False
    return (isinstance(manifest, dict) and isinstance(manifest.get("stages"), dict)
            and isinstance(manifest.get("config"), dict)
            and "atlas-concepts" in (manifest.get("packages") or {}))


def is_owned(folder: str | Path, kind: str) -> bool:
    """Whether Atlas may write and delete in ``folder`` as a ``kind`` (it does not exist, is empty, or holds the
    record of that kind; a run: or an older Atlas run's manifest)."""
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        return True
    if not folder.is_dir() or folder.is_symlink():
        return False
    if owner(folder) == kind:
        return True
    if (folder / OWNER_FILE).exists():
        return False  # Atlas's, but of another kind (an export named as a run directory)
    if kind == "run" and _is_atlas_manifest(folder):
        return True
    return not any(folder.iterdir())


def describe(folder: Path) -> str:
    """What ``folder`` holds, for a refusal: a few of its names."""
    if folder.is_symlink():
        return "it is a symbolic link"
    if not folder.exists():
        return "it does not exist"
    if not folder.is_dir():
        return "it is a file"
    if kind := owner(folder):
        return f"it is an Atlas {kind}"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"it holds {shown}"


def claim(folder: str | Path, kind: str, what: str) -> Path:
    """Make ``folder`` Atlas's as a ``kind`` (``what``: the setting or argument that named it, for the message):
    created when missing, the record written when absent. ``NotOwned`` when the folder is someone else's; nothing is
    written then."""
    assert kind in KINDS, kind
    folder = Path(folder)
    if not is_owned(folder, kind):
        raise NotOwned(f"{what} {folder}: not a folder Atlas created ({describe(folder)}); Atlas writes only into a "
                       f"new or empty folder, or one it made as {_article(kind)} {kind}. Choose another folder, or "
                       f"empty this one yourself")
    if owner(folder) != kind:
        mark_owned(folder, kind)
    return folder


def mark_owned(folder: Path, kind: str) -> None:
    """Write the record into a folder this process has just made (``claim`` checks first)."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / OWNER_FILE, {"kind": kind})  # no time or pid: a rebuilt run has the same bytes


def require_owned(folder: str | Path, kind: str, what: str) -> Path:
    """``folder`` is Atlas's as a ``kind`` already (a command that writes into an existing run: report, eval, cblm);
    ``NotOwned`` otherwise. Adopts an older Atlas run."""
    folder = Path(folder)
    if not folder.is_dir() or not is_owned(folder, kind) or not any(folder.iterdir()):
        raise NotOwned(f"{what} {folder}: not {_article(kind)} {kind} that Atlas made ({describe(folder)}); "
                       f"nothing was written")
    return claim(folder, kind, what)


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"


def foreign_files(folder: str | Path, patterns: list[str]) -> list[str]:
    """The files under ``folder`` (relative, /-separated) that match none of ``patterns`` (fnmatch, on the relative
    path): those Atlas did not write there. The record and temporary dot-files always match."""
    folder = Path(folder)
    patterns = [OWNER_FILE, ".*", "*/.*", *patterns]
    found = []
    for path in sorted(folder.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue
        rel = path.relative_to(folder).as_posix()
        if not any(fnmatch.fnmatchcase(rel, pattern) for pattern in patterns):
            found.append(rel)
    return found


def clear_owned(folder: str | Path, patterns: list[str], what: str) -> None:
    """Empty a folder Atlas owns of what Atlas wrote there (``patterns``), keeping its record. A file that matches
    none of them is the user's: ``NotOwned`` names it, and nothing is deleted."""
    folder = Path(folder)
    if foreign := foreign_files(folder, patterns):
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise NotOwned(f"{what} {folder}: holds file(s) Atlas did not write ({shown}); nothing was deleted. Move "
                       f"them out of the folder, or choose another")
    for path in folder.iterdir():
        if path.name == OWNER_FILE:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
