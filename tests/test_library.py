"""From tags to the concept library: cluster, coherence, label, dedup, artifact, evaluation."""

import json
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import write_config, write_jsonl
from fault_server import FaultServer
from test_tag_stage import openai_sections

from atlas.cli import main
from atlas.config import LibraryConfig, load_config
from atlas.core.rundir import RunDir
from atlas.io.library import inherits, inherits_sql
from atlas.models.embedder import Embedder, encode_cached, mean_pairwise_cosine
from atlas.models.kmeans import join_context
from atlas.models.labeler import make_unique
from atlas.runner import run_stages
from atlas.stages.cluster import choose_k
from atlas.stages.coherence import cohesion_score, cross_tag_cohesion, null_cohesion, strata
from atlas.stages.library import NEAR_SEARCHED

pytestmark = pytest.mark.slow  # loads the embedding model
STAGES_TO_LIBRARY = ["chunk", "tag", "vocab", "cluster", "coherence", "label", "library"]


def library_files(run_dir):
    folder = run_dir / "library"
    return {name: (folder / name).read_bytes()
            for name in ("concepts.parquet", "tag_to_concept.parquet", "near_votes.parquet", "config.json")}


@pytest.fixture(scope="module")
def labeled_docs(tmp_path_factory, demo_records):
    picked = [r for r in demo_records if r["data_src"] == "python-docs"][:6] + \
             [r for r in demo_records if r["data_src"] == "python-math-docs"][:6]
    records = [dict(r, label=r["data_src"]) for r in picked]
    return write_jsonl(tmp_path_factory.mktemp("library") / "docs.jsonl", records)


def offline_library(folder, docs):
    # 12 documents of one kind: against a null drawn from their own few hundred tags, few clusters reach the
    # paper's tag-set thresholds; lower ones keep enough concepts for the contract checks below
    library = {"ks": [8, 16, 32], "core_min": 7, "random_min": 7, "edge_min": 1}
    config = load_config(write_config(folder, docs, input={"metadata_fields": ["label"]}, library=library,
                                      tag={"batch_size": 64}))
    run_stages(config, STAGES_TO_LIBRARY, log=lambda m: None)
    return config


