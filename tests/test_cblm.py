"""The concept-bottleneck LM: model shapes and masks, losses on hand-built inputs, data windows, schedules, exact
resume, generation and steering, and the CLI on a tiny run written the way the tokenize stage writes one."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from atlas.cblm import checkpoint
from atlas.cblm.data import SteeringData, TokenData
from atlas.cblm.generate import Codec, generate, steering_for
from atlas.cblm.losses import (
    chunk_probabilities,
    compute,
    compute_steering,
    concept_loss,
    express_loss,
    independence_loss,
    known_readout_loss,
    lm_loss,
    mask_blocks,
    reconstruction_loss,
    respond_loss,
)
from atlas.cblm.model import CBLM, ModelConfig, Steering, block_causal_mask, injection_layer, steering_directions
from atlas.cblm.train import (
    TrainConfig,
    alphas_at,
    changed_settings,
    in_steering_phase,
    lr_at,
    steering_phases,
    train,
)
from atlas.core.ownership import claim
from atlas.io.tokens import INDEX_SCHEMA
from atlas.models.tokenizer import BOS, EOC, MASK, cl100k
from atlas.stages.tokenize import chunk_stream

N_CONCEPTS = 6
TINY = ["d_model=16", "n_head=2", "n_layer=1", "seq_len=16", "batch_size=4", "unknown_rank=4", "eval_batches=2",
        "log_every=1000"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(objective: str = "ar", n_concepts: int = N_CONCEPTS, seed: int = 0) -> CBLM:
    torch.manual_seed(seed)
    return CBLM(ModelConfig(vocab_size=50, n_concepts=n_concepts, seq_len=16, d_model=16, n_head=2, n_layer=2,
                            objective=objective, block_size=4, mask_id=49, unknown_rank=4)).eval()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Two token shards of 30 short chunks each, each chunk with 1-2 of 6 concepts, and a library config."""
    root = claim(tmp_path_factory.mktemp("cblm_run"), "run", "run directory")  # an Atlas run: cblm trains only in one
    (root / "library").mkdir()
    (root / "library" / "config.json").write_text(json.dumps({"n_concepts": N_CONCEPTS}))
    names = ["triangles", "python code", "rivers", "music", "tone: formal", "tone: casual"]
    pq.write_table(pa.table({"concept_id": list(range(N_CONCEPTS)), "name": names}),
                   root / "library" / "concepts.parquet")
    topics = ["The triangle has three sides and three angles.", "def add(a, b): return a + b",
              "The river flows to the sea past the old mill.", "The song has a slow tempo and a minor key."]
    encoding = cl100k()
    (root / "tokens" / "_stream").mkdir(parents=True)
    for shard in range(2):
        texts, concepts, ends = [], [], []
        for i in range(30):
            topic = (i + shard) % 4
            texts.append(f"{topics[topic]} Example {i} of shard {shard}.")
            concepts.append([topic, 4 + i % 2])
            ends.append(i % 3 == 2)
        tokens = encoding.encode_ordinary_batch(texts)
        stream, spans = chunk_stream(tokens, ends)
        stream.astype("<u4").tofile(root / "tokens" / "_stream" / f"part-{shard:05d}.u32")
        pq.write_table(pa.table({
            "chunk_id": [f"d{shard}:{i:05d}" for i in range(30)], "doc_id": [f"d{shard}:{i // 3}" for i in range(30)],
            "token_start": spans[:, 0], "token_end": spans[:, 1], "n_tokens": [len(t) for t in tokens],
            "doc_end_flag": ends, "concepts": concepts}, schema=INDEX_SCHEMA),
            root / "tokens" / f"part-{shard:05d}.parquet")
    return root


