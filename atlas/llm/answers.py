"""Tag answers: domain schemas, parsing with bounded repairs, validation, and tag normalization.

Every engine's answer goes through ``parse_answer``. A few harmless deviations are repaired and
counted (text around the JSON, unknown extra fields, a comma-separated string instead of a list,
too many items); anything else is a problem with a reason code, and the tag stage asks again or
quarantines the chunk.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from jsonschema import Draft202012Validator

from atlas.config import PROJECT_ROOT, TagConfig


def normalize_tag(tag: str) -> str:
    """The paper's normalization (4.2.2): ``Astronomical-Objects`` -> ``astronomical objects``."""
    tag = unicodedata.normalize("NFKC", tag).lower()
    tag = re.sub(r"[-_/|]+", " ", tag)
    tag = re.sub(r"\s+", " ", tag)
    return tag.strip(" \t\n\"'`.,;:!?()[]{}*")


@dataclass
class TagSchema:
    name: str
    schema: dict
    validator: Draft202012Validator = field(repr=False)

    @property
    def fields(self) -> list[str]:
        return list(self.schema["properties"])

    def describe_fields(self) -> str:
        """One line per field for the prompt: name, description and how many tags."""
        lines = []
        for name, spec in self.schema["properties"].items():
            lines.append(f"- {name}: {spec.get('description', '')} ({spec.get('minItems', 1)} to "
                         f"{spec.get('maxItems', 'several')} tags)")
        return "\n".join(lines)


class SchemaError(ValueError):
    """A schema or candidate-list file that cannot be used."""


def load_schemas(config: TagConfig) -> tuple[dict[str, TagSchema], dict[str, list[str]], list[Path]]:
    """The tag schemas by name, the candidate lists by name, and every file read (for the stage hash)."""
    root = Path(config.schema_dir) if config.schema_dir else PROJECT_ROOT / "schemas"
    files = sorted((root / "tags").glob("*.json")) + sorted((root / "candidates").glob("*.json"))
    schemas, candidates = {}, {}
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SchemaError(f"{path}: not valid JSON ({e})") from None
        if path.parent.name == "candidates":
            if not isinstance(data, list) or not data or not all(isinstance(v, str) and v for v in data):
                raise SchemaError(f"{path}: expected a non-empty list of strings")
            candidates[path.stem] = data
            continue
        Draft202012Validator.check_schema(data)
        properties = data.get("properties") or {}
        if data.get("type") != "object" or not properties:
            raise SchemaError(f"{path}: a tag schema is an object with properties (one per field)")
        for name, spec in properties.items():
            if spec.get("type") != "array" or spec.get("items", {}).get("type") != "string":
                raise SchemaError(f"{path}: field '{name}' must be an array of strings")
        schemas[path.stem] = TagSchema(path.stem, data, Draft202012Validator(data))
    if "generic" not in schemas:
        raise SchemaError(f"{root / 'tags'}: a 'generic' schema is required (the fallback for other domains)")
    for schema in schemas.values():
        for name, spec in schema.schema["properties"].items():
            offline = spec.get("x-atlas-offline")
            if not offline or offline.get("method") not in OFFLINE_METHODS:
                raise SchemaError(f"{root / 'tags' / schema.name}.json: field '{name}' needs "
                                  f'"x-atlas-offline": {{"method": one of {", ".join(OFFLINE_METHODS)}, "k": N}}')
            if spec.get("x-atlas-role", role_of(spec)) not in ROLES:
                raise SchemaError(f"{root / 'tags' / schema.name}.json: field '{name}' has \"x-atlas-role\" "
                                  f"{spec['x-atlas-role']!r}; expected one of {', '.join(ROLES)}")
            extensions = spec.get("x-atlas-extensions", {})
            if not isinstance(extensions, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and k and v for k, v in extensions.items()):
                raise SchemaError(f"{root / 'tags' / schema.name}.json: field '{name}' has \"x-atlas-extensions\" "
                                  f"that is not an object of file extension -> tag (\"py\": \"python\")")
            if offline["method"] == "candidates" and offline.get("list") not in candidates:
                raise SchemaError(f"{root / 'tags' / schema.name}.json: field '{name}' names candidate list "
                                  f"{offline.get('list')!r}, not found in {root / 'candidates'}")
    field_roles(schemas)  # roles must agree across schemas
    for domain, name in config.domain_schemas.items():
        if name not in schemas:
            raise SchemaError(f"tag.domain_schemas.{domain}: no schema '{name}' in {root / 'tags'}")
    return schemas, candidates, files