def test_offline_library_is_deterministic_and_keeps_its_contract(tmp_path, labeled_docs, capsys):
    config = offline_library(tmp_path, labeled_docs)
    first = library_files(tmp_path / "run")
    run_stages(config, ["vocab", "cluster", "coherence", "label", "library"], force=True, log=lambda m: None)
    assert library_files(tmp_path / "run") == first  # same seed, same library

    run = RunDir(config.run_dir)
    concepts = pq.read_table(run.output_dir("library") / "concepts.parquet").to_pylist()
    mapping = pq.read_table(run.output_dir("library") / "tag_to_concept.parquet").to_pylist()
    coherence = {r["cluster_id"]: r for r in pq.read_table(run.part_path("coherence", 0)).to_pylist()}
    sweep = json.loads((run.output_dir("clusters") / "_sweep.json").read_text())
    assert [row["k"] for row in sweep["sweep"]] == [8, 16, 32] and sweep["chosen_k"] in (8, 16, 32)
    for row in sweep["sweep"]:  # each k scored by library.sweep_seeds k-means runs; their mean decides
        seeds = row["silhouette_seeds"]
        assert len(seeds) == 3 and row["silhouette"] == pytest.approx(np.mean(seeds))
    assert concepts and [c["concept_id"] for c in concepts] == list(range(len(concepts)))
    aux = [c for c in concepts if c["domain"] != "content"]  # the auxiliary labels follow the content concepts
    assert [c["domain"] for c in aux] == ["tone"] * 80 + ["demographic"] * 38 + ["alignment"] * 8
    concepts = concepts[: len(concepts) - len(aux)]
    assert len({c["name"] for c in concepts}) == len(concepts)
    assert all(c["chunk_count"] > 0 and 0 < c["prevalence"] <= 1 and c["domain"] == "content" for c in concepts)
    assert all(1 <= len(c["name"].split()) <= 8 and c["description"].endswith(".") for c in concepts)
    kept = {cluster for cluster, row in coherence.items() if row["kept"]}
    assert {m for c in concepts for m in c["merged_from"]} == kept
    for row in coherence.values():  # the chunk test: kept clusters cover chunks closer than random ones
        assert not row["kept"] or row["chunk_cohesion"] is None or row["chunk_cohesion"] >= 0.05
        assert ("chunks=" in row["reason"]) == (row["chunk_cohesion"] is not None and row["chunk_cohesion"] < 0.05)
        cross = row["cross_tag_cohesion"]  # and so do their chunks of different tags
        assert not row["kept"] or cross is None or cross >= 0.035
        assert ("across tags=" in row["reason"]) == (cross is not None and cross < 0.035)
    # and a concept is on at least library.min_concept_chunks chunks (n_chunks: those of the tags that inherit it)
    clusters = pq.read_table(run.root / "clusters" / "part-00000.parquet").to_pydict()
    vocab_chunks = pq.read_table(run.root / "tag_vocab" / "part-00000.parquet", columns=["tag_norm", "chunk_ids"])
    chunks_of_tag = dict(zip(*vocab_chunks.to_pydict().values()))
    covered = {cluster: set() for cluster in coherence}  # through the tags that will inherit the concept
    floor, joined_floor = LibraryConfig().tag_min_similarity, LibraryConfig().joined_min_similarity
    inheriting = {tag for tag, similarity, joined in zip(clusters["tag_norm"], clusters["similarity"],
                                                         clusters["joined_similarity"])
                  if similarity >= floor or joined >= joined_floor}
    for tag, cluster in zip(clusters["tag_norm"], clusters["cluster_id"]):
        if tag in inheriting:
            covered[cluster].update(chunks_of_tag[tag])
    floor_chunks = LibraryConfig().min_concept_chunks
    assert {cluster: len(chunks) for cluster, chunks in covered.items()} == {
        cluster: row["n_chunks"] for cluster, row in coherence.items()}
    assert any(row["n_chunks"] < floor_chunks for row in coherence.values())  # the test drops some here
    for row in coherence.values():
        assert ("covered=" in row["reason"]) == (row["n_chunks"] < floor_chunks)
    # clustered with the tags' contexts, but the centroids and similarities written are the tag embeddings' own
    assert sweep["context_weight"] == LibraryConfig().context_weight > 0
    tag_vectors = np.load(run.root / "tag_vocab" / "_embeddings.npy").astype(np.float32)
    tag_vectors /= np.linalg.norm(tag_vectors, axis=1, keepdims=True)
    centroids = np.load(run.root / "clusters" / "_centroids.npy")
    assert centroids.shape[1] == tag_vectors.shape[1]
    joined = np.load(run.root / "clusters" / "_vectors.npy")  # what k-means fit, and the coherence test reads
    assert joined.shape[0] == len(tag_vectors) > 0 and joined.shape[1] > tag_vectors.shape[1]
    assert np.allclose(clusters["similarity"], (tag_vectors * centroids[clusters["cluster_id"]]).sum(axis=1),
                       atol=1e-4)
    # and each tag's cosine to its cluster's mean joined vector (the count-weighted mean, of unit length)
    joined = joined.astype(np.float32)
    joined_centroids = np.load(run.root / "clusters" / "_joined_centroids.npy")
    weighted = np.zeros_like(joined_centroids, dtype=np.float64)
    np.add.at(weighted, clusters["cluster_id"], joined * np.asarray(clusters["count"])[:, None])
    assert np.allclose(joined_centroids, weighted / np.linalg.norm(weighted, axis=1, keepdims=True).clip(1e-12),
                       atol=1e-4)
    assert np.allclose(clusters["joined_similarity"], (joined * joined_centroids[clusters["cluster_id"]]).sum(axis=1),
                       atol=1e-3)
    # a tag at its cluster's edge in both spaces inherits no concept; one near it in either does
    in_kept = [row for row in mapping if row["cluster_id"] in kept]
    assert any(row["tag_norm"] not in inheriting for row in in_kept)
    tag_similarity = dict(zip(clusters["tag_norm"], clusters["similarity"]))
    rescued = [row for row in in_kept if row["tag_norm"] in inheriting and tag_similarity[row["tag_norm"]] < floor]
    assert rescued and all(row["concept_id"] is not None for row in rescued)  # placed there by its chunks
    for row in mapping:
        assert (row["concept_id"] is None) == (row["cluster_id"] not in kept or row["tag_norm"] not in inheriting)
    # a tag's near concept: that of its nearest kept cluster of another concept, at the floor or above, in the space
    # k-means fit (numpy here)
    vocab = pq.read_table(run.root / "tag_vocab" / "part-00000.parquet", columns=["tag_norm"]).column(0).to_pylist()
    assert vocab == [row["tag_norm"] for row in mapping]
    concept_of_cluster = {m: c["concept_id"] for c in concepts for m in c["merged_from"]}
    kept_ids = sorted(concept_of_cluster)
    similarity_to_kept = joined @ joined_centroids[kept_ids].T
    for row, similarities in zip(mapping, similarity_to_kept):
        nearest = [kept_ids[j] for j in np.argsort(-similarities, kind="stable")[:NEAR_SEARCHED]]
        near = next((concept_of_cluster[c] for c, s in zip(nearest, np.sort(similarities)[::-1])
                     if s >= joined_floor and concept_of_cluster[c] != row["concept_id"]), None)
        assert row["near_concept_id"] == near
    assert any(row["near_concept_id"] is not None for row in mapping)
    # and each tag occurrence's, read in its chunk (library/near_votes.parquet; numpy here): the tag joined with its
    # chunk's embedding, ranked against its tag's nearest kept clusters; a tag without a concept votes for two
    fields = json.loads((run.root / "library" / "config.json").read_text())["fields"]
    occurrences = [(row["chunk_id"], row["tag_norm"]) for part in run.parts("tags")
                   for row in pq.read_table(part, columns=["chunk_id", "field", "tag_norm"]).to_pylist()
                   if row["field"] in fields and row["tag_norm"] in vocab]  # a tag the vocabulary left out has none
    texts = {chunk: text for part in run.parts("chunks")
             for chunk, text in zip(*pq.read_table(part, columns=["chunk_id", "chunk_text"]).to_pydict().values())}
    chunk_vectors, computed = encode_cached(Embedder(config.annotator.encoder), [texts[c] for c, _ in occurrences],
                                            run.root / "_cache" / "embeddings")
    assert computed == 0  # the library stage embedded them: the same vectors
    row_of, own = {tag: i for i, tag in enumerate(vocab)}, {row["tag_norm"]: row["concept_id"] for row in mapping}
    near_floor, expected = LibraryConfig().near_min_similarity, Counter()
    for (chunk, tag), vector in zip(occurrences, chunk_vectors):
        i = row_of[tag]
        nearest = [kept_ids[j] for j in np.argsort(-similarity_to_kept[i], kind="stable")[:NEAR_SEARCHED]]
        occurrence = join_context(tag_vectors[i:i + 1], vector[None].astype(np.float32), sweep["context_weight"])[0]
        ranked = sorted(nearest, key=lambda c: -float(occurrence @ joined_centroids[c]))
        near = [concept_of_cluster[c] for c in ranked
                if occurrence @ joined_centroids[c] >= near_floor and concept_of_cluster[c] != own[tag]]
        expected.update((chunk, c) for c in list(dict.fromkeys(near))[:1 if own[tag] is not None else 2])
    written = pq.read_table(run.root / "library" / "near_votes.parquet").to_pylist()
    assert {(row["chunk_id"], row["concept_id"]): row["votes"] for row in written} == dict(expected)
    assert any(own[tag] is None for _, tag in occurrences) and max(expected.values()) > 1
    assert (run.root / "report" / "k_sweep.png").exists() and (run.root / "report" / "concept_map.png").exists()

    capsys.readouterr()
    assert main(["eval", "library", str(run.root), "--label-field", "label", "--sample", "5"]) == 0
    summary = json.loads((run.root / "report" / "library_eval.json").read_text())
    assert summary["labels"] in (1, 2) and 0 < summary["purity"] <= 1 and 0 <= summary["nmi"] <= 1
    assert summary["near_concept_weight"] == LibraryConfig().near_concept_weight > 0
    assert summary["relevance"]["is_proxy"] and summary["relevance"]["chunks_judged"] == 5
    assert main(["inspect", str(run.root), "library", "-n", "2"]) == 0
    assert "concept 0:" in capsys.readouterr().out

    # clustered on the tag embeddings alone, no joined vectors of the fit before are left for the coherence test
    alone = config.model_copy(update={"library": config.library.model_copy(update={"context_weight": 0.0})})
    run_stages(alone, ["cluster"], force=True, log=lambda m: None)
    assert not (run.root / "clusters" / "_vectors.npy").exists()
    assert not (run.root / "clusters" / "_joined_centroids.npy").exists()
    run_stages(alone, ["coherence", "label", "library"], force=True, log=lambda m: None)
    assert not (run.root / "library" / "near_votes.parquet").exists()  # the tags' near concepts are read instead
    alone_clusters = pq.read_table(run.root / "clusters" / "part-00000.parquet").column("joined_similarity")
    assert alone_clusters.null_count == len(alone_clusters)  # one space: the tag floor alone decides
    assert json.loads((run.root / "clusters" / "_sweep.json").read_text())["context_weight"] == 0