# --- model -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("objective", ["ar", "diffusion"])
def test_shapes_and_parameter_count(objective):
    model = tiny_model(objective)
    idx = torch.randint(0, 50, (3, 16))
    logits, parts = model(idx)
    n, m, d, r = N_CONCEPTS, 3 * N_CONCEPTS, 16, 4
    assert logits.shape == (3, 16, 50)
    assert parts.k.shape == (3, 16, n) and parts.u.shape == (3, 16, m)
    assert parts.k_hat.shape == parts.u_hat.shape == parts.eps.shape == parts.h_bar.shape == (3, 16, d)
    # at inference h_bar is exactly h: the bottleneck only splits it
    assert torch.allclose(parts.h_bar, parts.h, atol=1e-6)
    # known head + K, unknown down/up + A B (paper: 2dn + 2Rm + 2dR, plus the two heads' biases)
    assert model.num_params()["concept_module"] == 2 * d * n + 2 * r * m + 2 * d * r + n + m
    baseline = tiny_model(objective, n_concepts=0)
    assert baseline(idx)[1] is None and baseline.num_params()["concept_module"] == 0


def test_block_causal_mask_by_hand():
    expected = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(block_causal_mask(5, 2), expected.bool())


@pytest.mark.parametrize("objective", ["ar", "diffusion"])
def test_attention_sees_what_the_objective_allows(objective):
    """AR: a later token never changes earlier logits. Diffusion (blocks of 4): a token changes the logits of every
    position in its own block and later blocks, and of no earlier block."""
    model = tiny_model(objective)
    idx = torch.randint(0, 49, (1, 16))
    changed = idx.clone()
    changed[0, 9] = (idx[0, 9] + 1) % 49
    diff = (model(idx)[0] - model(changed)[0]).abs().amax(-1)[0]
    moved = (diff > 1e-6).nonzero()[:, 0].tolist()
    if objective == "ar":
        assert moved == list(range(9, 16))
    else:
        assert moved == list(range(8, 16))


def test_teacher_forcing_and_dropout_only_while_training():
    model = tiny_model()
    idx = torch.randint(0, 50, (2, 16))
    target = torch.zeros(2, 16, N_CONCEPTS)
    target[..., 2] = 1
    model.train()
    parts = model.concepts(model.hidden(idx), target, alpha_known=1.0, alpha_unknown=1.0)
    true_k_hat = model.concepts.known_emb[2].expand(2, 16, -1)
    assert torch.allclose(parts.k_hat_target, true_k_hat)
    assert torch.allclose(parts.eps, torch.zeros_like(parts.eps), atol=1e-6)  # both parts forced: nothing left over
    model.eval()
    parts = model.concepts(model.hidden(idx), target, alpha_known=1.0, alpha_unknown=1.0)
    assert torch.allclose(parts.h_bar, parts.h, atol=1e-6) and parts.u_hat_aux is None


# --- losses ----------------------------------------------------------------------------------------------------------

def test_concept_loss_or_aggregation_by_hand():
    # one chunk of two tokens, two concepts; the chunk has concept 0 only
    logits = torch.tensor([[[0.0, -1.0], [1.0, -2.0]]])
    k = torch.sigmoid(logits[0])
    p = 1 - (1 - k[0]) * (1 - k[1])
    labels = torch.tensor([[1.0, 0.0]])
    rows = torch.zeros(1, 2, dtype=torch.int64)
    assert torch.allclose(chunk_probabilities(logits, rows, 1)[0], p)
    expected = (-torch.log(p[0]) - torch.log(1 - p[1])) / 2
    assert torch.allclose(concept_loss(logits, rows, labels), expected, atol=1e-6)
    # two chunks: each aggregates only its own tokens
    rows = torch.tensor([[0, 1]])
    per_chunk = chunk_probabilities(logits, rows, 2)
    assert torch.allclose(per_chunk, k, atol=1e-6)


def test_concept_loss_token_aggregation_by_hand():
    # chunk 0 = tokens 0, 1 (concept 0); chunk 1 = token 2 (concept 1); one BCE per token, mean per chunk, then mean
    logits = torch.tensor([[[0.0, -1.0], [1.0, -2.0], [3.0, 0.5]]])
    rows = torch.tensor([[0, 0, 1]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    k = torch.sigmoid(logits[0])

    def bce(p, y):
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p))

    chunk_0 = (bce(k[0], labels[0]) + bce(k[1], labels[0])) / 2
    chunk_1 = bce(k[2], labels[1])
    expected = torch.stack([chunk_0, chunk_1]).mean(0)  # [n]
    assert torch.allclose(concept_loss(logits, rows, labels, per_concept=True, aggregation="token"), expected,
                          atol=1e-6)
    assert torch.allclose(chunk_probabilities(logits, rows, 2, aggregation="token"),
                          torch.stack([(k[0] + k[1]) / 2, k[2]]), atol=1e-6)


