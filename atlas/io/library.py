"""Reading the concept library, ``RUN/library/`` (concepts.parquet, tag_to_concept.parquet, config.json)."""

from __future__ import annotations

import shutil
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from atlas.config import LibraryConfig
from atlas.core.files import ArtifactError, read_json, read_parquet, sha256_bytes, stable_hash
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.cards import CARD_FILE, CONFIGS_FILE
from atlas.io.tags import read_tags

# A concept's group as boolean columns beside ``domain``, as the Steerling release's concept catalog marks them: a
# publisher drops a group with one filter (``not is_demographic``) instead of knowing the domain names.
DOMAIN_FLAGS = {"is_tone": "tone", "is_alignment": "alignment", "is_demographic": "demographic"}
CONCEPT_SCHEMA = pa.schema(
    [("concept_id", pa.int64()), ("domain", pa.string()), *((flag, pa.bool_()) for flag in DOMAIN_FLAGS),
     ("name", pa.string()), ("description", pa.string()),
     ("evidence_tags", pa.list_(pa.string())), ("n_tags", pa.int64()), ("chunk_count", pa.int64()),
     ("prevalence", pa.float64()), ("taxonomy_path", pa.string()), ("merged_from", pa.list_(pa.int64())),
     ("lifted_words", pa.list_(pa.string()))]
)
TAG_TO_CONCEPT_SCHEMA = pa.schema([("tag_norm", pa.string()), ("cluster_id", pa.int64()), ("concept_id", pa.int64()),
                                   ("near_concept_id", pa.int64())])
# library/near_votes.parquet (clustered with contexts): how many of a chunk's tag occurrences give a concept a near
# vote, read in the chunk (atlas.stages.library.near_votes_in_context); a chunk's rows are consecutive.
NEAR_VOTES_SCHEMA = pa.schema([("chunk_id", pa.string()), ("concept_id", pa.int64()), ("votes", pa.float32())])
REBUILD_LIBRARY = "rebuild the library (atlas run CONFIG --force --stages library)"


def domain_flags(domain: str) -> dict[str, bool]:
    """The ``DOMAIN_FLAGS`` columns of a concept of ``domain``: a content concept has them all false."""
    return {flag: domain == flagged for flag, flagged in DOMAIN_FLAGS.items()}


def inherits(similarity: float, joined_similarity: float | None, library: LibraryConfig) -> bool:
    """Whether a tag of a kept cluster inherits its concept: its cosine to the cluster's centroid reaches
    ``tag_min_similarity``, or, clustered with contexts, its cosine in the space k-means fit (``joined_similarity`` of
    clusters/, null without contexts) reaches ``joined_min_similarity``. Below both it is at the cluster's edge, often
    another sense of a word."""
    return similarity >= library.tag_min_similarity or (joined_similarity is not None
                                                         and joined_similarity >= library.joined_min_similarity)


def inherits_sql(library: LibraryConfig, table: str) -> str:
    """:func:`inherits` as a SQL condition on the columns of clusters/ read as ``table``."""
    return (f"({table}.similarity >= {float(library.tag_min_similarity)!r} OR "
            f"coalesce({table}.joined_similarity >= {float(library.joined_min_similarity)!r}, false))")


def load_library(run: RunDir) -> tuple[list[dict], dict]:
    """The concepts (rows of concepts.parquet, by concept id) and config.json, checked against each other."""
    folder = run.output_dir(layout.LIBRARY)
    path, config_path = folder / "concepts.parquet", folder / "config.json"
    for p in (path, config_path):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no concept library here; run the library stage first")
    rebuild = REBUILD_LIBRARY
    config = read_json(config_path)
    # A library of the library stage (it has domains) has every column; a hand-made one needs ids and names.
    required = CONCEPT_SCHEMA if "domain_offsets" in config else ["concept_id", "name"]
    rows = read_parquet(path, required=required, hint=rebuild).to_pylist()
    offsets = config.get("domain_offsets", {})
    config["domain_offsets"] = dict(sorted(offsets.items(), key=lambda kv: kv[1]))  # id order: content first
    for row, concept in enumerate(rows):
        if concept["concept_id"] != row:
            seen = [r["concept_id"] for r in rows[:row]]
            what = "a duplicate" if concept["concept_id"] in seen else f"expected {row}"
            raise ArtifactError(f"{path}: row {row}: concept_id is {concept['concept_id']} ({what}); concept_id must "
                                f"be 0..{len(rows) - 1} in order; {rebuild}")
    if config.get("n_concepts") != len(rows):
        raise ArtifactError(f"{config_path}: n_concepts is {config.get('n_concepts')} but {path} has {len(rows)} rows")
    for domain, offset in config.get("domain_offsets", {}).items():
        size = config.get("domain_sizes", {}).get(domain, 0)
        if any(r["domain"] != domain for r in rows[offset : offset + size]):
            raise ArtifactError(f"{config_path}: domain {domain!r} (offset {offset}, size {size}) does not match the "
                                f"'domain' column of {path}")
    return rows, config