def test_llm_engine_judges_coherence_and_names_concepts(tmp_path, labeled_docs):
    with FaultServer(mode="ok") as server:
        sections = openai_sections(server)
        library = {"k": 10, "core_min": 1, "random_min": 1, "edge_min": 1,  # whatever the fake judge says
                   "min_chunk_cohesion": 0, "min_cross_tag_cohesion": 0}
        annotator = {"epochs": 2, "judge_sample": 3}
        # the fake model tags every chunk with words of the prompt, which the context test would call generic
        config = load_config(write_config(tmp_path, labeled_docs, **sections, library=library, annotator=annotator,
                                          vocab={"min_context_specificity": 0}))
        run_stages(config, log=lambda m: None)
        prompts = [r["messages"][0]["content"] for r in server.requests]
    assert any("coherent concept" in p for p in prompts) and any("You name concepts" in p for p in prompts)
    assert any("You label short text chunks" in p for p in prompts)  # auxiliary labels from the LLM
    run = RunDir(config.run_dir)
    targets = pq.read_table(run.part_path("targets", 0)).to_pylist()
    assert targets and all(t["aux_status"] == "ok" and t["tone_global_ids"] for t in targets)
    assert (run.output_dir("annotator") / "model.safetensors").exists()
    concepts = pq.read_table(run.output_dir("library") / "concepts.parquet").to_pylist()
    assert len({c["name"] for c in concepts}) == len(concepts)


