"""Prompt templates: versioned YAML files with ``{named}`` placeholders, checked when loaded.

A template file has ``version``, ``system`` and ``user`` keys (and may have more templates, e.g.
``repair``). Loading checks that every required key and placeholder is there, so a broken prompt
stops the run at start-up with the file and the missing piece named, not halfway through.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import yaml

from atlas.core.files import sha256_bytes


class PromptError(ValueError):
    """A prompt file that cannot be used."""


@dataclass(frozen=True)
class Prompt:
    path: Path
    version: int
    templates: dict[str, str]
    sha256: str  # of the file's bytes: part of the stage hash and of request-cache keys

    def render(self, name: str, **values) -> str:
        return self.templates[name].format_map(values)


def _placeholders(template: str) -> set[str]:
    return {field for _, field, _, _ in string.Formatter().parse(template) if field}


def load_prompt(path: str | Path, required: dict[str, set[str]]) -> Prompt:
    """Load a prompt file; ``required`` maps each template name to the placeholders it must use."""
    path = Path(path)
    if not path.exists():
        raise PromptError(f"prompt file not found: {path}")
    data = yaml.safe_load(path.read_bytes())
    if not isinstance(data, dict) or not isinstance(data.get("version"), int):
        raise PromptError(f"{path}: expected a mapping with an integer 'version'")
    templates = {}
    for name, placeholders in required.items():
        template = data.get(name)
        if not isinstance(template, str) or not template.strip():
            raise PromptError(f"{path}: missing template '{name}'")
        try:
            used = _placeholders(template)
        except ValueError as e:
            raise PromptError(f"{path}: template '{name}' is malformed: {e}") from None
        if missing := placeholders - used:
            raise PromptError(f"{path}: template '{name}' lacks placeholder(s) {sorted(missing)}")
        if unknown := used - placeholders:
            raise PromptError(f"{path}: template '{name}' has unknown placeholder(s) {sorted(unknown)}; "
                              f"available: {sorted(placeholders)}")
        templates[name] = template
    return Prompt(path, data["version"], templates, sha256_bytes(path.read_bytes()))
