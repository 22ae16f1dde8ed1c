"""``atlas report RUN``: the self-contained HTML run report, ``RUN/report/index.html``.

The report (``write_html_report``) reads whatever the run holds (the stages' PNG plots come from
``atlas.core.plots``): every section is optional, so a run stopped after ``chunk`` still gets a report
that says what is missing. Every string that comes from the run (concept names, chunk text, reject
details) is untrusted corpus text and is HTML-escaped; images are inlined as data URIs, so the page needs
no network and no files.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
from pathlib import Path

from atlas.core.files import ArtifactError, atomic_write_bytes, open_parquet, read_json, read_parquet, stable_hash
from atlas.core.plots import curves
from atlas.io import layout

log = logging.getLogger("atlas.tools.report")

# Which stage writes each plot (a plot is shown only while that stage is recorded: --force clears a
# stage's outputs but not RUN/report/, so an older plot would otherwise pass for a current one) and the
# report section it belongs to. More specific prefixes come first.
_PLOTS = (("k_sweep", "cluster", "library"), ("coherence_", "coherence", "library"),
          ("concept_sizes", "library", "library"), ("concept_map", "library", "library"),
          ("tag_relevance", "tag", "judge"), ("concept_relevance", "library", "judge"),
          ("annotator_", "train_annotator", "annotator"))

# The counters that read as a stage's rows in and out; other stages fall back to "*_in" / "*_out".
_IO = {"chunk": ("docs_in", "chunks_out"), "tag": ("chunks_in", "chunks_tagged"), "vocab": ("tags_in", "unique_tags"),
       "cluster": ("tags_in", "clusters_non_empty"), "coherence": ("clusters_in", "clusters_kept"),
       "label": ("clusters_in", "concepts_out"), "library": ("concepts_labeled", "concepts_out"),
       "targets": ("chunks_tagged", "chunks_with_concepts"), "train_annotator": ("chunks", "train"),
       "annotate": ("chunks", "chunks"), "tokenize": ("chunks", "stream_tokens"), "index": ("vectors", "vectors")}

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; color: #222; max-width: 1240px; margin: 0 auto; padding: 16px 24px; }
h1 { margin-bottom: 4px; } h2 { border-bottom: 2px solid #4c72b0; padding-bottom: 3px; margin-top: 32px; }
nav a { margin-right: 14px; } .meta, .missing, figcaption { color: #666; } .missing { font-style: italic; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f3f8; } tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td { max-width: 420px; overflow-wrap: break-word; } small { color: #777; }
.done { color: #2a7d2a; font-weight: 600; } .failed { color: #c0392b; font-weight: 600; }
.running, .planned, .interrupted { color: #b7791f; font-weight: 600; } .not-run { color: #999; }
.figs { display: grid; grid-template-columns: repeat(auto-fill, minmax(480px, 1fr)); gap: 16px; }
figure { margin: 0; } figure img { width: 100%; border: 1px solid #eee; } figure.wide { grid-column: 1 / -1; }
figure.wide img { max-width: 820px; } details summary { cursor: pointer; color: #4c72b0; }
.cards { display: flex; flex-wrap: wrap; gap: 0 24px; align-items: flex-start; }
"""


class _Html(str):
    """Markup built here: passed through, where every other value is escaped."""


def _fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _cell(value, limit: int = 240) -> str:
    if isinstance(value, _Html):
        return f"<td>{value}</td>"
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    text = _fmt(value)
    text = text if len(text) <= limit else text[:limit] + " [...]"
    return f"<td class=\"num\">{html.escape(text)}</td>" if numeric else f"<td>{html.escape(text)}</td>"


def _table(header: list[str] | None, rows: list[list]) -> _Html:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return _Html(f"<table>{head}{body}</table>")