def test_known_readout_loss_by_hand():
    # two chunks over a 3-token vocabulary; chunk 0 has concept 0, chunk 1 none (it is not scored)
    known_emb = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    token_emb = torch.tensor([[1.0, 1.0], [0.0, 1.0], [2.0, 0.0]], requires_grad=True)
    labels = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    log_unigram = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    target_rows = torch.tensor([[0, 0, 1]])
    targets = torch.tensor([[2, 0, 1]])
    logits = log_unigram + torch.tensor([1.0, 0.0, 2.0])  # W K_0
    nll = -torch.log_softmax(logits, -1)
    expected = (nll[2] + nll[0]) / 2
    loss = known_readout_loss(known_emb, token_emb, labels, target_rows, targets, log_unigram)
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.backward()  # it trains the concept embeddings and the token embeddings, and only concept 0's row of K
    assert known_emb.grad[0].abs().sum() > 0 and known_emb.grad[1].abs().sum() == 0
    assert token_emb.grad.abs().sum() > 0


def test_lm_reconstruction_and_independence_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    targets = torch.tensor([[0, 2]])
    assert torch.allclose(lm_loss(logits, targets), -(np.log(0.5) + np.log(0.8)) / 2 * torch.ones(()))
    assert torch.allclose(lm_loss(logits, targets, torch.tensor([[False, True]])), -np.log(0.8) * torch.ones(()))

    u_hat, h, k_gt = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[3.0, 1.0]]]), torch.tensor([[[1.0, 0.0]]])
    assert torch.allclose(reconstruction_loss(u_hat, h, k_gt), torch.tensor((1.0 - 2) ** 2 + (2 - 1) ** 2))

    other = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0]])
    known = torch.tensor([[0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
    psi, phi = other - other.mean(0), known - known.mean(0)
    expected = (psi.T @ phi).pow(2).sum() / (2 * 2 * 2)
    assert torch.allclose(independence_loss(other, known), expected)
    assert independence_loss(other, other * 0 + 1) == 0  # a constant stack has no covariance


def test_reconstruction_and_independence_reach_only_the_unknown_head():
    model = tiny_model()
    model.train()
    batch_tokens = torch.randint(0, 49, (2, 17))

    class Batch:
        tokens = batch_tokens
        chunk_rows = torch.zeros(2, 17, dtype=torch.int64)
        labels = torch.tensor([[1.0, 0, 0, 0, 1, 0]])

    _, losses, _ = compute(model, Batch())
    (losses["rec"] + losses["indep"]).backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all(name.startswith("concepts.unknown") for name in with_grad), with_grad


def test_steering_losses_by_hand():
    # three positions, two concepts; position 0 is not injected, 1 is attributed to concept 0, 2 to concept 1
    concept_at = torch.tensor([[-1, 0, 1]])
    known_logits = torch.tensor([[[0.0, 0.0], [2.0, -1.0], [0.5, -3.0]]])
    expected = (np.log1p(np.exp(-2.0)) + np.log1p(np.exp(3.0))) / 2  # -log sigmoid(2), -log sigmoid(-3)
    assert float(respond_loss(known_logits, concept_at)) == pytest.approx(expected, rel=1e-6)

    logits = torch.tensor([[[9.0, 9.0, 9.0, 9.0], [1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 3.0, 1.0]]])
    lifted_ids = torch.tensor([[0, 1], [2, -1]])  # T_0 = {0, 1}; T_1 = {2} (padded)
    e = np.e
    mass_1 = (e + e ** 2) / (e + e ** 2 + 2)
    mass_2 = e ** 3 / (1 + 1 + e ** 3 + e)
    expected = -(np.log(mass_1) + np.log(mass_2)) / 2
    assert float(express_loss(logits, concept_at, lifted_ids)) == pytest.approx(expected, rel=1e-6)
    # no injected position: zero, and still part of the graph
    none = torch.full_like(concept_at, -1)
    assert float(respond_loss(known_logits, none)) == 0 and float(express_loss(logits, none, lifted_ids)) == 0


def test_token_level_steering_data_attributes_lifted_tokens_of_the_chunks_concepts(tiny_run):
    data = TokenData(tiny_run, seq_len=16)
    steering = SteeringData(data, top=16, min_support=2)  # a topic sentence's tokens share the top lift
    assert steering.lifted_ids.shape == (N_CONCEPTS, 16) and steering.supported == N_CONCEPTS
    # " river" is lifted for "rivers" (2) and never for "triangles" (0)
    river = data.model_id(cl100k().encode_ordinary(" river")[0])
    assert river in steering.lifted_ids[2].tolist() and river not in steering.lifted_ids[0].tolist()
    tokens = torch.tensor([[river, river, river]])
    labels = torch.zeros(1, 3, N_CONCEPTS)
    labels[0, 0, 2] = 1  # a "rivers" chunk
    labels[0, 1, 0] = 1  # a "triangles" chunk
    assert steering.concepts_at(tokens, labels).tolist() == [[2, -1, -1]]


def test_steering_step_injects_only_attributed_positions_and_trains_k(tiny_run):
    data = TokenData(tiny_run, seq_len=16)
    steering = SteeringData(data, top=5, min_support=2)
    torch.manual_seed(0)
    model = CBLM(TrainConfig.from_overrides(str(tiny_run), TINY).model_config(data)).train()
    batch = data.batch(data.train_windows[:4])
    total, losses, concept_at = compute_steering(model, batch, steering, tau=4.0)
    assert (concept_at >= 0).any() and (concept_at < 0).any()
    assert set(losses) == {"lm", "respond", "express"}
    total.backward()
    assert model.concepts.known_emb.grad.abs().sum() > 0  # the injected vector is made of K
    assert model.concepts.known_head.weight.grad.abs().sum() > 0  # L_respond reaches the known head
    # positions not attributed to a concept read exactly what they read without steering (AR: only later positions
    # could see an injection, and the first injected position is the first that changes)
    model.eval()
    first = int((concept_at[0] >= 0).nonzero()[0, 0])
    injected, _, peak = steering_directions(model)
    c = concept_at[0].clamp_min(0)
    vectors = (4.0 / peak)[c, None] * injected[c]
    steer = Steering(direction=vectors[None], gamma=1.0, layer=injection_layer(model.config),
                     positions=concept_at[:1] >= 0)
    plain, steered = model(batch.tokens[:1, :16])[0], model(batch.tokens[:1, :16], steer=steer)[0]
    assert torch.allclose(plain[0, :first], steered[0, :first])
    assert not torch.allclose(plain[0, first], steered[0, first])


def test_steering_evaluation_draws_concepts_and_scores_by_hand(tiny_run):
    from atlas.cblm.steering_eval import evaluate_steering, format_steering

    data = TokenData(tiny_run, seq_len=16)
    torch.manual_seed(0)
    model = CBLM(TrainConfig.from_overrides(str(tiny_run), TINY).model_config(data)).eval()
    settings = dict(n_concepts=3, prompts=("The", "A"), samples=1, max_new_tokens=4, lifted=5, min_chunks=2)
    result = evaluate_steering(model, data, data.vocab, strengths=(0.0, 8.0), **settings)
    assert len(result["concepts"]) == 3 and result["n_candidates"] >= 3
    assert evaluate_steering(model, data, data.vocab, strengths=(0.0,), **settings)["concepts"] == result["concepts"]
    zero, strong = result["strengths"]
    # tau = 0 changes nothing: same texts (same seeds), same frequency, perplexity ratio 1, full quality
    assert zero["steered"] == zero["unsteered"] and zero["perplexity_ratio"] == pytest.approx(1.0)
    assert zero["quality_score"] == pytest.approx(2.0)
    for s in (zero, strong):
        for r in s["per_concept"]:
            assert r["concept_score"] == pytest.approx(2 * min(1.0, r["steered"] / r["density"]))
        c, q = s["concept_score"], s["quality_score"]
        assert s["harmonic"] == pytest.approx(2 / (1 / c + 1 / q) if c > 0 and q > 0 else 0.0)
        assert s["lift_ratio"] == pytest.approx(s["steered"] / max(s["unsteered"], 1e-9))
    assert strong["per_concept"][0]["text_steered"] != strong["per_concept"][0]["text_unsteered"]
    assert "| 8 |" in format_steering(result)


def test_steering_phases_are_front_loaded_inside_the_stable_phase():
    config = TrainConfig(max_steps=1000, steering=True, steering_phases=4, steering_phase_frac=0.05,
                         alpha_warm_frac=0.1, decay_frac=0.2)
    phases = steering_phases(config)
    assert len(phases) == 4 and phases[0][0] == 100 and phases[-1][1] <= 800
    assert all(end - start == 50 for start, end in phases)
    gaps = [b[0] - a[1] for a, b in zip(phases, phases[1:])]
    assert gaps == sorted(gaps) and gaps[0] < gaps[-1]  # front-loaded
    assert in_steering_phase(100, phases) and not in_steering_phase(99, phases)
    assert steering_phases(TrainConfig(max_steps=1000, steering=False)) == []
    assert steering_phases(TrainConfig(max_steps=3, steering=True)) == []  # too short a run: no steering phase
    with pytest.raises(ValueError, match="do not fit"):
        steering_phases(TrainConfig(max_steps=100, steering=True, steering_phase_frac=0.9))


def test_per_block_masking():
    torch.manual_seed(0)
    tokens = torch.arange(4000).reshape(1, 4000) % 40
    inputs, masked = mask_blocks(tokens, 1000, mask_id=99)
    assert torch.equal(inputs[masked], torch.full_like(inputs[masked], 99))
    assert torch.equal(inputs[~masked], tokens[~masked])
    rates = masked.reshape(4, 1000).float().mean(1)
    assert all(0.02 < r < 0.98 for r in rates) and float(rates.max() - rates.min()) > 0.05  # one t per block
    # a fixed noise level masks about that share
    _, masked = mask_blocks(tokens, 1000, 99, t_min=0.3, t_max=0.3)
    assert abs(float(masked.float().mean()) - 0.3) < 0.03


# --- data ------------------------------------------------------------------------------------------------------------

def test_windows_map_back_to_the_token_stream(tiny_run):
    data = TokenData(tiny_run, seq_len=16, val_fraction=0.25)
    stream = np.fromfile(tiny_run / "tokens" / "_stream" / "part-00000.u32", dtype="<u4")
    index = pq.read_table(tiny_run / "tokens" / "part-00000.parquet").to_pydict()
    first = data.vocab[data.windows[0].numpy()]
    assert np.array_equal(first, stream[:17]) and first[0] == BOS
    assert data.vocab[data.windows[1, 0]] == stream[16]  # windows overlap by the one target token
    # every token's chunk row gives the chunk whose span holds it
    for pos in (0, 5, 16):
        row = int(data.chunk_rows[0, pos])
        assert index["token_start"][row] <= pos < index["token_end"][row]
    assert set(data.train_windows).isdisjoint(data.val_windows)
    assert len(data.train_windows) + len(data.val_windows) == len(data.windows)
    batch = data.batch(data.train_windows[:3])
    for b, window in enumerate(data.train_windows[:3]):
        for pos in (0, 8):
            row = int(data.chunk_rows[window, pos])
            expected = np.zeros(N_CONCEPTS)
            expected[data.concept_ids[data.concept_ptr[row]:data.concept_ptr[row + 1]]] = 1
            assert np.array_equal(batch.labels[batch.chunk_rows[b, pos]].numpy(), expected)
    # specials are in the compact vocabulary even when the shards lack them
    assert data.vocab[data.model_id(MASK)] == MASK and EOC in data.vocab


def test_batches_are_a_function_of_the_step(tiny_run):
    data = TokenData(tiny_run, seq_len=16)
    n = len(data.train_windows)
    steps = [data.train_batch(step, 4, seed=1) for step in range(2 * n // 4)]
    assert all(np.array_equal(a, b) for a, b in zip(steps, [data.train_batch(s, 4, 1) for s in range(len(steps))]))
    first_epoch = np.concatenate(steps)[:n]
    assert sorted(first_epoch) == sorted(data.train_windows)  # one epoch = each window once


def test_schedules():
    config = TrainConfig(max_steps=100, lr=1.0, warmup_frac=0.1, decay_frac=0.2, alpha_warm_frac=0.1)
    assert lr_at(0, config) == pytest.approx(0.1) and lr_at(50, config) == 1.0 and lr_at(90, config) == 0.5
    assert alphas_at(0, config) == (1.0, 1.0)
    assert alphas_at(50, config) == (0.5, 0.5)
    assert alphas_at(90, config) == pytest.approx((0.25, 0.25)) and alphas_at(100, config) == (0.0, 0.0)


# --- training, resume, generation, CLI -------------------------------------------------------------------------------

@pytest.mark.parametrize("objective,steering,option", [
    ("ar", False, ""), ("diffusion", False, ""), ("ar", True, ""), ("diffusion", True, ""),
    ("ar", False, "head=prism"), ("ar", False, "mixer=prototype"), ("ar", False, "rope=pi")])
def test_resume_gives_the_same_weights(tiny_run, objective, steering, option):
    """Killed after a checkpoint and resumed, twice, a run reaches the uninterrupted run's weights; with steering
    phases the kills land before, inside and after the phases (steps 2, 4 of 12; phases at 3-4, 5-6, 7-8). The same
    for the PRISM head, the ProtoT mixer and pi-RoPE."""
    settings = TINY + [f"objective={objective}", "block_size=4", "max_steps=6", "checkpoint_every=2", "eval_every=3",
                       "steering=false"] + ([option, "prototypes=8", "prototype_topk=3", "mixer_channels=4"]
                                            if option else [])
    if steering:
        settings = TINY + [f"objective={objective}", "block_size=4", "max_steps=12", "checkpoint_every=2",
                           "eval_every=3", "steering=true", "steering_phases=3", "steering_phase_frac=0.17",
                           "alpha_warm_frac=0.25", "decay_frac=0.25", "steering_lifted=5"]
        assert steering_phases(TrainConfig.from_overrides(str(tiny_run), settings))[0][0] == 3
    objective = f"{objective}{'-steer' if steering else ''}{option.replace('=', '-')}"
    whole = TrainConfig.from_overrides(str(tiny_run), settings + [f"name=whole-{objective}"])
    metrics = train(whole, log=lambda msg: None)
    parts = TrainConfig.from_overrides(str(tiny_run), settings + [f"name=parts-{objective}"])
    assert train(parts, log=lambda msg: None, stop_after=2) == {}  # "killed" after the step-2 checkpoint
    assert train(parts, log=lambda msg: None, stop_after=2) == {}  # and again after step 4
    resumed = train(parts, log=lambda msg: None)
    a = load_file(tiny_run / "cblm" / f"whole-{objective}" / "checkpoint" / "model.safetensors")
    b = load_file(tiny_run / "cblm" / f"parts-{objective}" / "checkpoint" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["val_loss"] == metrics["val_loss"]
    if option == "head=prism":
        assert 0 <= metrics["prototype_share"] <= 1 and 0 < metrics["prototype_active"] <= 3
        return
    for key in ("val_loss", "concept_loss", "independence", "contribution", "detection_auc"):
        assert np.isfinite(metrics[key]), key
    assert 0 <= metrics["contribution"] <= 1


def test_changed_config_is_refused_and_old_checkpoint_is_used(tiny_run):
    config = TrainConfig.from_overrides(str(tiny_run), TINY + ["max_steps=2", "name=guard"])
    train(config, log=lambda msg: None)
    with pytest.raises(ValueError, match="another configuration"):
        train(TrainConfig.from_overrides(str(tiny_run), TINY + ["max_steps=3", "name=guard"]), log=lambda msg: None)
    out = tiny_run / "cblm" / "guard"
    (out / "checkpoint").rename(out / "checkpoint.old")  # killed between the two renames of a save
    model, state = checkpoint.load(out)
    assert state["step"] == 2 and isinstance(model, CBLM)


def test_settings_a_model_does_not_read_do_not_count():
    """A baseline saved with another p_eps (a concept-only setting) is the same model; a concept model is not; a
    model saved before `head` and the mixer existed (`concepts: false`) matches today's baseline."""
    baseline = TrainConfig.from_overrides("run", ["head=none", "p_eps=0.3", "lambda_div=0"])
    saved = asdict(TrainConfig.from_overrides("run", ["head=none"]))
    assert changed_settings(saved, baseline) == {}
    assert changed_settings(asdict(TrainConfig.from_overrides("run", [])),
                            TrainConfig.from_overrides("run", ["p_eps=0.3"])) == {"p_eps": (0.7, 0.3)}
    older = {k: v for k, v in saved.items() if k not in ("head", "mixer", "mixer_channels", "rope")}
    assert changed_settings(older | {"concepts": False}, baseline) == {}
    assert "head" in changed_settings(older | {"concepts": True}, baseline)


def test_generation_and_steering():
    for objective in ("ar", "diffusion"):
        model = tiny_model(objective)
        out = generate(model, [1, 2, 3], max_new_tokens=10, seed=0)
        assert len(out) == 13 and out[:3] == [1, 2, 3] and 49 not in out[3:]  # no [MASK] left
        assert generate(model, [1, 2, 3], 10, seed=0) == out  # seeded
        long = generate(model, [1, 2, 3], max_new_tokens=30, seed=0)  # beyond the model's 16-token window
        assert len(long) == 33
    model = tiny_model()
    steer = steering_for(model, [1], strength=3.0)
    assert steer.gamma > 0 and steer.suppress == 0 and steer.layer == 1
    suppress = steering_for(model, [1], strength=-3.0)
    idx = torch.randint(0, 49, (1, 16))
    plain = model(idx)[0]
    steered = model(idx, steer=steer)[0]
    assert not torch.allclose(plain, steered)
    # the suppression mask only lowers logits, most for the tokens most aligned with the concept
    masked_only = model(idx, steer=type(suppress)(suppress.direction, 0.0, 99, suppress.suppress,
                                                  logit_direction=suppress.logit_direction))[0]
    drop = plain - masked_only
    assert (drop >= -1e-6).all() and int(drop[0, 0].argmax()) == int(
        (model.tok_emb.weight @ suppress.logit_direction).argmax())


def test_codec_round_trip():
    codec = Codec(sorted(set(cl100k().encode_ordinary("The river flows.")) | {BOS}))
    ids, dropped = codec.encode("The river flows.")
    assert dropped == 0 and codec.decode(ids) == "[BOS]The river flows."
    assert codec.encode("The river flows to the sea.")[1] > 0  # unknown tokens are dropped and counted


def test_cli_train_eval_generate_attribute(tiny_run, capsys):
    from atlas.cli import main

    args = ["cblm", "train", str(tiny_run), "--name", "cli"] + [x for s in TINY + ["max_steps=3"]
                                                                 for x in ("--set", s)]
    assert main(args) == 0
    folder = tiny_run / "cblm" / "cli"
    assert (folder / "metrics.json").exists() and (folder / "log.jsonl").exists()
    assert main(["cblm", "eval", str(folder)]) == 0
    assert "val_loss" in capsys.readouterr().out
    assert main(["cblm", "generate", str(folder), "--prompt", "The river", "--max-new-tokens", "5",
                 "--steer", "rivers", "--strength", "2"]) == 0
    assert "[BOS]The river" in capsys.readouterr().out
    assert main(["cblm", "attribute", str(folder), "The triangle has three sides"]) == 0
    out = capsys.readouterr().out
    assert "= known" in out and "known concepts with the largest contribution" in out


def test_a_trained_model_is_not_trained_or_evaluated_again(tiny_run, capsys, monkeypatch):
    """A second `atlas cblm train` (a second scripts/demo.sh) says the model is trained and does nothing; --force
    retrains from scratch."""
    from atlas.cli import main

    args = ["cblm", "train", str(tiny_run), "--name", "again"] + [x for s in TINY + ["max_steps=2"]
                                                                   for x in ("--set", s)]
    assert main(args) == 0
    folder = tiny_run / "cblm" / "again"
    files = {p: p.read_bytes() for p in (folder / "metrics.json", folder / "log.jsonl",
                                          folder / "checkpoint" / "model.safetensors")}
    capsys.readouterr()

    def no_evaluation(*args, **kwargs):
        raise AssertionError("a trained model was evaluated again")

    monkeypatch.setattr("atlas.cblm.train.evaluate", no_evaluation)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"{folder} is already trained with these settings (2/2 steps; val_loss" in out and "nothing to do" in out
    assert "--force retrains it" in out and "report:" not in out  # nothing rewritten, not even the report
    assert all(p.read_bytes() == data for p, data in files.items())
    assert train(TrainConfig.from_overrides(str(tiny_run), TINY + ["max_steps=2", "name=again"]),
                 log=lambda m: None) == json.loads(files[folder / "metrics.json"])  # the API does nothing either
    monkeypatch.chdir(tiny_run.parent)  # the same run, spelled another way
    assert main([args[0], args[1], tiny_run.name] + args[3:]) == 0 and "already trained" in capsys.readouterr().out
    monkeypatch.undo()
    (folder / "transducer").mkdir()  # --force starts over: the old transducer goes with the old model
    assert main(args + ["--force"]) == 0
    assert "already trained" not in capsys.readouterr().out and not (folder / "transducer").exists()
    assert len((folder / "log.jsonl").read_text().splitlines()) == 1  # a fresh log, not appended to the old one


def test_steer_resolves_names_ids_and_suggests_the_nearest(tiny_run, capsys, monkeypatch):
    from atlas.cblm.cli import find_concept
    from atlas.cli import main

    names = ["triangles", "python code", "rivers", "music", "academic", "academic"]
    domains = ["content", "content", "content", "content", "content", "tone"]
    assert find_concept(names, "rivers") == 2
    assert find_concept(names, "  Python   CODE ") == 1  # case and whitespace do not matter
    assert find_concept(names, "3") == find_concept(names, "#3") == 3  # a concept id
    with pytest.raises(SystemExit, match=r"2 concepts are named 'academic': 'academic' \(id 4\), 'academic' "
                                         r"\(id 5, tone\); give the id"):
        find_concept(names, "academic", domains)
    with pytest.raises(SystemExit, match=r"no concept id 9: this library has ids 0-5"):
        find_concept(names, "9")
    with pytest.raises(SystemExit, match=r"no concept named 'rivres'.*nearest names: 'rivers' \(id 2\)"):
        find_concept(names, "rivres")
    with pytest.raises(SystemExit, match=r"no concept named 'python programming'.*nearest names: 'python code'"):
        find_concept(names, "python programming")
    with pytest.raises(SystemExit, match="no name is close"):
        find_concept(names, "zzz")

    monkeypatch.chdir(tiny_run.parent)  # trained with a relative run directory...
    train(TrainConfig.from_overrides(tiny_run.name, TINY + ["max_steps=1", "name=steer"]), log=lambda m: None)
    model = str(tiny_run / "cblm" / "steer")
    monkeypatch.chdir(tiny_run / "tokens")  # ...and used from another folder: the run is the model's RUN
    with pytest.raises(SystemExit, match=r"nearest names: 'music' \(id 3\)"):
        main(["cblm", "generate", model, "--prompt", "The", "--steer", "musik", "--max-new-tokens", "2"])
    assert main(["cblm", "generate", model, "--prompt", "The", "--steer", "Python Code", "--max-new-tokens", "2"]) == 0
    assert "steering toward concept 1 'python code' (strength 0.5)" in capsys.readouterr().out

