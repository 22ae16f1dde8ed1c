"""Attribution of the concept-bottleneck LM: exact concept terms, input attribution, the transducer to the index."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from atlas.cblm import checkpoint
from atlas.cblm.attribution import (
    Transducer,
    build_training_attribution,
    concept_attribution,
    hidden_from_embeddings,
    input_attribution,
    load_transducer,
    mean_cos,
    pooled_chunk_states,
    save_transducer,
    top_concepts,
    train_transducer,
)
from atlas.cblm.data import TokenData
from atlas.cblm.model import CBLM, ModelConfig
from atlas.core.ownership import claim

T = 16


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors on a shared 2-core machine: a second thread only waits for the first (300 transducer steps take
    ~0.5 s on one thread, 4-12 s on two under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(objective: str = "ar", seed: int = 0) -> CBLM:
    torch.manual_seed(seed)
    model = CBLM(ModelConfig(vocab_size=50, n_concepts=6, seq_len=T, d_model=16, n_head=2, n_layer=1,
                             objective=objective, block_size=4, unknown_rank=8))
    # Random init gives logits of ~1e-3; larger embeddings make the tests' tolerances meaningful.
    with torch.no_grad():
        model.tok_emb.weight.normal_(0, 1.0)
    return model.eval()


def tokens(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 50, (batch, T + 1), generator=torch.Generator().manual_seed(seed))


def gathered(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("objective", ["ar", "diffusion"])
def test_decomposition_sums_to_logit(objective):
    model = tiny_model(objective)
    seq = tokens()
    idx, targets = seq[:, :T], seq[:, 1:] if objective == "ar" else seq[:, :T]
    terms = concept_attribution(model, idx, targets)
    logits, _ = model(idx)
    assert terms["known"].shape == (2, T, 6) and terms["unknown"].shape == (2, T, 18)
    total = terms["known"].sum(-1) + terms["unknown"].sum(-1) + terms["residual"]
    torch.testing.assert_close(total, terms["logit"], atol=1e-4, rtol=0)
    torch.testing.assert_close(terms["logit"], gathered(logits, targets), atol=1e-4, rtol=0)


def test_zeroing_a_concept_removes_exactly_its_term():
    model = tiny_model()
    seq = tokens()
    idx, targets = seq[:, :T], seq[:, 1:]
    terms = concept_attribution(model, idx, targets)
    before = gathered(model(idx)[0], targets)
    for c in (0, 3):
        after = gathered(model(idx, edit=lambda k, c=c: k.index_fill(-1, torch.tensor([c]), 0.0))[0], targets)
        torch.testing.assert_close(after - before, -terms["known"][..., c], atol=1e-4, rtol=0)


def test_chunk_gamma_sums_token_terms():
    model = tiny_model()
    seq = tokens(batch=1)
    idx, targets = seq[:, :T], seq[:, 1:]
    rows = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
    terms = concept_attribution(model, idx, targets, chunk_rows=rows)
    assert terms["gamma_known"].shape == (3, 6) and terms["gamma_residual"].shape == (3,)
    for c in range(3):
        at = rows == c
        torch.testing.assert_close(terms["gamma_known"][c], terms["known"][0, at].sum(0))
        torch.testing.assert_close(terms["gamma_unknown"][c], terms["unknown"][0, at].sum(0))
        torch.testing.assert_close(terms["gamma_residual"][c], terms["residual"][0, at].sum(0))
    whole = concept_attribution(model, idx, targets)  # no chunk_rows: one chunk, the whole sequence
    torch.testing.assert_close(whole["gamma_known"][0], terms["gamma_known"].sum(0), atol=1e-5, rtol=0)
    ranked = top_concepts(terms["gamma_known"][1], names=list("abcdef"), k=3)
    assert len(ranked) == 3 and [v for _, v in ranked] == sorted((v for _, v in ranked), reverse=True)
    assert ranked[0][1] == pytest.approx(float(terms["gamma_known"][1].max()))


@pytest.mark.parametrize("objective", ["ar", "diffusion"])
def test_forward_from_embeddings_matches_model(objective):
    model = tiny_model(objective)
    idx = tokens()[:, :T]
    with torch.no_grad():
        logits = hidden_from_embeddings(model, model.tok_emb(idx)) @ model.tok_emb.weight.T
        torch.testing.assert_close(logits, model(idx)[0], atol=1e-5, rtol=0)


def test_occlusion_matches_hand_computation():
    model = tiny_model()
    idx = tokens(batch=1)[:, :T]
    position, target = 9, 7
    scores, info = input_attribution(model, idx, position, target, method="occlusion")
    with torch.no_grad():
        full = model(idx)[0][0, position, target]
        for i in (0, 4, 9, 12):
            occluded = idx.clone()
            occluded[0, i] = model.config.mask_id
            assert float(scores[i]) == pytest.approx(float(full - model(occluded)[0][0, position, target]), abs=1e-4)
    assert info["logit"] == pytest.approx(float(full), abs=1e-4)
    assert torch.all(scores[position + 1:].abs() < 1e-5)  # causal: later tokens cannot matter


@pytest.mark.parametrize("objective", ["ar", "diffusion"])
def test_integrated_gradients_are_complete(objective):
    model = tiny_model(objective)
    idx = tokens(batch=1, seed=3)[:, :T]
    scores, info = input_attribution(model, idx, position=10, target=5, method="ig", steps=64)
    gap = info["logit"] - info["baseline_logit"]
    assert scores.shape == (T,)
    assert abs(info["completeness_error"]) < 0.05 * abs(gap)
    assert float(scores.sum()) - gap == pytest.approx(info["completeness_error"], abs=1e-5)
    assert model.training is False and all(p.grad is None for p in model.parameters())


def synthetic_pairs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    states = rng.standard_normal((n, 16)).astype(np.float32)
    targets = states @ rng.standard_normal((16, 24)).astype(np.float32)
    return states, targets / np.linalg.norm(targets, axis=1, keepdims=True)


def test_transducer_learns_and_round_trips(tmp_path):
    states, targets = synthetic_pairs(600)
    untrained = Transducer(16, 24, hidden=64)
    trained = train_transducer(states[:500], targets[:500], hidden=64, steps=300, lr=3e-3)
    before, after = mean_cos(untrained, states[500:], targets[500:]), mean_cos(trained, states[500:], targets[500:])
    assert after > before + 0.3 and after > 0.8
    out = trained(torch.from_numpy(states[:5]))
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(5))
    save_transducer(tmp_path / "t", trained)
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["config.json", "transducer.safetensors"]
    loaded = load_transducer(tmp_path / "t")
    assert torch.equal(loaded(torch.from_numpy(states[:5])), out)


# --- a tiny run: token shards, embeddings.zarr and an index, for the training-data attribution path ----------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from atlas.io.embedding_store import create_store, finish, write_rows
    from atlas.models.ivfpq import build_ivfpq

    root = claim(tmp_path_factory.mktemp("run"), "run", "run directory")  # an Atlas run: cblm trains only in one
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 30, size=300)  # chunks of 5..29 tokens, many cut by window boundaries
    ids = [f"doc{i // 3}:{i % 3:05d}" for i in range(len(lengths))]
    ends = np.cumsum(lengths)
    (root / "tokens" / "_stream").mkdir(parents=True)
    rng.integers(100, 400, size=int(ends[-1])).astype("<u4").tofile(root / "tokens" / "_stream" / "part-00000.u32")
    pq.write_table(pa.table({"chunk_id": ids, "token_start": ends - lengths, "token_end": ends,
                             "concepts": [[int(c) for c in rng.choice(4, size=2, replace=False)] for _ in ids]}),
                   root / "tokens" / "part-00000.parquet")
    (root / "library").mkdir()
    (root / "library" / "config.json").write_text(json.dumps({"n_concepts": 4}))
    vectors = rng.standard_normal((len(ids), 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    path = root / "embeddings.zarr"
    create_store(path, len(ids), 32, chunk_rows=1024, attrs={"shard_offsets": [0]})
    write_rows(path, 0, 0, len(ids), {"embeddings": vectors.astype(np.float16), "chunk_id": np.asarray(ids),
                                      "doc_id": np.asarray(ids), "source_doc_id": np.asarray(ids),
                                      "data_src": np.asarray(["x"] * len(ids))})
    finish(path, 1)
    build_ivfpq(vectors, root / "index", code_bytes=8, seed=0, threads=1)
    return root


def test_pooled_states_average_each_chunk_over_windows(tiny_run):
    data = TokenData(tiny_run, T, val_fraction=0.2)
    torch.manual_seed(0)
    model = CBLM(ModelConfig(vocab_size=data.vocab_size, n_concepts=4, seq_len=T, d_model=16, n_head=2, n_layer=1,
                             unknown_rank=8)).eval()
    windows = data.train_windows[:6]
    rows, states = pooled_chunk_states(model, data, windows, batch_size=4)
    with torch.no_grad():
        ids = torch.as_tensor(windows)
        h = model.concepts(model.hidden(data.windows[ids, :T])).h_bar.reshape(-1, 16)
    where = data.chunk_rows[ids, :T].reshape(-1)
    assert list(rows) == sorted(set(where.tolist()))
    split = [r for r in rows if len(set(torch.nonzero(data.chunk_rows[ids, :T] == int(r))[:, 0].tolist())) > 1]
    assert split  # some chunk spans two windows, and is pooled over both
    for i, r in enumerate(rows):
        np.testing.assert_allclose(states[i], h[where == int(r)].mean(0).numpy(), atol=1e-5)


def test_build_training_attribution(tiny_run):
    data = TokenData(tiny_run, T, val_fraction=0.2)
    torch.manual_seed(0)
    model = CBLM(ModelConfig(vocab_size=data.vocab_size, n_concepts=4, seq_len=T, d_model=16, n_head=2, n_layer=1,
                             unknown_rank=8))
    out = tiny_run / "cblm" / "tiny"
    checkpoint.save(out, model, None, {"step": 0, "train_config": {"val_fraction": 0.2},
                                       "model_config": model.config.to_dict(), "vocab": data.vocab.tolist()})
    result = build_training_attribution(tiny_run, out, hidden=32, steps=50)
    assert result["train_chunks"] > 200 and result["val_chunks"] > 10
    assert result["train_chunks"] + result["val_chunks"] <= 300
    assert 0.0 <= result["recall_at_10"] <= 1.0 and -1.0 <= result["mean_cos_val"] <= 1.0
    assert (out / "transducer" / "transducer.safetensors").exists()
    assert load_transducer(out / "transducer").config == {"d_in": 16, "d_out": 32, "hidden": 32}


def test_tda_keeps_a_transducer_fitted_to_the_same_checkpoint_and_settings(tiny_run, capsys, monkeypatch):
    """A second `atlas cblm tda` (a second scripts/demo.sh) does not refit: the fit is keyed on a hash of the
    checkpoint, the settings and the index. Another checkpoint, other settings or --force refit it."""
    from atlas.cblm.train import TrainConfig, train
    from atlas.cli import main

    config = TrainConfig.from_overrides(str(tiny_run), ["name=tda", "seq_len=16", "d_model=16", "n_head=2",
                                                        "n_layer=1", "unknown_rank=4", "batch_size=4", "max_steps=2",
                                                        "eval_batches=1", "val_fraction=0.2"])
    train(config, log=lambda m: None)
    folder = tiny_run / "cblm" / "tda"
    command = ["cblm", "tda", str(folder), "--steps", "20"]
    assert main(command) == 0
    first = capsys.readouterr().out
    assert "already fitted" not in first and (folder / "transducer" / "fit.json").exists()
    weights = (folder / "transducer" / "transducer.safetensors").read_bytes()

    def no_fit(*args, **kwargs):
        raise AssertionError("the transducer was fitted again")

    monkeypatch.setattr("atlas.cblm.attribution.train_transducer", no_fit)
    assert main(command) == 0
    again = capsys.readouterr().out
    assert "is already fitted to this checkpoint with these settings" in again and "--force refits it" in again
    assert json.loads(again[again.index("{"):again.rindex("}") + 1]) == json.loads(first[first.index("{"):
                                                                                         first.rindex("}") + 1])
    assert (folder / "transducer" / "transducer.safetensors").read_bytes() == weights
    for changed in (["--steps", "21"], ["--steps", "20", "--force"]):  # other settings, or asked to
        with pytest.raises(AssertionError, match="fitted again"):
            main(command[:3] + changed)
    model, state = checkpoint.load(folder)  # another checkpoint in the same folder (trained on, say)
    with torch.no_grad():
        model.tok_emb.weight.add_(0.01)
    checkpoint.save(folder, model, None, state)
    with pytest.raises(AssertionError, match="fitted again"):
        main(command)
    monkeypatch.undo()
    assert main(command) == 0 and "already fitted" not in capsys.readouterr().out
    assert main(command) == 0 and "already fitted" in capsys.readouterr().out