def check_concept_ids(path: Path, table: pa.Table, columns: list[str], n_concepts: int, hint: str) -> None:
    """Every id in the list columns ``columns`` of ``table`` (read from ``path``) is a concept of the library
    (0..n_concepts - 1): an id outside it is an ArtifactError that names the file, the row and the id."""
    for column in columns:
        lists = table.column(column).combine_chunks()
        ids = pc.list_flatten(lists)
        outside = pc.or_(pc.less(ids, 0), pc.greater_equal(ids, n_concepts))
        if len(ids) and pc.any(outside).as_py():
            first = pc.index(outside, True).as_py()
            row = pc.list_parent_indices(lists)[first].as_py()
            raise ArtifactError(f"{path}: row {row}: {column} holds concept id {ids[first].as_py()}, which is not in "
                                f"the library (ids 0..{n_concepts - 1}); {hint}")


def check_annotated(run: RunDir, n_concepts: int) -> None:
    """The annotated parts are readable, have the columns a release needs, and label chunks with concepts of this
    library only; read a column at a time."""
    from atlas.io.embedding_store import REANNOTATE

    for part in run.parts(layout.ANNOTATED):
        concepts = read_parquet(part, ["concepts"], required=["chunk_id", "concepts"], hint=REANNOTATE)
        check_concept_ids(part, concepts, ["concepts"], n_concepts, REANNOTATE)


def check_tag_to_concept(run: RunDir, n_content: int) -> None:
    """``tag_to_concept.parquet`` maps tags to content concepts of this library only (or to null)."""
    path = run.output_dir(layout.LIBRARY) / "tag_to_concept.parquet"
    rebuild = REBUILD_LIBRARY
    mapping = read_parquet(path, required=TAG_TO_CONCEPT_SCHEMA, hint=rebuild).to_pydict()
    for column in ("concept_id", "near_concept_id"):
        for row, (tag, concept) in enumerate(zip(mapping["tag_norm"], mapping[column])):
            if concept is not None and not 0 <= concept < n_content:
                raise ArtifactError(f"{path}: row {row} (tag {tag!r}): {column} {concept} is not a content concept of "
                                    f"the library (0..{n_content - 1}); {rebuild}")


def inheriting_fields(library_config: dict) -> list[str] | None:
    """The tag fields through which a chunk inherits content concepts: those the library was built from (the topic
    fields; a style tag such as ``tone: academic`` or ``language: python`` inherits nothing, even where a topic field
    has the same words). None (every field) for a library written before ``fields`` was recorded."""
    return library_config.get("fields")


def chunk_concepts(run: RunDir) -> dict[str, list[int]]:
    """Own concept ids of every tagged chunk, most frequent (by its tags) first."""
    return {chunk: list(votes) for chunk, votes in chunk_concept_votes(run).items()}