def test_small_pieces():
    from atlas.llm.offline import singular_name

    assert [singular_name(n) for n in ("huguenots", "prime numbers", "physics", "matrices", "gauss", "x")] == [
        "huguenot", "prime number", "physics", "matrix", "gauss", "x"]
    assert choose_k([{"k": 10, "silhouette": 0.2, "davies_bouldin": 2.0},
                     {"k": 20, "silhouette": 0.3, "davies_bouldin": 2.5},
                     {"k": 40, "silhouette": float("nan"), "davies_bouldin": float("nan")}]) == 20
    sweep = [{"k": 10, "silhouette": 0.300, "davies_bouldin": 2.0},
             {"k": 20, "silhouette": 0.290, "davies_bouldin": 2.5},
             {"k": 40, "silhouette": 0.280, "davies_bouldin": 2.0},
             {"k": 80, "silhouette": float("nan"), "davies_bouldin": float("nan")}]
    assert choose_k(sweep) == 10 and choose_k(sweep, 0.05) == 20 and choose_k(sweep, 0.1) == 40  # the finest as good
    # The offline coherence null: random sets of the vocabulary. A set of one direction is far above it; a set
    # drawn like the null scores about 1 + 0 (z ~ 0); one tag is trivially coherent.
    vocabulary = np.random.default_rng(1).normal(size=(500, 32))
    vocabulary /= np.linalg.norm(vocabulary, axis=1, keepdims=True)
    null = null_cohesion(vocabulary, {3, 5}, seed=0)
    same = np.tile(vocabulary[0], (5, 1))
    assert cohesion_score(same, null, 5) == 10 and cohesion_score(same[:1], null, 5) == 10
    assert cohesion_score(same[:3], null, 5) == 10  # a small coherent set is not penalized for its size
    assert cohesion_score(vocabulary[100:105], null, 5) <= 2
    mean, std = null[5]
    assert abs(mean - mean_pairwise_cosine(vocabulary[:5])) < 6 * std and std > 0
    members = np.arange(30)
    sets = strata(members, np.linspace(1, 0, 30), 10, np.random.default_rng(0))
    assert list(sets["core"]) == list(range(10)) and list(sets["edge"]) == list(range(20, 30))
    assert len(set(sets["random"])) == 10
    # across tags: tags that only look alike ("strip": wrap, reel) each have their own cohesive chunks
    chunks = np.repeat(np.eye(3), 2, axis=0)  # two chunks on each of three unrelated directions
    assert cross_tag_cohesion(chunks, [("strip",), ("strip",), ("wrap",), ("wrap",), ("reel",), ("reel",)], 0.0) == 0
    assert cross_tag_cohesion(chunks, [("river",), ("river",), ("lake", "river"), ("pond",), ("x",), ("x",)],
                              0.5) == pytest.approx((1 / 11 - 0.5) / 0.5)  # pairs sharing a tag are left out
    assert cross_tag_cohesion(chunks, [("strip",)] * 6, 0.0) is None  # one tag: nothing across tags
    assert make_unique(["python", "python", "python"], [["python", "snake"], ["python", "snake"], []]) == [
        "python", "python (snake)", "python 2"]
    # an auxiliary label's name is reserved: the content concept "children" (tree nodes) is not the demographic
    assert make_unique(["children", "parsing"], [["children", "child nodes"], []], ["children", "women"]) == [
        "children (child nodes)", "parsing"]
    # a tag inherits when either cosine reaches its floor (0.55 as words, 0.5 joined); without contexts (null), the
    # words' alone; the SQL condition the coherence and library stages count chunks with says the same (DuckDB)
    import duckdb

    library = LibraryConfig()
    cases = [(0.60, None), (0.50, None), (0.50, 0.52), (0.50, 0.45), (0.60, 0.10)]
    assert [inherits(s, j, library) for s, j in cases] == [True, False, True, False, True]
    values = ", ".join(f"({s}, {'NULL' if j is None else j})" for s, j in cases)
    rows = duckdb.sql(f"SELECT {inherits_sql(library, 'k')} FROM (VALUES {values}) k(similarity, joined_similarity)"
                      ).fetchall()
    assert [r[0] for r in rows] == [True, False, True, False, True]


