"""What the annotated shards hold, counted in them: the report's "Labels in the shards", `atlas inspect RUN
shard-labels`, the export's counts and concept flags (atlas.io.annotated, atlas.tools.labels).

Every expected number is counted here, directly over ``RUN/annotated/part-*.parquet`` with DuckDB, never taken from
Atlas's own readers. The annotated run of the session is copied and a few of its chunks given demographic and
alignment labels (and one a text with markup), so the counts and the samples of sensitive labels have something to
show whatever the offline annotator decided.
"""

from __future__ import annotations

import json
import re

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import copy_run_dir
from test_report import _Page, _parse

from atlas.cli import main
from atlas.core.rundir import RunDir
from atlas.io.annotated import label_counts, sample_chunks
from atlas.tools.report import write_html_report

MARKUP = "<b>a chunk with markup</b> & more"


def _add_labels(path, labels: dict[int, list[int]], text_of: dict[int, str]) -> None:
    """Give rows of an annotated part more labels (in their domain's column and in ``concepts``, with a score) and,
    for ``text_of``'s rows, another text."""
    table = pq.read_table(path)
    rows = table.to_pylist()
    for row, ids in labels.items():
        for g, column in ids:
            rows[row][column] = [*rows[row][column], g]
            rows[row]["concepts"] = [*rows[row]["concepts"], g]
            rows[row]["concept_scores"] = [*rows[row]["concept_scores"], 0.5 + 0.01 * row]
    for row, text in text_of.items():
        rows[row]["text"] = text
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)


@pytest.fixture(scope="module")
def labeled(annotated_run, tmp_path_factory):
    """A copy of the annotated run in which the first demographic label is carried by 5 chunks of part 0 and 2 of
    part 1, and the first alignment label by one chunk (whose text has markup). Returns (root, {name: id})."""
    _, run = annotated_run
    root = copy_run_dir(run.root, tmp_path_factory.mktemp("shard_labels") / "run")
    config = json.loads((root / "library" / "config.json").read_text())
    demographic, alignment = config["domain_offsets"]["demographic"], config["domain_offsets"]["alignment"]
    first, second = (root / "annotated" / f"part-{i:05d}.parquet" for i in (0, 1))
    assert pq.read_metadata(first).num_rows >= 5 and pq.read_metadata(second).num_rows >= 2
    d, a = (demographic, "demographic_global_ids"), (alignment, "alignment_global_ids")
    _add_labels(first, {0: [d], 1: [d, a], 2: [d], 3: [d], 4: [d, (demographic + 1, d[1])]}, {1: MARKUP})
    _add_labels(second, {0: [d], 1: [d]}, {})
    return root, {"demographic": demographic, "alignment": alignment}


def direct_counts(root) -> dict[str, dict[str, tuple[int, int, int]]]:
    """{label domain: {data domain or "all": (chunks, chunks labeled, labels)}}, counted by DuckDB over the parts."""
    parts = str(root / "annotated" / "part-*.parquet")
    columns = [c for c in pq.read_schema(root / "annotated" / "part-00000.parquet").names if c.endswith("_global_ids")]
    out = {}
    for column in columns:
        query = (f"SELECT coalesce(domain, 'unknown') AS d, count(*), count(*) FILTER (WHERE len({column}) > 0), "
                 f"coalesce(sum(len({column})), 0) FROM read_parquet('{parts}') GROUP BY ALL")
        rows = {d: (chunks, labeled, int(n)) for d, chunks, labeled, n in duckdb.sql(query).fetchall()}
        rows["all"] = tuple(sum(r[i] for r in rows.values()) for i in range(3))
        out[column.removesuffix("_global_ids")] = rows
    return out


def carriers(root, concept_id: int) -> set[str]:
    parts = str(root / "annotated" / "part-*.parquet")
    return {r[0] for r in duckdb.sql(f"SELECT chunk_id FROM read_parquet('{parts}') "
                                     f"WHERE list_contains(concepts, {concept_id})").fetchall()}


def _parse_fragment(fragment: str) -> _Page:
    parser = _Page()
    parser.feed(fragment)
    parser.close()
    return parser


def test_label_counts_are_what_the_parts_hold(labeled):
    root, ids = labeled
    expected = direct_counts(root)
    counts = label_counts(RunDir(root))
    assert set(counts) == set(expected) >= {"content", "tone", "demographic", "alignment"}
    for domain, cells in counts.items():
        assert list(cells)[-1] == "all"
        assert {d: (c["chunks"], c["chunks_labeled"], c["labels"]) for d, c in cells.items()} == expected[domain]
    carried = counts["demographic"]["all"]["per_label"]
    assert carried[ids["demographic"]] == len(carriers(root, ids["demographic"])) == 7