def chunk_concept_votes(run: RunDir, near_weight: float = 0.0) -> dict[str, dict[int, float]]:
    """Every tagged chunk's concepts with their votes, most first (ties: smaller id): one for each of its tags (of the
    fields the library was built from) whose own concept it is, and ``near_weight`` for each near vote
    (``library.near_concept_weight``; 0: own concepts only): read in the chunk where the library wrote them
    (``near_votes.parquet``, clustered with contexts), else the tag's near concept. A library written before near
    concepts has none."""
    folder = run.output_dir(layout.LIBRARY)
    mapping = read_parquet(folder / "tag_to_concept.parquet", required=["tag_norm", "concept_id"],
                           hint=REBUILD_LIBRARY).to_pydict()
    in_context = folder / layout.LIBRARY_NEAR_VOTES
    read_in_context = near_weight > 0 and in_context.exists()
    near_of_tag = mapping.get("near_concept_id") if near_weight > 0 and not read_in_context else None
    votes_of_tag: dict[str, list[tuple[int, float]]] = {}
    for row, (tag, concept) in enumerate(zip(mapping["tag_norm"], mapping["concept_id"])):
        votes = [(concept, 1.0)] if concept is not None else []
        if near_of_tag is not None and near_of_tag[row] is not None:
            votes.append((near_of_tag[row], near_weight))
        if votes:
            votes_of_tag[tag] = votes
    fields = inheriting_fields(read_json(run.output_dir(layout.LIBRARY) / "config.json"))
    tags = read_tags(run, ["chunk_id", "field", "tag_norm"])
    if fields is not None:
        tags = tags.filter(pc.is_in(tags.column("field"), pa.array(fields, pa.string())))
    chunk_votes: dict[str, Counter] = defaultdict(Counter)
    for row in tags.select(["chunk_id", "tag_norm"]).to_pylist():
        for concept, weight in votes_of_tag.get(row["tag_norm"], ()):
            chunk_votes[row["chunk_id"]][concept] += weight
    if read_in_context:
        near = read_parquet(in_context, required=NEAR_VOTES_SCHEMA,
                            hint="rebuild the library: atlas run CONFIG --stages library --force").to_pydict()
        for chunk, concept, votes in zip(near["chunk_id"], near["concept_id"], near["votes"]):
            chunk_votes[chunk][concept] += near_weight * votes
    return {chunk: dict(sorted(v.items(), key=lambda kv: (-kv[1], kv[0]))) for chunk, v in chunk_votes.items()}


# --- a library and annotator built by another run (annotate.annotator_from) ---------------------------------------

# A stage's records, not its results (the dataset card is made from the results: not a result itself).
BOOKKEEPING = ("_shards", "_SUCCESS", "_stats.json", "_source.json", CARD_FILE, CONFIGS_FILE)


def annotator_source(path: str | Path) -> tuple[Path, Path]:
    """The (annotator folder, library folder) that ``annotate.annotator_from`` names: a finished run, or an
    annotator folder with its library beside it (``../library``) or inside it (``library/``)."""
    path = Path(path)
    if (path / layout.ANNOTATOR / "config.json").is_file():
        annotator, candidates = path / layout.ANNOTATOR, [path / layout.LIBRARY]
    elif (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        annotator, candidates = path, [path / layout.LIBRARY, path.parent / layout.LIBRARY]
    else:
        raise ArtifactError(f"{path}: annotate.annotator_from must be a finished Atlas run (with {layout.ANNOTATOR}/"
                            f"config.json) or an annotator folder (config.json, model.safetensors); it is neither")
    for library in candidates:
        if (library / "concepts.parquet").is_file() and (library / "config.json").is_file():
            return annotator, library
    raise ArtifactError(f"{annotator}: no library beside this annotator (looked for concepts.parquet and config.json "
                        f"in {' and '.join(str(c) for c in candidates)})")


def _result_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".tmp")
                  and not set(p.relative_to(folder).parts) & set(BOOKKEEPING))


def folder_digest(folder: Path) -> str:
    """sha256 over the result files of a folder (names and bytes), its stage bookkeeping left out."""
    return stable_hash({str(p.relative_to(folder)): sha256_bytes(p.read_bytes()) for p in _result_files(folder)})


def import_folder(source: Path, target: Path) -> None:
    """Make ``target`` a copy of ``source``'s result files, unless it already is one (a copy cut short by a kill is
    redone). The copy goes to a temporary folder first, so ``target`` is either the old or the new."""
    if target.is_dir() and folder_digest(target) == folder_digest(source):
        return
    staging = target.with_name(f".{target.name}.import.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    for path in _result_files(source):
        copy = staging / path.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, copy)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