def test_offline_names_are_representative_distinctive_and_valid():
    from atlas.models.labeler import example_sentence, kinds_share, offline_description, offline_name, valid_name

    assert not any(valid_name(t) for t in ("none", "nan", "console console", "42", "12.5 %", "the", "x"))
    assert all(valid_name(t) for t in ("python", "binary search", "world war ii"))
    assert not any(valid_name(t) for t in ("jean françois de", "ahmed abu", "van de"))  # cut before the surname
    assert all(valid_name(t) for t in ("de gaulle", "el salvador", "bin"))
    # tags 0-2 sit at the cluster's centre; tag 0 also lies close to another cluster, so tag 1 names it
    vectors = np.array([[1.0, 0.2, 0.0], [1.0, 0.0, 0.1], [0.8, 0.0, 0.6], [0.0, 1.0, 0.0]])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    counts = np.array([10.0, 10.0, 1.0, 5.0])
    other = np.array([[0.5, 0.85, 0.0]])
    other /= np.linalg.norm(other, axis=1, keepdims=True)
    assert offline_name(["shared", "central", "edge", "off"], counts, vectors, other) == "central"
    assert offline_name(["nan", "central", "edge", "off"], counts[[1, 1, 2, 3]], vectors[[1, 1, 2, 3]],
                        other) == "central"  # an invalid tag is never the name, however central
    # a subject heading is preferred when it scores within HEADING_BONUS of the best (1.43 against 1.51), not further
    tags = ["shared", "central", "edge", "off"]
    assert offline_name(tags, counts, vectors, other, np.array([True, False, False, False])) == "shared"
    assert offline_name(tags, counts, vectors, other, np.array([False, False, True, False])) == "central"
    # the class the other tags are kinds of names the cluster, though one member is nearer its centre
    rivers = ["mississippi river", "kemena river", "monongahela river", "river"]
    assert kinds_share(rivers, np.array([6.0, 3, 3, 3])).tolist() == [0, 0, 0, 0.8]
    assert kinds_share(["polish", "polish commonwealth"], np.array([1.0, 1])).tolist() == [0, 0]  # not its head
    vectors = np.array([[1.0, 0.0, 0.0], [0.9, 0.3, 0.0], [0.9, -0.3, 0.0], [0.9, 0.0, 0.3]])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    assert offline_name(rivers, np.array([6, 3, 3, 3]), vectors, np.array([[-1.0, 0.0, 0.0]])) == "river"
    assert offline_name(rivers[:3] + ["lake"], np.array([6, 3, 3, 3]), vectors,
                        np.array([[-1.0, 0.0, 0.0]])) == "mississippi river"  # with no class among them, the centre
    texts = ["Ships sail. The Apollo program landed astronauts on the Moon in 1969. It ended.",
             "Mail moon@nasa.gov about the Apollo program and the Moon rocks."]
    best = example_sentence(texts, ["apollo program", "moon"])
    assert best == "The Apollo program landed astronauts on the Moon in 1969."  # the e-mail line is no example
    assert example_sentence(["- Nigel Tufnel, _Spinal Tap_ and friends"], ["nerve", "neuron"]) is None
    assert example_sentence(["Honeymoons are long in the summer."], ["moon"]) is None  # whole words only
    assert example_sentence(["\\ / Repent of your evil irrational numbers .", "The decimal places of pi go on."],
                            ["decimal", "number"]) == "The decimal places of pi go on."  # ASCII art is no example
    assert example_sentence(["com/user/progressbar has an iter overhead. Each iter of the loop costs 800ns."],
                            ["iter"]) == "Each iter of the loop costs 800ns."  # a URL cut at its dots is no example
    code = ("syntax import Syntax my_code = ''' def iter_first_last(values: Iterable[T]) -> Iterable[Tuple[bool, "
            'bool, T]]: """Iterate and generate a tuple with a flag for first and last value.')
    assert example_sentence([code, "Every value has an identity and a type."], ["value"]) == (
        "Every value has an identity and a type.")  # a line of code is no example
    # a headline is not glued to the sentence after it; question-answer lines, quotes and titles are no statements
    news = ("Tesla wins patent fight\n\nTesla patented the induction motor in 1888.\n\n"
            "Q: Who patented the motor?\nA: Tesla")
    assert example_sentence([news], ["tesla", "motor"]) == "Tesla patented the induction motor in 1888."
    assert example_sentence(["Re: Tesla motor question\n\n> Tesla built the motor first.\nWho built the motor?"],
                            ["tesla", "motor"]) is None
    # a quote ends a run of prose lines, and a heading in capitals is no statement
    quoted = ("He wrote that\n|> Tesla built the motor first\n|> and sold it.\n"
              "TESLA SOLD THE MOTOR.\nWestinghouse bought it.")
    assert example_sentence([quoted], ["tesla", "motor", "westinghouse"]) == "Westinghouse bought it."
    description = offline_description("apollo program", ["apollo program", "moon landing", "nasa"], "The Apollo…")
    assert description == 'Apollo program: moon landing, nasa. As in "The Apollo…".'