def _flat(d: dict, prefix: str = "", skip: tuple = ()) -> dict:
    """Scalars of a nested dict, keys joined with '.'; lists and the keys in ``skip`` are left out."""
    out = {}
    for k, v in d.items():
        if k in skip or isinstance(v, list):
            continue
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}.", skip))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _kv(d: dict, skip: tuple = ()) -> _Html:
    return _table(None, [[k, v] for k, v in _flat(d, skip=skip).items()])


def _missing(stage: str, status: str | None) -> str:
    state = f"has status {html.escape(status)}" if status else "has not run yet"
    return f'<p class="missing">Not available: stage <b>{html.escape(stage)}</b> {state}.</p>'


def _img(data: bytes, caption: str, wide: bool = False) -> str:
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    return (f'<figure{" class=wide" if wide else ""}><img src="{uri}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _read_json(path: Path):
    return read_json(path) if path.exists() else None


def _log_entries(path: Path) -> list[dict]:
    """The records of a training log (JSON lines); a damaged line is an ArtifactError that names it."""
    entries = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{path}: line {number} is not valid JSON ({e.msg}); the log is damaged: repair or "
                                "delete that line (the model itself is in the checkpoint)") from None
        if not isinstance(entry, dict):
            raise ArtifactError(f"{path}: line {number} is not a JSON object; the log is damaged: repair or delete "
                                "that line (the model itself is in the checkpoint)")
        entries.append(entry)
    return entries


def _summary(run, manifest: dict, statuses) -> str:
    not_run = [s.name for s in statuses if s.state not in ("done", "not in this run")]
    packages = ", ".join(f"{k} {v}" for k, v in manifest.get("packages", {}).items() if v != "not installed")
    rows = [["run directory", str(run.root.resolve())], ["config hash", stable_hash(manifest.get("config", {}))[:12]],
            ["manifest updated", manifest.get("updated", "?")], ["packages", packages],
            ["stages not done", ", ".join(not_run) or "none: every stage is done"]]
    from atlas.tools.status import sample_summary

    if sample := sample_summary(manifest, statuses):
        rows.append(["library built from", sample])
    return _table(None, rows)


def _stage_rows(statuses) -> str:
    """The stage table: the same states and counts as `atlas status` (atlas.tools.status), plus the counters."""
    rows = []
    for s in statuses:
        if s.state == "not started":
            rows.append([s.name, _Html('<span class="not-run">not run</span>'), "", "", "", "", "", "", ""])
            continue
        key_in, key_out = _IO.get(s.name) or (next((k for k in s.counters if k.endswith("_in")), None),
                                             next((k for k in s.counters if k.endswith("_out")), None))
        rows_in, rows_out = (_Html(f"{_fmt(s.counters[k])} <small>{html.escape(k)}</small>")
                             if k in s.counters else ""
                             for k in (key_in, key_out))
        failed = f" (shards {sorted(s.failed)})" if s.failed else ""
        details = (_Html(f"<details><summary>{len(s.counters)}</summary>{_kv(s.counters)}</details>")
                   if s.counters else "")
        rows.append([s.name, _Html(f'<span class="{html.escape(s.state)}">{html.escape(s.state + failed)}</span>'),
                     f"{s.shards_done}/{s.shards_total}", rows_in, rows_out, sum(s.drops.values()),
                     "" if s.wall_seconds is None else s.wall_seconds, round(s.shard_seconds, 3), details])
    return _table(["stage", "status", "shards", "in", "out", "dropped", "wall s", "shard s", "counters"], rows)