def test_the_report_counts_the_shards_and_samples_sensitive_labels(labeled):
    root, ids = labeled
    page, _ = _parse(write_html_report(root))
    section = page[page.index('<section id="shards">'):]
    section = section[: section.index("</section>")]
    first_table = section[section.index("<table>"): section.index("</table>") + len("</table>")]
    parser = _parse_fragment(first_table)
    header, *rows = parser.rows
    assert header == ["labels", "data domain", "chunks", "chunks labeled", "share", "labels in all", "labels / chunk"]
    shown = {(r[0], r[1]): tuple(int(x.replace(",", "")) for x in (r[2], r[3], r[5])) for r in rows}
    expected = direct_counts(root)
    assert shown == {(domain, d): cell for domain, cells in expected.items() for d, cell in cells.items()}
    assert expected["demographic"]["all"][1] == 7  # the case this test is for: a shard that holds demographic labels
    assert "held-out labels / chunk" in page  # the annotator's figure, named for what it is

    # the sample: up to 3 chunks of each sensitive label that occurs, each carrying it, the text escaped
    parser = _parse_fragment(section[section.index("<h3>Sensitive labels"):])
    library = pq.read_table(root / "library" / "concepts.parquet", columns=["concept_id", "domain", "name"])
    label_id = {r["name"]: r["concept_id"] for r in library.to_pylist() if r["domain"] != "content"}
    by_label: dict[str, list[str]] = {}
    for label, count, chunk_id, *_ in (r for r in parser.rows if len(r) == 7 and r[0] != "label"):
        by_label.setdefault(label, []).append(chunk_id)
        assert chunk_id in carriers(root, label_id[label])
        assert int(count.replace(",", "")) == len(carriers(root, label_id[label]))
    names = {g: name for name, g in label_id.items()}
    assert len(by_label[names[ids["demographic"]]]) == 3 and len(by_label[names[ids["alignment"]]]) == 1
    assert MARKUP not in page and "&lt;b&gt;a chunk with markup&lt;/b&gt; &amp; more" in page


def test_the_sample_holds_only_carriers_and_is_the_same_for_the_same_seed(labeled):
    root, ids = labeled
    run, label = RunDir(root), ids["demographic"]
    expected = carriers(root, label)
    first = sample_chunks(run, [label, ids["alignment"]], per_label=3, seed=4)
    assert first == sample_chunks(run, [ids["alignment"], label], per_label=3, seed=4)
    assert len(first[label]) == 3 and {c["chunk_id"] for c in first[label]} <= expected
    assert [c["chunk_id"] for c in first[ids["alignment"]]] == sorted(carriers(root, ids["alignment"]))
    assert all(c["score"] >= 0.5 and len(c["text"]) <= 300 + len(" [...]") for c in first[label])
    draws = {tuple(c["chunk_id"] for c in sample_chunks(run, [label], 3, seed)[label]) for seed in range(8)}
    assert len(draws) > 1 and all(set(d) <= expected for d in draws)  # the seed decides which chunks
    everyone = sample_chunks(run, [label], per_label=50, seed=0)[label]
    assert sorted(c["chunk_id"] for c in everyone) == sorted(expected)
    assert sample_chunks(run, [], 3, 0) == {}


def test_export_flags_and_counts(labeled, tmp_path):
    root, _ = labeled
    out = tmp_path / "release"
    assert main(["export", str(root), str(out)]) == 0
    concepts = pq.read_table(out / "concepts.parquet").to_pylist()
    for c in concepts:
        assert (c["is_tone"], c["is_alignment"], c["is_demographic"]) == (
            c["type"] == "tone", c["type"] == "alignment", c["type"] == "demographic")
    assert {c["type"] for c in concepts if not (c["is_tone"] or c["is_alignment"] or c["is_demographic"])} == {
        "content"}
    summary = json.loads((out / "export.json").read_text())
    assert {domain: {d: (c["chunks"], c["chunks_labeled"], c["labels"]) for d, c in cells.items()}
            for domain, cells in summary["label_counts"].items()} == direct_counts(root)
    readme = (out / "README.md").read_text()
    assert "`is_demographic`" in readme and 'concepts.filter(lambda c: not c["is_demographic"])' in readme
    library = pq.read_table(root / "library" / "concepts.parquet").to_pylist()
    assert all(r["is_demographic"] == (r["domain"] == "demographic") and r["is_tone"] == (r["domain"] == "tone")
               and r["is_alignment"] == (r["domain"] == "alignment") for r in library)


def test_inspect_shard_labels_prints_the_counts_and_chunks_of_a_label(labeled, capsys):
    root, ids = labeled
    capsys.readouterr()
    assert main(["inspect", str(root), "shard-labels"]) == 0
    out = capsys.readouterr().out
    for domain, cells in direct_counts(root).items():
        chunks, labeled_chunks, labels = cells["all"]
        assert re.search(rf"^{domain}\s+all\s+{chunks}\s+{labeled_chunks}\s+\S+%\s+{labels}\s", out, re.M), domain

    library = pq.read_table(root / "library" / "concepts.parquet").to_pylist()
    name = library[ids["demographic"]]["name"]
    assert main(["inspect", str(root), "shard-labels", "--label", f"demographic:{name}", "-n", "2",
                 "--random", "3"]) == 0
    out = capsys.readouterr().out
    shown = re.findall(r"^chunk_id=(\S+)", out, re.M)
    assert len(shown) == 2 and set(shown) <= carriers(root, ids["demographic"]) and "carried by 7 chunk(s)" in out
    assert main(["inspect", str(root), "shard-labels", "--label", str(ids["demographic"]), "-n", "2",
                 "--random", "3"]) == 0
    assert re.findall(r"^chunk_id=(\S+)", capsys.readouterr().out, re.M) == shown  # same seed, same chunks

    assert main(["inspect", str(root), "shard-labels", "--label", "no such label"]) == 2
    assert "names 0 concepts" in capsys.readouterr().err
    assert main(["inspect", str(root), "chunks", "--label", name]) == 2
