"""The HTML run report: self-contained, escaped, and written for runs in any state."""

from __future__ import annotations

import json
import logging
import shutil
from html.parser import HTMLParser

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_config, write_jsonl

from atlas.cli import main
from atlas.stages import STAGES
from atlas.tools.report import refresh_report, write_html_report

_VOID = {"meta", "img", "br", "hr", "link", "input"}


class _Page(HTMLParser):
    """Checks that tags nest and close, and collects image sources, links, table rows (cell texts) and text."""

    def __init__(self):
        super().__init__()
        self.stack, self.srcs, self.hrefs, self.rows, self.text, self._open_rows = [], [], [], [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.srcs += [attrs["src"]] if "src" in attrs else []
        self.hrefs += [attrs["href"]] if "href" in attrs else []
        if tag == "tr":
            self._open_rows.append([])
        if tag in ("td", "th") and self._open_rows:
            self._open_rows[-1].append("")
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        if tag == "tr":
            self.rows.append(self._open_rows.pop())

    def handle_data(self, data):
        self.text.append(data)
        if self._open_rows and self._open_rows[-1]:
            self._open_rows[-1][-1] += data


def _parse(path) -> tuple[str, _Page]:
    page = path.read_text()
    parser = _Page()
    parser.feed(page)
    parser.close()
    assert parser.stack == [], f"unclosed: {parser.stack}"
    return page, parser


def _status(parser: _Page, stage: str) -> str:
    """The status cell of a stage's row in the stage table (its first row that starts with the name)."""
    row = next(r for r in parser.rows if r and r[0] == stage)
    return row[1]


@pytest.fixture(scope="module")
def hostile_run(trained, tmp_path_factory):
    """A copy of the trained run with a <script> in a concept name and a reject, and one toy CBLM log."""
    _, run = trained
    root = tmp_path_factory.mktemp("report") / "run"
    shutil.copytree(run.root, root, ignore=shutil.ignore_patterns("_cache"))
    concepts = pq.read_table(root / "library" / "concepts.parquet").to_pylist()
    concepts.sort(key=lambda r: -(r["chunk_count"] or 0))
    concepts[0]["name"] = "<script>alert('name')</script>"
    pq.write_table(pa.Table.from_pylist(concepts), root / "library" / "concepts.parquet")
    (root / "tags" / "_rejects").mkdir(parents=True, exist_ok=True)
    reject = {"chunk_id": "web:1:00000", "reason": "schema_violation", "detail": "<script>alert('reject')</script>"}
    pq.write_table(pa.Table.from_pylist([reject]), root / "tags" / "_rejects" / "part-00000.parquet")
    model = root / "cblm" / "toy"
    model.mkdir(parents=True)
    (model / "metrics.json").write_text(json.dumps({"val_loss": 6.5, "step": 20, "parameters": {"total": 1000}}))
    (model / "checkpoint").mkdir()
    (model / "checkpoint" / "state.json").write_text(json.dumps({"train_config": {
        "head": "prism", "prototypes": 64, "mixer": "prototype", "rope": "standard", "objective": "ar", "d_model": 16,
        "n_layer": 2}}))
    write_jsonl(model / "log.jsonl", [{"step": s, "train": {"lm": 8 - s / 10}, "val": {"val_loss": 8 - s / 20}}
                                      for s in (10, 20)])
    return root


def test_report_of_a_trained_run_is_self_contained_and_escaped(hostile_run, capsys):
    assert main(["report", str(hostile_run)]) == 0
    path = hostile_run / "report" / "index.html"
    assert capsys.readouterr().out.strip() == str(path)
    page, parser = _parse(path)
    for stage in STAGES:  # one row per pipeline stage
        assert any(r and r[0] == stage for r in parser.rows), stage
    assert _status(parser, "train_annotator") == "done" and _status(parser, "annotate") == "not run"
    # every image is inlined: nothing to fetch, no file beside the page; links only jump within it
    assert parser.srcs and all(s.startswith("data:image/png;base64,") for s in parser.srcs)
    assert all(h.startswith("#") for h in parser.hrefs)
    assert "http" not in "".join(parser.srcs + parser.hrefs) and "<script" not in page.lower()
    assert "&lt;script&gt;alert(&#x27;name&#x27;)" in page and "&lt;script&gt;alert(&#x27;reject&#x27;)" in page
    text = "".join(parser.text)
    for expected in ("k_sweep.png", "Held-out retrieval vs baselines", "recall@10", "Decision rule",
                     "schema_violation", "toy: loss (log.jsonl)", "val_loss",
                     "PRISM, 64 prototypes; ProtoT mixer; ar, d 16 x 2 layers"):
        assert expected in text, expected
    assert "stage index has not run yet" in text


def test_a_run_stopped_after_chunk_still_reports(tmp_path, demo_records, capsys):
    config_path = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:4]))
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0  # `atlas run` writes the report
    path = tmp_path / "run" / "report" / "index.html"
    assert f"report: {path}" in capsys.readouterr().out
    page, parser = _parse(path)
    assert _status(parser, "chunk") == "done" and all(_status(parser, s) == "not run" for s in list(STAGES)[1:])
    text = "".join(parser.text)
    assert "chunks_out" in text and "No concept-bottleneck LM trained yet" in text and parser.srcs == []
    assert "stage library has not run yet" in text and "stage train_annotator has not run yet" in text
    assert write_html_report(tmp_path / "run") == path and path.read_text() == page  # the same run, the same page


def test_no_run_directory(tmp_path, capsys, caplog):
    with pytest.raises(FileNotFoundError, match="not an Atlas run directory"):
        write_html_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 1
    with caplog.at_level(logging.WARNING, logger="atlas.tools.report"):
        refresh_report(tmp_path)  # after a run or a training: a warning (logged), never an exception
    assert "warning: could not write the run report" in caplog.text
