"""``atlas export RUN OUT --push-to-hub DEST``: publish the release view once it is written.

    DEST = ORG/NAME                   a dataset repository on the Hugging Face Hub, created when missing (public
                                      unless --private); needs a token with write access (HF_TOKEN, or `hf auth login`)
    DEST = a path or a file:// URL    a local folder that gets the same files (an air-gapped mirror)

A DEST of the form ``name/name`` is a Hub repository unless that folder exists; write ``./org/name`` or
``file://...`` for a new local folder of that shape. Either way DEST ends up holding exactly the export: an earlier
export in the mirror is replaced whole, and on the Hub the parts no longer exported are deleted (``chunks/*``,
``field_guide/*``), so the card's globs read no stale part. OUT/README.md is the dataset card, so
``datasets.load_dataset(DEST)`` reads the chunks in both cases.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from atlas.core.ownership import OWNER_FILE, NotOwned, clear_owned, describe, is_owned, mark_owned
from atlas.tools.export import EXPORT_FILES

HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # ORG/NAME
TEMPORARY = [".*", "*/.*"]  # what the export leaves only while it runs (scratch, half-written files)
REPLACED_ON_THE_HUB = ["chunks/*", "field_guide/*"]  # folders of parts: a part not exported again must go


class PublishError(RuntimeError):
    """The export cannot be published to DEST (no token, a folder that is not a mirror, the Hub refused)."""


def destination(dest: str) -> Path | str:
    """A local folder (a Path), or a Hub dataset repository id (a str)."""
    if dest.startswith("file:"):
        url = urlparse(dest)
        if url.netloc not in ("", "localhost"):
            raise PublishError(f"--push-to-hub {dest}: a file:// URL must name a folder of this machine "
                               "(file:///path/to/mirror)")
        return Path(url2pathname(url.path))
    if HUB_REPO.fullmatch(dest) and not Path(dest).exists():
        return dest
    return Path(dest).expanduser()


def check_destination(dest: str, out: str | Path) -> Path | str:
    """The destination, checked before anything is exported: a Hub repository needs a token, a local folder must be
    empty, new or an earlier mirror, and outside OUT."""
    target, out = destination(dest), Path(out).resolve()
    if isinstance(target, str):
        if not _hub_token():
            raise PublishError(f"--push-to-hub {dest}: no Hugging Face token; set the environment variable HF_TOKEN "
                               "to a token with write access (https://huggingface.co/settings/tokens), or log in "
                               "once with `hf auth login`")
        return target
    resolved = target.resolve()
    if resolved == out or out in resolved.parents or resolved in out.parents:
        raise PublishError(f"--push-to-hub {dest}: the mirror must be a folder outside {out}, and not hold it")
    if not is_owned(resolved, "export"):
        raise PublishError(f"--push-to-hub {dest}: not a folder Atlas created ({describe(resolved)}); a mirror is a "
                           "new or empty folder, or an earlier mirror of an export. Choose another folder")
    return target


def publish(out: str | Path, dest: str, private: bool = False) -> str:
    """Publish the export folder ``out`` to ``dest``; returns where it went (a folder, or the repository's URL)."""
    target = check_destination(dest, out)
    if isinstance(target, Path):
        _mirror(Path(out), target)
        return str(target)
    return _upload(Path(out), target, private)


def staging_folder(target: Path) -> Path:
    """Where a mirror is copied before it replaces ``target``: beside it, so the rename is one step."""
    return target.with_name(f".{target.name}.publish.tmp")


def _mirror(out: Path, target: Path) -> None:
    """Copy the export into ``target`` through a staging folder beside it, so a copy cut short leaves the earlier
    mirror (or nothing) rather than half of each. An earlier mirror loses what an export writes and nothing else: a
    file of the user's there stops the copy, and the mirror stays whole."""
    staging = staging_folder(target)
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(out, staging, ignore=shutil.ignore_patterns(*TEMPORARY))
    mark_owned(staging, "export")  # the mirror is an export of Atlas's: the next publish may replace it
    if target.exists():
        try:
            clear_owned(target, EXPORT_FILES, "--push-to-hub")
        except NotOwned as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise PublishError(str(e)) from None
        (target / OWNER_FILE).unlink(missing_ok=True)
        target.rmdir()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(target)


def _hub_token() -> str | None:
    try:
        from huggingface_hub import get_token
    except ImportError:
        raise PublishError("--push-to-hub ORG/NAME needs huggingface_hub: pip install huggingface_hub (a local "
                           "folder as DEST needs nothing)") from None
    return get_token()  # HF_TOKEN, or the token `hf auth login` stored


def _upload(out: Path, repo_id: str, private: bool) -> str:
    import importlib

    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    # No network, or the Hub out of reach: huggingface_hub lets its HTTP client's errors through (httpx's, or
    # httpx2's in newer releases, neither an OSError), and requests' ConnectionError is an OSError.
    unreachable: list[type[BaseException]] = [OSError]
    for client in ("httpx", "httpx2"):
        try:
            unreachable.append(importlib.import_module(client).TransportError)
        except (ImportError, AttributeError):
            pass
    api = HfApi(token=_hub_token())
    try:
        url = api.create_repo(repo_id, repo_type="dataset", exist_ok=True, private=private)
        api.upload_folder(repo_id=repo_id, repo_type="dataset", folder_path=out, ignore_patterns=TEMPORARY,
                          delete_patterns=REPLACED_ON_THE_HUB, commit_message=f"atlas export ({out.name})")
    except (HfHubHTTPError, OfflineModeIsEnabled) as e:
        raise PublishError(f"--push-to-hub {repo_id}: {' '.join(str(e).split())}; the export in {out} is complete, "
                           "rerun the same command to publish it") from None
    except tuple(unreachable) as e:
        raise PublishError(f"--push-to-hub {repo_id}: the Hugging Face Hub cannot be reached ({type(e).__name__}: "
                           f"{' '.join(str(e).split())}); the export in {out} is complete: rerun the same command "
                           "when online to publish it") from None
    return str(url)
