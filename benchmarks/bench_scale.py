"""How the global stages scale: seconds and peak RSS of each at growing corpus sizes, each in a fresh process.

    python benchmarks/bench_scale.py --source runs/dev [--sizes 10000,100000,1000000] [--tag-rows 20000000]
                                     [--stages vocab,cluster,...] [--memory-gb 4] [--k 500] [--workdir /tmp]
                                     [--json PATH]

For each size N (chunks) a run directory is written in the run layout (chunk, tag and annotate parts, a manifest),
with realistic inputs where a model would run (on 2 CPU cores the encoder would dominate everything; its time is
linear by construction and bench_corpus measures it per chunk):

- chunks: sentences of the source run's chunks recombined, about as long as its chunks, under new ids (ten
  chunks a document), in parts of 50,000;
- tags: per chunk as many as a source chunk has (drawn from its distribution), in its fields' proportions; each a
  rank drawn from a Zipf-Mandelbrot law P(r) ~ (r + q)^-1.34 over an unbounded vocabulary (the source's topic tags
  by frequency, then two-tag compounds), so the vocabulary grows as real ones do (Heaps' exponent 1 / 1.34 = 0.75:
  the dev run's 3.8k unique of 8k tags and the paper's 14M unique of 500M tags lie on that line); q is set so the
  top tag's share is the source's; 10% of the spellings are capitalized (variants);
- embeddings: every stage's encoder is replaced by ``SyntheticEmbedder``: a text's vector is one of 64 cluster
  centres, chosen by its first word, plus noise chosen by the whole text, L2-normalized (tags that share a head
  word cluster together);
- annotated parts (for export): each chunk carries 1-8 concepts drawn from a Zipf law over the library.

Then the production code of each global stage (``Stage.setup`` and ``run_shard``; ``export_release`` for export)
runs in a fresh subprocess, in pipeline order, each on the previous one's output, and reports its seconds and peak
RSS (``ru_maxrss``: the whole process, imports included). The config is the default one with ``library.k`` fixed
(``--k``; the default k-sweep grows k with the vocabulary, as the paper's fixed k = 80,000 does not) and
``execution.memory_gb`` = ``--memory-gb``. ``--tag-rows`` adds a vocab run on that many tag rows (tags only).

The table gives, for the two largest sizes, each stage's time growth (goal: at most 1.2x the size ratio) and RSS
ratio (goal: at most 1.5), and the 20M-row vocab peak against the memory setting. ``--json`` rows: time growth and
RSS ratio per stage (atlas = the larger size, baseline = the smaller), and the tag-row run's peak (baseline: the
memory setting). ``--atlas PATH`` measures the atlas package found in PATH (e.g. an older checkout).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
if "--atlas" in sys.argv:  # measure another checkout's atlas package: it must win over the installed one
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--atlas") + 1]).resolve()))
else:
    sys.path.insert(0, str(HERE.parent))

from _results import add_json_option, row, write_json  # noqa: E402

STAGES = ["vocab", "cluster", "coherence", "label", "library", "targets", "export"]
PART_CHUNKS = 50_000  # chunks per part
CHUNKS_PER_DOC = 10
ZIPF_A = 1.34  # tag ranks: P(r) ~ (r + q)^-a (Heaps' exponent 1 / a)
CAPITALIZED = 0.1  # share of tag rows spelled with a capital (a variant of the same tag_norm)
DIM, CENTRES, NOISE_TABLE = 384, 64, 4096


class SyntheticEmbedder:
    """Stands in for the sentence encoder: one of ``CENTRES`` cluster centres (by the text's first word) plus noise
    (by the whole text), L2-normalized. Deterministic, and a few microseconds a text."""

    model_name = "synthetic-bench-scale"
    dim = DIM

    def __init__(self):
        rng = np.random.default_rng(12345)
        self.centres = rng.standard_normal((CENTRES, DIM)).astype(np.float32)
        self.noise = (0.8 * rng.standard_normal((NOISE_TABLE, DIM))).astype(np.float32)

    def setup(self) -> SyntheticEmbedder:
        return self

    def encode(self, texts: list[str]) -> np.ndarray:
        head = np.array([zlib.crc32(t.split(" ", 1)[0].lower().encode()) % CENTRES for t in texts], dtype=np.int64)
        whole = np.array([zlib.crc32(t.encode()) % NOISE_TABLE for t in texts], dtype=np.int64)
        vectors = self.centres[head] + self.noise[whole]
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


# --- the synthetic run --------------------------------------------------------------------------------------------


class Source:
    """What the synthetic corpus is drawn from: a run's sentences, tags per chunk, fields and tag frequencies."""

    def __init__(self, run: Path):
        chunks = pq.read_table(run / "chunks", columns=["chunk_text"]).column(0).to_pylist()
        self.chunk_chars = float(np.mean([len(t) for t in chunks]))
        sentences = [s.strip() for t in chunks for s in re.split(r"(?<=[.!?])\s+|\n+", t) if len(s.strip()) > 20]
        self.sentences = sentences[:50_000]
        self.sentence_chars = float(np.mean([len(s) for s in self.sentences]))
        tags = pq.read_table(run / "tags", columns=["chunk_id", "field", "tag_norm"])
        self.per_chunk = np.unique(tags.column("chunk_id").to_numpy(zero_copy_only=False), return_counts=True)[1]
        fields, counts = np.unique(tags.column("field").to_numpy(zero_copy_only=False), return_counts=True)
        self.fields, self.field_p = fields.tolist(), counts / counts.sum()
        names, counts = np.unique(tags.column("tag_norm").to_numpy(zero_copy_only=False), return_counts=True)
        order = np.lexsort((names, -counts))
        self.tags = names[order].tolist()
        top_share = counts[order[0]] / counts.sum()
        # q such that P(rank 1) is the source's top share, for P(r) ~ (r + q)^-a (continuous approximation)
        qs = np.linspace(0, 200, 4001)
        p1 = (1 + qs) ** -ZIPF_A / ((qs + 0.5) ** (1 - ZIPF_A) / (ZIPF_A - 1))
        self.q = float(qs[np.argmin(np.abs(p1 - top_share))])

    def tag_names(self, ranks: np.ndarray) -> list[str]:
        """Rank 1.. -> a tag: the source's tags by frequency, then two-tag compounds (unique, as ranks are)."""
        v = len(self.tags)
        out = []
        for r in ranks.tolist():
            if r <= v:
                out.append(self.tags[r - 1])
            else:
                a, b = divmod(r - v - 1, v)
                out.append(f"{self.tags[a % v]} {self.tags[b]}")
        return out


def write_tags(source: Source, run: Path, n_chunks: int, chunk_ids, rng: np.random.Generator) -> int:
    """Tag parts for ``n_chunks`` chunks (ids from ``chunk_ids(start, stop)``), part by part; returns the rows."""
    schema = pa.schema([("chunk_id", pa.string()), ("field", pa.string()), ("tag", pa.string()),
                        ("tag_norm", pa.string()), ("rank", pa.int16())])
    rows = 0
    for shard, start in enumerate(range(0, n_chunks, PART_CHUNKS)):
        stop = min(start + PART_CHUNKS, n_chunks)
        per_chunk = rng.choice(source.per_chunk, stop - start)
        owner = np.repeat(np.arange(stop - start), per_chunk)
        u = 1 - rng.random(len(owner))  # in (0, 1]
        ranks = np.clip(np.round((source.q + 0.5) * u ** (-1 / (ZIPF_A - 1)) - source.q), 1, 1e12).astype(np.int64)
        unique, inverse = np.unique(ranks, return_inverse=True)
        names = pa.array(source.tag_names(unique)).take(pa.array(inverse))
        capital = pa.array([n[:1].upper() + n[1:] for n in source.tag_names(unique)]).take(pa.array(inverse))
        tag = pa.array(np.where(rng.random(len(owner)) < CAPITALIZED, capital.to_numpy(zero_copy_only=False),
                                names.to_numpy(zero_copy_only=False)))
        fields = pa.array(source.fields).take(pa.array(rng.choice(len(source.fields), len(owner), p=source.field_p)))
        table = pa.table([pa.array(chunk_ids(start, stop)).take(pa.array(owner)), fields, tag, names,
                          pa.array(np.zeros(len(owner), np.int16))], schema=schema)
        path = run / "tags" / f"part-{shard:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, compression="zstd")
        rows += len(owner)
    return rows


def write_chunks(source: Source, run: Path, n_chunks: int, rng: np.random.Generator) -> None:
    schema = pa.schema([("chunk_id", pa.string()), ("doc_id", pa.string()), ("source_doc_id", pa.string()),
                        ("data_src", pa.string()), ("domain", pa.string()), ("chunk_text", pa.string()),
                        ("n_tokens", pa.int32()), ("char_start", pa.int64()), ("char_end", pa.int64()),
                        ("doc_end_flag", pa.bool_()), ("metadata", pa.string())])
    per_chunk = max(1, round(source.chunk_chars / (source.sentence_chars + 1)))
    sentences = np.array(source.sentences, dtype=object)
    for shard, start in enumerate(range(0, n_chunks, PART_CHUNKS)):
        stop = min(start + PART_CHUNKS, n_chunks)
        picks = rng.integers(0, len(sentences), (stop - start, per_chunk))
        texts = [" ".join(row) for row in sentences[picks]]
        ids = np.arange(start, stop)
        docs = [f"synthetic-{i // CHUNKS_PER_DOC:07d}" for i in ids]
        table = pa.table([chunk_ids_of(start, stop), docs, docs, ["synthetic"] * len(ids), ["web"] * len(ids),
                          texts, np.array([len(t) // 4 for t in texts], np.int32), np.zeros(len(ids), np.int64),
                          np.array([len(t) for t in texts], np.int64), (ids % CHUNKS_PER_DOC) == CHUNKS_PER_DOC - 1,
                          ["{}"] * len(ids)], schema=schema)
        path = run / "chunks" / f"part-{shard:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, compression="zstd")


def chunk_ids_of(start: int, stop: int) -> list[str]:
    return [f"synthetic-{i // CHUNKS_PER_DOC:07d}:{i % CHUNKS_PER_DOC:05d}" for i in range(start, stop)]


def write_annotated(run: Path, n_chunks: int, n_concepts: int, rng: np.random.Generator) -> None:
    """Annotated parts for export: each chunk carries 1-8 concepts (Zipf over the library), best first."""
    for shard, start in enumerate(range(0, n_chunks, PART_CHUNKS)):
        stop = min(start + PART_CHUNKS, n_chunks)
        counts = rng.integers(1, 9, stop - start)
        ids = np.minimum(rng.zipf(1.5, counts.sum()) - 1, n_concepts - 1)
        lists = pa.ListArray.from_arrays(pa.array(np.append(0, np.cumsum(counts)).astype(np.int32)), pa.array(ids))
        scores = pa.ListArray.from_arrays(lists.offsets, pa.array(rng.random(counts.sum()).astype(np.float32)))
        table = pa.table({"chunk_id": chunk_ids_of(start, stop), "concepts": lists, "concept_scores": scores})
        path = run / "annotated" / f"part-{shard:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, compression="zstd")


def make_run(source: Source, folder: Path, n_chunks: int, args, tags_only: bool = False) -> dict:
    """A run directory of ``n_chunks`` synthetic chunks (or their tags alone), with its manifest."""
    from atlas.config import config_from_dict
    from atlas.core.rundir import RunDir

    rng = np.random.default_rng(n_chunks)
    if not tags_only:
        write_chunks(source, folder, n_chunks, rng)
    tag_rows = write_tags(source, folder, n_chunks, chunk_ids_of, rng)
    shards = -(-n_chunks // PART_CHUNKS)
    settings = {"name": f"bench-scale-{n_chunks}", "run_dir": str(folder), "llm": {"engine": "offline"},
                "library": {"k": args.k}, "execution": {"progress": False}}
    config = config_from_dict(settings)
    if "memory_gb" in type(config.execution).model_fields:  # an older checkout has no such setting
        config = config_from_dict(settings | {"execution": {"progress": False, "memory_gb": args.memory_gb}})
    stages = {name: {"output": output, "num_shards": shards, "hash": "bench", "status": "done"}
              for name, output in (("chunk", "chunks"), ("tag", "tags"), ("annotate", "annotated"))}
    run = RunDir(folder)
    run.write_manifest({"name": settings["name"], "config": config.model_dump(), "stages": stages})
    run.mark_stage_done("annotated", "bench")
    return {"chunks": n_chunks, "tag_rows": tag_rows}


# --- one stage in a fresh process ---------------------------------------------------------------------------------


def worker(stage_name: str, run_dir: str) -> None:
    """Child process: run one global stage's production code on the run and print its seconds and peak RSS."""
    from atlas.config import config_from_dict
    from atlas.core.rundir import RunDir

    run = RunDir(run_dir)
    config = config_from_dict(run.read_manifest()["config"])
    start = time.perf_counter()
    if stage_name == "export":
        from atlas.tools.export import export_release

        export_release(run.root, run.root.parent / f"{run.root.name}-export")
    else:
        from atlas.stages import STAGES as ALL

        stage = ALL[stage_name](config)
        stage.setup()
        for encoder in ("embedder", "chunk_encoder"):  # vocab encodes chunks with a second one (its context check)
            if hasattr(stage, encoder):
                setattr(stage, encoder, SyntheticEmbedder())
        stats = stage.run_shard(run, 0)
        run.mark_shard_done(stage.output, 0, "bench", stats.to_dict(), time.perf_counter() - start)
        run.mark_stage_done(stage.output, "bench")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"stage": stage_name, "seconds": round(seconds, 2), "peak_rss_mib": round(peak, 1)}))


def run_stage(stage: str, run: Path, atlas: str | None) -> dict:
    command = [sys.executable, __file__, "--worker", stage, "--run", str(run)] + (["--atlas", atlas] if atlas else [])
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{stage} failed on {run}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def library_size(run: Path) -> int:
    return pq.read_metadata(run / "library" / "concepts.parquet").num_rows


# --- main -----------------------------------------------------------------------------------------------------------


def print_table(results: dict[int, dict], stages: list[str], sizes: list[int]) -> None:
    head = f"{'stage':<12}" + "".join(f"{f'{n:,} chunks':>22}" for n in sizes)
    if len(sizes) > 1:
        head += f"{'time growth':>14}{'RSS ratio':>11}"
    print(head)
    print(f"{'':<12}" + "".join(f"{'s':>10}{'peak MiB':>12}" for _ in sizes))
    for stage in stages:
        line = f"{stage:<12}"
        for n in sizes:
            r = results[n].get(stage)
            line += f"{r['seconds']:>10.1f}{r['peak_rss_mib']:>12,.0f}" if r else f"{'-':>10}{'-':>12}"
        if len(sizes) > 1 and all(stage in results[n] for n in sizes[-2:]):
            small, big = results[sizes[-2]][stage], results[sizes[-1]][stage]
            line += f"{big['seconds'] / max(small['seconds'], 1e-3):>13.1f}x"
            line += f"{big['peak_rss_mib'] / small['peak_rss_mib']:>10.2f}x"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="runs/dev", help="a run with chunks and tags to draw the corpus from")
    parser.add_argument("--sizes", default="10000,100000,1000000", help="corpus sizes in chunks")
    parser.add_argument("--tag-rows", type=int, default=0, help="also run vocab on this many tag rows (0: no)")
    parser.add_argument("--stages", default=",".join(STAGES), help="global stages to measure, in pipeline order "
                        "(train_annotator too: it reads the targets' reservoir, bound it with --reservoir)")
    parser.add_argument("--memory-gb", type=float, default=4.0, help="execution.memory_gb")
    parser.add_argument("--k", type=int, default=500, help="library.k (fixed, as the paper's k)")
    parser.add_argument("--reservoir", type=int, default=None, help="annotator.reservoir_size (default: all)")
    parser.add_argument("--workdir", default=None, help="where the synthetic runs are written (removed after)")
    parser.add_argument("--atlas", default=None, help="a folder holding another atlas package to measure")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.run)
        return
    source_dir = Path(args.source)
    if not (source_dir / "tags").is_dir() or not (source_dir / "chunks").is_dir():
        raise SystemExit(f"{source_dir}: no chunks/ and tags/ to draw from; run `atlas run configs/dev.yaml` first")
    source = Source(source_dir)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    stages = [s for s in args.stages.split(",") if s]
    print(f"source {source_dir}: {len(source.sentences):,} sentences, {len(source.tags):,} tags "
          f"(Zipf-Mandelbrot a = {ZIPF_A}, q = {source.q:.1f}), {source.per_chunk.mean():.1f} tags a chunk")
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench-scale-") as tmp:
        for n in sizes:
            folder = Path(tmp) / f"run-{n}"
            start = time.perf_counter()
            made = make_run(source, folder, n, args)
            if args.reservoir:
                set_config(folder, {"annotator": {"reservoir_size": args.reservoir}})
            print(f"\n{n:,} chunks, {made['tag_rows']:,} tag rows (written in {time.perf_counter() - start:.0f} s)")
            results[n] = {}
            for stage in stages:
                if stage == "export":
                    write_annotated(folder, n, library_size(folder), np.random.default_rng(n + 1))
                results[n][stage] = r = run_stage(stage, folder, args.atlas)
                print(f"  {stage:<16} {r['seconds']:>9.1f} s {r['peak_rss_mib']:>9,.0f} MiB", flush=True)
            shutil.rmtree(folder)
            shutil.rmtree(folder.parent / f"{folder.name}-export", ignore_errors=True)
        tag_run = None
        if args.tag_rows:
            n = round(args.tag_rows / source.per_chunk.mean())
            folder = Path(tmp) / "tag-rows"
            made = make_run(source, folder, n, args, tags_only=True)
            print(f"\nvocab on {made['tag_rows']:,} tag rows ({n:,} chunks' worth)")
            tag_run = made | run_stage("vocab", folder, args.atlas)
            print(f"  vocab {tag_run['seconds']:.1f} s, {tag_run['peak_rss_mib']:,.0f} MiB "
                  f"(memory setting {args.memory_gb * 1024:,.0f} MiB)")

    print(f"\nglobal stages, seconds and peak RSS of a fresh process (execution.memory_gb = {args.memory_gb})")
    print_table(results, stages, sizes)
    rows = []
    if len(sizes) > 1:
        small, big = sizes[-2], sizes[-1]
        for stage in stages:
            a, b = results[small][stage], results[big][stage]
            rows.append(row("scale", f"{stage} seconds, {small:,} -> {big:,} chunks", b["seconds"], a["seconds"], "s",
                            f"same at {small:,}", better="lower",
                            note=f"time growth, goal <= {1.2 * big / small:.0f}x"))
            rows.append(row("scale", f"{stage} peak RSS, {small:,} -> {big:,} chunks", b["peak_rss_mib"],
                            a["peak_rss_mib"], "MiB", f"same at {small:,}", better="lower", note="goal <= 1.5x"))
    if tag_run:
        rows.append(row("scale", f"vocab peak RSS, {tag_run['tag_rows']:,} tag rows", tag_run["peak_rss_mib"],
                        args.memory_gb * 1024, "MiB", "execution.memory_gb", better="lower",
                        note=f"{tag_run['seconds']:.0f} s; goal <= 1"))
    write_json(args.json, rows)


def set_config(folder: Path, changes: dict) -> None:
    """Change the run's config (in its manifest) before a stage reads it."""
    from atlas.config import config_from_dict
    from atlas.core.rundir import RunDir

    run = RunDir(folder)
    manifest = run.read_manifest()
    config = manifest["config"]
    for section, values in changes.items():
        config[section] = config[section] | values
    manifest["config"] = config_from_dict(config).model_dump()
    run.write_manifest(manifest)


if __name__ == "__main__":
    main()