def _drops(run, recorded: dict, stage_names: list[str]) -> str:
    """Per stage: the drop counters, and the first few rejects with their reason (each column cut short)."""
    import pyarrow as pa

    from atlas.stages import STAGES

    parts = []
    for name, info in ((n, recorded[n]) for n in stage_names if n in recorded):
        reasons = {k[len("dropped."):]: v for k, v in info.get("counters", {}).items() if k.startswith("dropped.")}
        output = STAGES[name].output if name in STAGES else info.get("output", name)
        files = sorted((run.output_dir(output) / "_rejects").glob("part-*.parquet"))
        if not (any(reasons.values()) or files or info.get("failed_shards")):
            continue
        parts.append(f"<h3>{html.escape(name)}</h3>")
        if reasons:
            parts.append(_table(["reason", "dropped"], sorted(reasons.items(), key=lambda kv: -kv[1])))
        for shard, error in sorted(info.get("errors", {}).items()):
            parts.append(f"<p class=failed>failed shard {html.escape(shard)}: {html.escape(error)}</p>")
        if files:
            redo = f"recompute the stage: atlas run CONFIG --force --stages {name}"
            with open_parquet(files[0], hint=redo) as pf:
                try:
                    first = next(pf.iter_batches(batch_size=3), None)  # not the whole file
                except (pa.ArrowException, OSError) as e:
                    raise ArtifactError(f"{files[0]}: cannot be decoded ({e}): truncated or damaged; {redo}") from None
            examples = first.to_pylist() if first is not None else []
            header = list(examples[0]) if examples else []
            parts.append(f"<p>examples from {html.escape(files[0].relative_to(run.root).as_posix())} "
                         f"({len(files)} reject file(s)):</p>")
            parts.append(_table(header, [[str(r[k]) for k in header] for r in examples]))
    return "".join(parts) or "<p>Nothing was dropped.</p>"


def _plot_kind(path: Path) -> tuple[int, str | None, str]:
    """(position in pipeline order, the stage that writes it, its section); unknown plots come last."""
    for i, (prefix, stage, section) in enumerate(_PLOTS):
        if path.name.startswith(prefix):
            return i, stage, section
    return len(_PLOTS), None, "other"


def _plots(run, recorded: dict, section: str) -> str:
    figures = []
    for path in sorted((run.root / layout.REPORT).glob("*.png"), key=lambda p: (_plot_kind(p)[0], p.name)):
        _, stage, sec = _plot_kind(path)
        if sec == section and (stage is None or recorded.get(stage, {}).get("status") == "done"):
            figures.append(_img(path.read_bytes(), path.name, wide=path.name.startswith("concept_map")))
    return f'<div class="figs">{"".join(figures)}</div>' if figures else ""


def _concepts(run, top: int = 20) -> str:
    """The most used concepts (by chunk count), with the evidence a reader needs to judge them."""
    from atlas.io.library import REBUILD_LIBRARY

    columns = ["concept_id", "domain", "name", "description", "chunk_count", "evidence_tags", "lifted_words"]
    rows = read_parquet(run.root / layout.LIBRARY / "concepts.parquet", columns, hint=REBUILD_LIBRARY).to_pylist()
    per_domain: dict[str, int] = {}
    for r in rows:
        per_domain[r["domain"]] = per_domain.get(r["domain"], 0) + 1
    count = lambda r: 0 if r["chunk_count"] is None or math.isnan(r["chunk_count"]) else r["chunk_count"]  # noqa: E731
    shown = sorted(rows, key=count, reverse=True)[:top]
    table = _table(["id", "name", "domain", "chunks", "description", "evidence tags", "lifted words"],
                   [[r["concept_id"], r["name"], r["domain"], int(count(r)), r["description"],
                     ", ".join((r["evidence_tags"] or [])[:8]), ", ".join((r["lifted_words"] or [])[:10])]
                    for r in shown])
    totals = ", ".join(f"{k} {v}" for k, v in per_domain.items())
    return f"<p>{len(rows)} concepts ({html.escape(totals)}); the {len(shown)} most used:</p>{table}"