# What a field says about a chunk. "topic": what it is about (the content concept library is built from these
# fields by default, see vocab.roles). "style": how it is written (purpose, tone, difficulty, notation...).
ROLES = ("topic", "style")
# How the offline engine answers a field (atlas/llm/offline.py): "keyphrases" from the text, an entry of a
# "candidates" list when one clearly fits, or the modules a chunk of code "imports".
OFFLINE_METHODS = ("keyphrases", "candidates", "imports")


def file_answers(schema: TagSchema, doc_id: str) -> dict[str, list[str]]:
    """The fields a document's file name answers: for each field with ``"x-atlas-extensions"`` (a map of file
    extension -> tag, lower case), the tag of the extension ``doc_id`` ends with, if it is one of them
    ("code:maths/perfect_number.py" -> {"language": ["python"]}). The file's own type is a fact where the text is
    a guess: offline, 25% of the dev corpus' Python chunks that got a language got "matlab" or another (a chunk of
    doctests, ``>>> f([10, 40], 4)``, reads like one)."""
    file_name = doc_id.rsplit("/", 1)[-1]
    extension = file_name.rsplit(".", 1)[-1].lower() if "." in file_name else ""
    answers = {}
    for name, spec in schema.schema["properties"].items():
        tag = spec.get("x-atlas-extensions", {}).get(extension) if extension else None
        if tag:
            answers[name] = [tag]
    return answers


def role_of(spec: dict) -> str:
    """A field's role: its "x-atlas-role", else "topic" for free-form keyphrase fields and "style" for fixed lists."""
    default = "topic" if spec.get("x-atlas-offline", {}).get("method") == "keyphrases" else "style"
    return spec.get("x-atlas-role", default)


def field_roles(schemas: dict[str, TagSchema]) -> dict[str, str]:
    """Field name -> role over every schema; one field name has one role everywhere."""
    roles: dict[str, tuple[str, str]] = {}
    for schema in schemas.values():
        for name, spec in schema.schema["properties"].items():
            role = role_of(spec)
            if name in roles and roles[name][0] != role:
                raise SchemaError(f"field '{name}' is {roles[name][0]!r} in schema {roles[name][1]!r} but {role!r} in "
                                  f"{schema.name!r}: a field name has one \"x-atlas-role\" in every schema")
            roles.setdefault(name, (role, schema.name))
    return {name: role for name, (role, _) in roles.items()}


@dataclass
class Parsed:
    answer: dict | None  # field -> list of tags, valid against the schema
    problem: str | None = None  # reason code when answer is None
    detail: str = ""
    repairs: list[str] = field(default_factory=list)


def _extract_json(text: str) -> str | None:
    """The outermost {...} of a text with chatter or code fences around it."""
    start, end = text.find("{"), text.rfind("}")
    return text[start : end + 1] if 0 <= start < end else None


def parse_answer(text: str | None, finish_reason: str | None, schema: TagSchema) -> Parsed:
    if text is None:
        return Parsed(None, "no_answer", "the engine returned no text")
    repairs = []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        inner = _extract_json(text)
        try:
            data = json.loads(inner) if inner else None
        except json.JSONDecodeError:
            data = None
        if data is None:
            reason = "truncated" if finish_reason == "length" else "invalid_json"
            return Parsed(None, reason, f"{e.msg} at character {e.pos}")
        repairs.append("extracted_json")
    if not isinstance(data, dict):
        return Parsed(None, "invalid_json", f"expected an object, got {type(data).__name__}")
    properties = schema.schema["properties"]
    if extra := [k for k in data if k not in properties]:
        data = {k: v for k, v in data.items() if k in properties}
        repairs.append("dropped_extra_fields")
    for name, value in data.items():
        if isinstance(value, str):
            data[name] = [part for part in re.split(r"[,;]", value) if part.strip()]
            repairs.append("string_to_list")
        elif isinstance(value, list):
            if not all(isinstance(v, str) for v in value):
                data[name] = [str(v) for v in value if v is not None]
                repairs.append("non_string_items")
            limit = properties[name].get("maxItems")
            if limit is not None and len(data[name]) > limit:
                data[name] = data[name][:limit]
                repairs.append("too_many_items")
    if missing := [k for k in properties if k not in data]:
        return Parsed(None, "missing_field", f"missing {', '.join(missing)}" + (f"; extra {extra}" if extra else ""),
                      repairs)
    errors = sorted(schema.validator.iter_errors(data), key=lambda e: list(e.path))
    if errors:
        where = "/".join(str(p) for p in errors[0].path) or "(answer)"
        return Parsed(None, "schema_violation", f"{where}: {errors[0].message}", repairs)
    return Parsed(data, repairs=repairs)
