"""The other interpretable models of the seeds, as options of the trainer's model: the ProtoT prototype mixer
(parallel and recurrent forms agree, constant memory per token, strict causality), the PRISM head (exact logit
decomposition, losses by hand) and pi-RoPE (signal/noise bases). Resume of each option is in test_cblm.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_cblm import one_thread  # noqa: F401  (autouse: one torch thread)

from atlas.cblm.generate import generate
from atlas.cblm.mixer import PrototypeMixer, routing_metrics
from atlas.cblm.model import CBLM, ModelConfig, pi_rope_tables, rope_tables
from atlas.cblm.prism import PrototypeHead, decompose, prism_losses


def model_with(**options) -> CBLM:
    torch.manual_seed(0)
    settings = dict(vocab_size=50, seq_len=24, d_model=32, n_head=2, n_layer=3, mixer_channels=8) | options
    return CBLM(ModelConfig(**settings)).eval()


# --- ProtoT mixer ------------------------------------------------------------------------------------------------

def test_recurrent_form_equals_the_parallel_forward():
    model = model_with(mixer="prototype")
    with torch.no_grad():  # untrained alpha = 1 and varied decays: the mixer's output is not negligible
        for block in model.blocks:
            block.attn.proj.weight.normal_(std=0.2)
    idx = torch.randint(0, 50, (2, 24))
    parallel, _ = model(idx)
    state, steps = model.initial_state(2), []
    for t in range(24):
        logits, _, state = model.step(idx[:, t], state)
        steps.append(logits)
    assert (torch.stack(steps, 1) - parallel).abs().max() <= 1e-5


def test_recurrent_state_has_a_constant_size_whatever_the_length():
    model = model_with(mixer="prototype")
    state = model.initial_state(1)

    def size(state) -> int:
        return sum(t.numel() for layer in state for t in layer.values())

    first = size(state)
    for t in range(100):  # beyond seq_len: the recurrent form has no window
        _, _, state = model.step(torch.tensor([t % 50]), state)
        assert size(state) == first
    assert first == 3 * (8 * 16 + 8 + 4 * 16)  # per layer: R x d/2 sums, R masses, the convolution's 4 past values
    out = generate(model, [1, 2, 3], max_new_tokens=40, seed=0)
    assert len(out) == 43  # longer than seq_len: generation runs recurrently


def test_mixer_is_strictly_causal_and_reads_prefix_means():
    torch.manual_seed(0)
    mixer = PrototypeMixer(d_model=8, channels=4, layer=2)  # no convolution at layer >= 2
    x = torch.randn(1, 6, 8)
    y = mixer(x)
    assert torch.equal(y[0, 0], torch.zeros(8))  # the first token reads an empty prefix
    changed = x.clone()
    changed[0, 3:] = torch.randn(3, 8)
    assert torch.allclose(mixer(changed)[0, :3], y[0, :3])  # tokens >= 3 do not reach earlier outputs
    with torch.no_grad():  # no decay (beta = 1): each channel is the write-weighted mean of the earlier values
        mixer.decay_logit.fill_(30.0)
        write, read = mixer.gates(x)
        v = mixer.values(x)
        i = 4
        mixed = sum(read[0, i, k] * (sum(write[0, j, k] * v[0, j] for j in range(i)) / write[0, :i, k].sum())
                    for k in range(4))
        assert torch.allclose(mixer(x)[0, i], mixer.alpha * mixer.proj(mixed), atol=1e-5)


def test_routing_metrics_by_hand():
    mixer = PrototypeMixer(d_model=4, channels=2, layer=0)
    with torch.no_grad():
        mixer.prototypes.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
        mixer.log_tau_write.fill_(math.log(1e-3))  # a hard softmax: each token writes to one channel
    x = torch.tensor([[[1.0, 0, 0, 0], [1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0]]])
    metrics = routing_metrics(mixer, x)
    assert metrics["top1_mass"] == pytest.approx(1.0)
    assert metrics["gini"] == pytest.approx(0.25)  # loads 1 and 3: (2*1-3)*1 + (2*2-3)*3 = 2 over 2*4
    assert metrics["alpha"] == 1.0


# --- PRISM head --------------------------------------------------------------------------------------------------

def test_prism_logits_decompose_exactly():
    model = model_with(prototypes=20, prototype_topk=4, n_layer=2)
    idx = torch.randint(0, 50, (2, 24))
    logits, parts = model(idx)
    split = decompose(model.tok_emb.weight, model.prism, parts, idx)
    assert (split["logit"] - logits.gather(-1, idx[..., None])[..., 0]).abs().max() <= 1e-4
    assert ((parts.alpha > 0).sum(-1) <= 4).all() and (parts.alpha >= 0).all()
    # the prototypes do not change the logits: PRISM = the plain model with the same backbone
    assert torch.allclose(logits, model.hidden(idx) @ model.tok_emb.weight.T, atol=1e-5)


def test_prism_routing_and_losses_by_hand():
    head = PrototypeHead(d_model=2, prototypes=3, topk=2)
    with torch.no_grad():
        head.prototypes.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, 0.0]]))
        head.log_tau.fill_(math.log(2.0))
    z = torch.tensor([[[3.0, 0.0], [1.0, 1.0]]])
    parts = head(z)
    # cos rows: [1, 0, -1] and [1/sqrt2, 1/sqrt2, -1/sqrt2]; a = ReLU(2 cos), top 2
    assert torch.allclose(parts.alpha, torch.tensor([[[2.0, 0.0, 0.0], [math.sqrt(2), math.sqrt(2), 0.0]]]))
    assert torch.allclose(parts.z_hat, torch.tensor([[[2.0, 0.0], [math.sqrt(2), 2 * math.sqrt(2)]]]))
    losses = prism_losses(head, parts, diversity=True)
    # R1: each prototype's best cos over the 2 tokens: 1, 1/sqrt2, -1/sqrt2; R2: each token's best: 1, 1/sqrt2
    assert losses["r1"].item() == pytest.approx(-(1 + 1 / math.sqrt(2) - 1 / math.sqrt(2)) / 3)
    assert losses["r2"].item() == pytest.approx(-(1 + 1 / math.sqrt(2)) / 2)
    residual = torch.tensor([[1.0, 0.0], [1 - math.sqrt(2), 1 - 2 * math.sqrt(2)]])
    assert losses["res"].item() == pytest.approx(residual.pow(2).mean().item(), rel=1e-6)
    # unit prototypes (1,0), (0,1), (-1,0): off-diagonal cos^2 = 0, 1 (twice: 1,3 and 3,1), 0... mean over 6 pairs
    assert losses["div"].item() == pytest.approx(2 / 6)


# --- pi-RoPE ------------------------------------------------------------------------------------------------------

def test_pi_rope_gives_signal_and_noise_heads_their_bases():
    cos, sin = pi_rope_tables(8, 4, 10000.0, n_head=4)
    assert cos.shape == (4, 8, 2)
    signal, noise = rope_tables(8, 4, 10000.0 * math.pi), rope_tables(8, 4, 10000.0 / math.pi)
    assert torch.equal(cos[0], signal[0]) and torch.equal(cos[1], signal[0])
    assert torch.equal(sin[2], noise[1]) and torch.equal(sin[3], noise[1])
    standard, pi = model_with(n_head=4), model_with(n_head=4, rope="pi")
    pi.load_state_dict(standard.state_dict())  # same weights, only the rotation differs
    idx = torch.randint(0, 50, (1, 24))
    assert not torch.allclose(standard(idx)[0], pi(idx)[0])
    with pytest.raises(ValueError, match="even"):
        ModelConfig(vocab_size=50, n_head=3, d_model=24, rope="pi")


def test_invalid_combinations_are_refused():
    with pytest.raises(ValueError, match="one of them"):
        ModelConfig(vocab_size=50, n_concepts=4, prototypes=8)
    with pytest.raises(ValueError, match="objective='ar'"):
        ModelConfig(vocab_size=50, mixer="prototype", objective="diffusion")
    with pytest.raises(ValueError, match="mixer="):
        ModelConfig(vocab_size=50, mixer="mamba")


def test_the_mixer_and_pi_rope_work_with_the_concept_module():
    for options in ({"mixer": "prototype"}, {"rope": "pi"}):
        model = model_with(n_concepts=4, unknown_rank=4, **options)
        logits, parts = model(torch.randint(0, 50, (1, 24)))
        assert logits.shape == (1, 24, 50) and parts.k.shape == (1, 24, 4)
        assert torch.allclose(parts.h_bar, parts.h, atol=1e-5)
        assert F.softmax(logits, -1).sum(-1).allclose(torch.ones(1, 24))