def _annotator(run) -> str:
    metrics = _read_json(run.root / layout.ANNOTATOR / "metrics.json")
    ks = ("1", "5", "10", "20")
    scored = [(f"annotator: {name}", m) for name, m in metrics.get("domains", {}).items()]
    scored += [(f"baseline: {name}", m) for name, m in metrics.get("baselines", {}).items()]
    rows = [[name, m.get("labels"), m.get("positives"), *[m.get("recall_at", {}).get(k) for k in ks], m.get("pr_auc"),
             m.get("reliability", {}).get("ece")] for name, m in scored]
    retrieval = _table(["held-out", "labels", "positives", *[f"recall@{k}" for k in ks], "PR-AUC", "ECE"], rows)
    domains = metrics.get("domains", {})
    rules = _table(["domain", "threshold", "cap", "criterion", "recall", "precision ≥", "F1 ≥",
                    "held-out labels / chunk"],
                   [[d, r.get("threshold"), r.get("cap"), r.get("criterion"), domains.get(d, {}).get("recall"),
                     domains.get(d, {}).get("precision_lower_bound"), domains.get(d, {}).get("f1_lower_bound"),
                     domains.get(d, {}).get("mean_predicted_per_chunk")] for d, r in metrics.get("rules", {}).items()])
    about = {k: metrics.get(k) for k in ("encoder", "mode", "device", "train_chunks", "heldout_chunks")}
    judge = metrics.get("judge") or {}
    judged = _kv(judge, skip=("score_counts",)) if judge else ""
    return (f"{_kv(about)}<h3>Held-out retrieval vs baselines</h3>{retrieval}<h3>Decision rule</h3>"
            f"<p>a label is given when its calibrated probability passes the threshold, at most cap per chunk "
            f"(precision and F1 are lower bounds: unlabelled positives count as errors). These figures are the "
            f"annotator's on its {_fmt(metrics.get('heldout_chunks') or 0)} held-out chunks, an estimate: what the "
            f"annotated shards hold is under <a href=\"#shards\">Labels in the shards</a>.</p>{rules}"
            f"{'<h3>Relevance judge of the predictions</h3>' + judged if judged else ''}"
            f"{_annotator_curves(metrics)}")


def _shard_labels(run, samples_per_label: int = 3, seed: int = 0) -> str:
    """What the annotated parts hold, counted in them (atlas.io.annotated), and a random sample of the chunks of every
    sensitive label that occurs, for a person to check."""
    from atlas.io.annotated import ALL, label_counts, sample_chunks
    from atlas.io.library import load_library
    from atlas.tools.labels import COUNT_HEADER, count_rows, sensitive_labels

    counts = label_counts(run)
    concepts = load_library(run)[0]
    parts = [f"<p>Counted in the annotated parts (<code>{html.escape(layout.ANNOTATED)}/part-*.parquet</code>), "
             "the labels a trainer reads: per label domain and data domain, the chunks with at least one label of "
             "that domain, their share, and labels per chunk (over all the chunks of the data domain). The "
             "annotator's own figures above are on its held-out chunks.</p>",
             _table(COUNT_HEADER, count_rows(counts))]
    carried = {domain: cells[ALL]["per_label"] for domain, cells in counts.items()}
    shown = [c for c in sensitive_labels(run, concepts) if carried.get(c["domain"], {}).get(c["concept_id"])]
    parts.append("<h3>Sensitive labels: a sample to check by hand</h3>")
    if not shown:
        parts.append("<p>No chunk carries a sensitive label (demographic, alignment or emotional tone).</p>")
        return "".join(parts)
    parts.append(f"<p>Every demographic and alignment label, and every emotional tone, that a chunk carries: up to "
                 f"{samples_per_label} of its chunks drawn at random (seed {seed}), with the label's score. "
                 "<code>atlas inspect RUN shard-labels --label NAME -n 10 --random SEED</code> draws more.</p>")
    samples = sample_chunks(run, [c["concept_id"] for c in shown], samples_per_label, seed, chars=300)
    for domain in dict.fromkeys(c["domain"] for c in shown):
        rows = [[c["name"], carried[domain][c["concept_id"]], chunk["chunk_id"], chunk["domain"], chunk["data_src"],
                 round(chunk["score"], 3), _Html(html.escape(chunk["text"]))]  # escaped here: _cell would cut it
                for c in shown if c["domain"] == domain for chunk in samples[c["concept_id"]]]
        parts.append(f"<h4>{html.escape(domain)}</h4>")
        parts.append(_table(["label", "chunks", "chunk", "data domain", "source", "score", "text"], rows))
    return "".join(parts)


