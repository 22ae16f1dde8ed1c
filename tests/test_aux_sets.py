"""benchmarks/aux_sets.py without the dev corpus: the label hints name real labels, changelog sections are found
in Markdown and reST descriptions, and the licence negatives hold no empty file and none of CPython's licence."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("aux_sets", ROOT / "benchmarks" / "aux_sets.py")
aux_sets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aux_sets)


def test_label_hints_are_schema_labels():
    names = {label["name"] for path in (ROOT / "schemas" / "aux").glob("*.json")
             for label in json.loads(path.read_text())["labels"]}
    for hints in aux_sets.LABEL_HINTS.values():
        assert set(hints) <= names, set(hints) - names


def test_split_changelog_markdown_with_version_headings():
    body = ("# pkg\n\nIntro.\n\n## Changelog\n\n## v2.0 (2024)\n\n- Fixed X.\n\n## 1.0\n\n- First.\n\n"
            "## License\n\nMIT\n")
    readme, changelog = aux_sets._split_changelog(body)
    assert changelog.startswith("## Changelog") and "- First." in changelog and "MIT" not in changelog
    assert "Intro." in readme and "MIT" in readme and "Fixed" not in readme


def test_split_changelog_rest_levels():
    body = ("pkg\n===\n\nUsage\n-----\n\nCall it.\n\nHistory\n-------\n\n1.0\n~~~\n\n* First.\n\n"
            "Authors\n-------\n\nMe.\n")
    readme, changelog = aux_sets._split_changelog(body)
    assert changelog.startswith("History") and "* First." in changelog and "Me." not in changelog
    assert "Call it." in readme and "Me." in readme
    assert aux_sets._split_changelog("No headings here.") == ("No headings here.", "")


def test_licences_are_licence_texts_without_cpythons():
    texts = aux_sets._licences()
    assert texts and all(t.strip() for t in texts)
    assert not any(aux_sets.CPYTHON_LICENCE.search(t) for t in texts)
    assert sum("permission" in t.lower() or "license" in t.lower() for t in texts) >= 0.9 * len(texts)