def test_lcsh_headings_install_and_load(tmp_path, monkeypatch):
    """The plain headings of the wheel's CSV are installed (subdivided, inverted and qualified ones left out), and
    loading them before they are installed says how to install them."""
    import zipfile

    from atlas.models import headings

    monkeypatch.setenv("ATLAS_CACHE", str(tmp_path / "cache"))
    assert headings.load_headings("none") == []
    with pytest.raises(FileNotFoundError, match="bash scripts/get_lcsh.sh"):
        headings.load_headings("lcsh")
    with pytest.raises(ValueError, match="name_headings"):
        headings.load_headings("mesh")
    rows = ["id,scheme,subject", "sh1,LCSH,Armies", "sh2,LCSH,Art--History", 'sh3,LCSH,"Art, Modern"',
            "sh4,LCSH,Mercury (Planet)", "sh5,LCSH,Prime  ministers", "sh6,LCSH,Armies"]
    wheel = tmp_path / "invenio_subjects_lcsh-1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(headings.LCSH_CSV, "\n".join(rows) + "\n")
    assert headings.install_lcsh(wheel) == headings.lcsh_file()
    assert headings.load_headings("lcsh") == ["armies", "prime ministers"]
    with zipfile.ZipFile(tmp_path / "other.whl", "w") as zf:
        zf.writestr("other/file.csv", "")
    with pytest.raises(RuntimeError, match="no invenio_subjects_lcsh"):
        headings.install_lcsh(tmp_path / "other.whl")