def _annotator_curves(metrics: dict) -> str:
    """What annotator_training.png plots, with this run's numbers: why its held-out loss can rise."""
    history = metrics.get("history") or []
    if len(history) < 2:
        return ""
    first, last = history[0], history[-1]
    domains = sorted((k.removeprefix("heldout_").removesuffix("_bce") for k in last
                      if k.startswith("heldout_") and k.endswith("_bce")),
                     key=lambda d: (d != "content", d))  # the concepts first, then the auxiliary lists

    def part(h: dict, d: str) -> float:
        return h.get(f"heldout_{d}_bce", 0.0) + h.get(f"heldout_{d}_pu", 0.0)

    def moves(d: str) -> str:
        low = min(history, key=lambda h: part(h, d))
        return f"{d} {part(first, d):.2f} → {part(low, d):.2f} (epoch {low.get('epoch')}) → {part(last, d):.2f}"

    heldout = metrics.get("heldout_chunks") or 0
    which = f"the {heldout:,} held-out chunks" if heldout <= 2048 else "the first 2,048 held-out chunks"
    return ("<h3>Training curves (annotator_training.png)</h3>"
            "<p><b>train objective</b>: per epoch, the mean training loss, BCE on the labelled positives + nnPU risk "
            "(unlabelled pairs count as partly negative), summed over the domains, on rarity-weighted resampled "
            f"training chunks. <b>held-out loss (all domains)</b>: the same loss on {html.escape(which)}, "
            f"unweighted: {first.get('heldout_loss', float('nan')):.2f} at epoch {first.get('epoch')} → "
            f"{last.get('heldout_loss', float('nan')):.2f} at epoch {last.get('epoch')}. Per domain (BCE + nnPU "
            f"risk), first → lowest (epoch) → last: {html.escape('; '.join(moves(d) for d in domains))}. "
            "<b>held-out content loss</b> is the content domain's part alone, the concepts. The other domains are "
            f"the short auxiliary label lists ({html.escape(', '.join(d for d in domains if d != 'content'))}), "
            "whose few positives are fitted and then overfitted: most of a rising total. A loss that rises after "
            "its lowest point means the held-out "
            "positives' probabilities fall as the model fits the training labels more closely, while their rank "
            "among a chunk's concepts can still improve: <b>held-out recall@10</b>, the share of the held-out "
            "chunks' inherited concepts found among their 10 best-scored, is the curve to watch "
            f"({first.get('heldout_content_recall_at_10', float('nan')):.3f} → "
            f"{last.get('heldout_content_recall_at_10', float('nan')):.3f}).</p>")


def _evaluations(run) -> str:
    """The summaries `atlas judge` and `atlas eval` leave in RUN/report/*.json."""
    # score_counts are the histograms above; library_eval's relevance is concept_relevance.json; the
    # annotator's relevance is in its own section (metrics.json holds the same numbers).
    parts = [f"<div><h3>{html.escape(p.name)}</h3>{_kv(_read_json(p), skip=('score_counts', 'relevance'))}</div>"
             for p in sorted((run.root / layout.REPORT).glob("*.json")) if p.name != "annotator_relevance.json"]
    if not parts:
        return '<p class="missing">No evaluations yet (`atlas judge RUN`, `atlas eval library RUN`).</p>'
    return f'<div class="cards">{"".join(parts)}</div>'


def _index(run) -> str:
    info = _read_json(run.root / layout.INDEX / "_index.json")
    recall = info.get("recall_at_10")
    head = f"<p>recall@10 against exact search: <b>{html.escape(_fmt(recall))}</b></p>" if recall is not None else ""
    return head + _kv(info)


def _train_config(folder: Path) -> dict:
    """The training settings saved with a model's checkpoint (atlas.cblm.checkpoint), or {}."""
    for name in ("checkpoint", "checkpoint.old"):
        state = _read_json(folder / name / "state.json")
        if state:
            return state.get("train_config", {})
    return {}


def _val_losses(name: str, config: dict, metrics: dict | None, entries: list[dict]) -> str:
    """What the table's val_loss and the plot's val loss each are: one model, two evaluations on different windows."""
    last = entries[-1] if entries else {}
    logged, metrics = last.get("val", {}), metrics or {}

    def tokens(d: dict) -> str:
        return f", on {_fmt(d['val_tokens'])} tokens" if d.get("val_tokens") is not None else ""

    table = f"{_fmt(metrics['val_loss'])}{tokens(metrics)}" if "val_loss" in metrics else "not written yet"
    plot = (f"{_fmt(logged['val_loss'])} at step {_fmt(last.get('step'))}{tokens(logged)}" if "val_loss" in logged
            else "none logged yet")
    every, batches, size = (config.get(k, "?") for k in ("eval_every", "eval_batches", "batch_size"))
    fraction = config.get("val_fraction")
    held = f": the last {fraction:.0%} of each token shard's windows" if isinstance(fraction, float) else ""
    same = (f" At step {_fmt(last['step'])} both score the same weights: they differ only by the windows they score."
            if "val_loss" in metrics and "val_loss" in logged and last.get("step") == metrics.get("step") else "")
    return (f"<p><b>{html.escape(name)}: two validation losses.</b> Both are the LM loss (next-token cross-entropy; "
            "diffusion: on the masked positions) with teacher forcing and dropout off, on held-out windows"
            f"{html.escape(held)}. <b>val_loss in the table</b> ({html.escape(table)}) is metrics.json: the final "
            "evaluation at the end of training, the same as <code>atlas cblm eval</code>, on every held-out window "
            f"(the star in the plot). <b>val loss in the plot</b> (last point {html.escape(plot)}) is log.jsonl: the "
            f"estimate taken every {html.escape(str(every))} steps on the first {html.escape(str(batches))} batches "
            f"of {html.escape(str(size))} held-out windows only, the same windows each time, in shard order."
            f"{html.escape(same)} <b>train lm</b> is the LM loss of the training batch of that step, with teacher "
            "forcing and dropout on.</p>")


def _architecture(config: dict) -> str:
    """The model's head and backbone in a few words, from its training settings (older ones: `concepts` true/false)."""
    if not config:
        return "?"
    head = config.get("head") or ("concepts" if config.get("concepts", True) else "none")
    head = {"none": "baseline (no head)", "prism": f"PRISM, {config.get('prototypes')} prototypes"}.get(
        head, "concept bottleneck")
    mixer = "ProtoT mixer" if config.get("mixer") == "prototype" else "attention"
    rope = ", pi-RoPE" if config.get("rope") == "pi" else ""
    size = f"d {config.get('d_model')} x {config.get('n_layer')} layers"
    return f"{head}; {mixer}{rope}; {config.get('objective', 'ar')}, {size}"


def _cblm(run) -> str:
    """The trained models side by side (final metrics, one column each), then their loss curves (log.jsonl)."""
    models, figures, notes = {}, [], []
    for folder in sorted(p for p in (run.root / layout.CBLM).glob("*") if p.is_dir()):
        metrics, log = _read_json(folder / "metrics.json"), folder / "log.jsonl"
        if metrics is None and not log.exists():
            continue
        config = _train_config(folder)
        models[folder.name] = {"model": _architecture(config),
                               **_flat(metrics or {"status": "no metrics.json yet (still training?)"})}
        entries = _log_entries(log) if log.exists() else []
        notes.append(_val_losses(folder.name, config, metrics, entries))
        if len(entries) > 1:  # one point is no curve; the table has its numbers
            series = {"train lm (that step's batch)": [e.get("train", {}).get("lm") for e in entries],
                      "val loss (first held-out windows, log.jsonl)": [e.get("val", {}).get("val_loss")
                                                                       for e in entries]}
            marks = ({"val_loss, all held-out windows (metrics.json)": (metrics.get("step", entries[-1].get("step")),
                                                                        metrics["val_loss"])}
                     if metrics and "val_loss" in metrics else None)
            png = curves([e.get("step") for e in entries], series, f"{folder.name}: loss", "step", marks)
            figures.append(_img(png, f"{folder.name}: loss (log.jsonl); the star: metrics.json"))
    if not models:
        return '<p class="missing">No concept-bottleneck LM trained yet (`atlas cblm train RUN`).</p>'
    keys = list(dict.fromkeys(k for m in models.values() for k in m))
    table = _table(["metric", *models], [[k, *(m.get(k, "") for m in models.values())] for k in keys])
    return f'{table}{"".join(notes)}<div class="figs">{"".join(figures)}</div>'


def write_html_report(run_root) -> Path:
    """(Re)write ``RUN/report/index.html`` from whatever the run holds; returns its path."""
    from atlas.core.rundir import RunDir
    from atlas.stages import STAGES
    from atlas.tools.status import run_status

    run = RunDir(run_root)
    manifest = run.read_manifest()
    if not manifest:
        raise FileNotFoundError(f"{run.root}: not an Atlas run directory (no manifest.json)")
    recorded = manifest.get("stages", {})
    names = [*STAGES, *(s for s in recorded if s not in STAGES)]

    def done(stage: str, section) -> str:
        """A section that reads a stage's outputs, or why it is not there (a stage --force is redoing, say)."""
        info = recorded.get(stage, {})
        status = info.get("status") if info.get("hash") or not info else "unknown"  # a record without hash: not done
        return section(run) if status == "done" else _missing(stage, status)

    statuses = run_status(run, manifest)
    sections = [
        ("summary", "Run", _summary(run, manifest, statuses)),
        ("stages", "Stages", _stage_rows(statuses)),
        ("drops", "Drops and rejects", _drops(run, recorded, names)),
        ("library", "Concept library", _plots(run, recorded, "library") + done("library", _concepts)),
        ("annotator", "Concept annotator", done("train_annotator", _annotator) + _plots(run, recorded, "annotator")),
        ("shards", "Labels in the shards", done("annotate", _shard_labels)),
        ("judge", "Relevance judge and evaluations", _plots(run, recorded, "judge") + _evaluations(run)),
        ("index", "Search index", done("index", _index)),
        ("cblm", "Concept-bottleneck LM", _cblm(run)),
    ]
    other = _plots(run, recorded, "other")
    if other:
        sections.append(("other", "Other plots", other))
    title = f"Atlas run report: {manifest.get('name', run.root.name)}"
    nav = "".join(f'<a href="#{key}">{html.escape(head)}</a>' for key, head, _ in sections)
    body = "".join(f'<section id="{key}"><h2>{html.escape(head)}</h2>{body}</section>' for key, head, body in sections)
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f'<p class="meta">updated {html.escape(str(manifest.get("updated", "?")))}</p><nav>{nav}</nav>{body}'
            "</body></html>\n")
    path = run.root / layout.REPORT / "index.html"
    atomic_write_bytes(path, page.encode())
    return path


def refresh_report(run_root, mirror=None) -> None:
    """Rewrite the report after a run or a training; a failure only warns, it never fails the run. ``mirror``: the
    run's ``RunMirror`` when it is kept in object storage, where the report goes too."""
    try:
        log.info("report: %s", write_html_report(run_root))
        if mirror is not None:
            mirror.push_tree([Path(run_root) / layout.REPORT])
    except Exception as e:  # noqa: BLE001 - the report is a convenience, the run's outputs are what matter
        log.warning("warning: could not write the run report: %s: %s", type(e).__name__, e)
