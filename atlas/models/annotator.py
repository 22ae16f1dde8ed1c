"""The concept annotator (paper 4.2.3): model, positive-unlabeled losses, decision rule, save and load.

One model labels any chunk with content concepts and with the labels of the auxiliary domains::

    text --encoder--> z (pooled, L2-normalized, d)
    content logits   = scale * z @ K^T + b            K [n_content, d], initialized from the concepts'
                                                       "name: description" embeddings (kNN-like at step 0)
    trunk            = LayerNorm -> Linear -> ReLU -> Dropout -> Linear (projection)
    <aux> logits     = Linear(trunk(z))                one head per auxiliary domain

Training data is positive-unlabeled: a concept a chunk did not inherit may still apply. The loss
(``annotator_loss``) is masked BCE on the positives plus the non-negative PU risk of Kiryo et
al. (2017) for every concept, with a class prior per concept (``pu_priors``).

Saved as ``model.safetensors`` (heads; plus ``encoder/`` when fine-tuned) and ``config.json``
(encoder, dims, label space, thresholds and caps). Nothing is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

ANNOTATOR_FORMAT = 1
RETRAIN = "retrain the annotator (atlas run CONFIG --force --stages train_annotator)"


class AnnotatorHeads(nn.Module):
    """Everything after the pooled embedding: the content head and the auxiliary heads."""

    def __init__(self, dim: int, n_content: int, aux_sizes: dict[str, int], hidden: int = 512, dropout: float = 0.1,
                 concept_init: torch.Tensor | None = None):
        super().__init__()
        init = concept_init if concept_init is not None else torch.randn(n_content, dim) / dim**0.5
        self.concepts = nn.Parameter(init.clone().float())  # K: one learnable embedding per content concept
        self.log_scale = nn.Parameter(torch.tensor(float(np.log(10.0))))  # cosines are small: scale them up
        self.bias = nn.Parameter(torch.full((n_content,), -3.0))  # start with low prevalence
        self.trunk = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout),
                                   nn.Linear(hidden, hidden))
        self.aux = nn.ModuleDict({name: nn.Linear(hidden, size) for name, size in aux_sizes.items()})

    def forward(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Logits per domain: {"content": [B, n_content], "<aux>": [B, n_aux]}."""
        logits = {"content": self.log_scale.exp() * (z @ self.concepts.T) + self.bias}
        if len(self.aux):
            shared = self.trunk(z)
            logits |= {name: head(shared) for name, head in self.aux.items()}
        return logits


# --- losses ------------------------------------------------------------------------------------


def pu_priors(positive_rate: np.ndarray, label_frequency: float) -> np.ndarray:
    """Class prior of each concept among the chunks *not* labeled with it.

    With a labeled rate p and a label frequency f (the share of a concept's true chunks that carry
    the label), the true rate is p / f, and among unlabeled chunks pi = (p / f - p) / (1 - p).
    Clipped to [0, 0.5].
    """
    p = np.clip(np.asarray(positive_rate, dtype=np.float64), 0, 1 - 1e-9)
    return np.clip((p / label_frequency - p) / (1 - p), 0.0, 0.5)


def masked_bce_positive(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean of -log sigmoid(logit) over the positive entries only (unlabeled entries are masked out)."""
    n = targets.sum()
    if n == 0:
        return logits.sum() * 0.0
    return (F.softplus(-logits) * targets).sum() / n


def nn_pu_risk(logits: torch.Tensor, targets: torch.Tensor, prior: torch.Tensor, beta: float = 0.0,
               gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative PU risk (Kiryo et al. 2017), per concept, averaged over concepts.

    For concept c with labeled positives P and unlabeled U (prior pi_c of positives inside U), with
    the logistic loss l(z, +1) = softplus(-z) and l(z, -1) = softplus(z)::

        positive risk  R+ = pi_c * mean_P l(z, +1)
        negative risk  R- = mean_U l(z, -1) - pi_c * mean_P l(z, -1)      (unbiased, can go negative)
        risk           R  = R+ + max(0, R-)

    A concept without positives in the batch has no estimate of the correction: R- = mean_U l(z, -1).
    Returns (risk to report, objective to minimize). The objective follows Kiryo's algorithm: where
    R- < -beta it is -gamma * R- (a step back up instead of further down), else R+ + R-.
    """
    pos, unl = targets, 1.0 - targets
    n_pos, n_unl = pos.sum(0), unl.sum(0).clamp(min=1.0)
    has_pos = n_pos > 0
    n_pos = n_pos.clamp(min=1.0)
    loss_pos, loss_neg = F.softplus(-logits), F.softplus(logits)
    positive = prior * (loss_pos * pos).sum(0) / n_pos
    negative = (loss_neg * unl).sum(0) / n_unl - torch.where(has_pos, prior * (loss_neg * pos).sum(0) / n_pos, 0.0)
    risk = positive + negative.clamp(min=0.0)
    objective = torch.where(negative < -beta, -gamma * negative, positive + negative)
    return risk.mean(), objective.mean()


def annotator_loss(logits: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], priors: dict[str, torch.Tensor],
                   pu_weight: float = 1.0, beta: float = 0.0, gamma: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Sum over domains of BCE on positives + pu_weight * nnPU; returns (objective, reported parts)."""
    total, parts = 0.0, {}
    for domain, z in logits.items():
        bce = masked_bce_positive(z, targets[domain])
        risk, objective = nn_pu_risk(z, targets[domain], priors[domain], beta, gamma)
        total = total + bce + pu_weight * objective
        parts[f"{domain}_bce"], parts[f"{domain}_pu"] = bce.item(), risk.item()
    return total, parts


# --- decision rule -----------------------------------------------------------------------------


def decide(probs: np.ndarray, threshold: float, cap: int) -> list[list[tuple[int, float]]]:
    """Per row, the labels with probability >= threshold, highest first, at most ``cap`` of them."""
    if probs.shape[1] == 0:
        return [[] for _ in range(len(probs))]
    k = min(cap, probs.shape[1])
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return [[(int(j), float(row[j])) for j in order if row[j] >= threshold] for row, order in zip(probs, top)]


def choose_rule(probs: np.ndarray, targets: np.ndarray, max_cap: int) -> dict:
    """The (threshold, cap) that maximizes recall^2 / P(predicted positive) on held-out data.

    Lee & Liu (2003): for PU data this criterion is proportional to precision * recall on the true
    labels, so it can be optimized without any negatives. Thresholds: a grid of probabilities;
    caps: 1, 2, 3, 5, 8, 10, 15, 20, ... up to ``max_cap``.
    """
    caps = sorted({c for c in (1, 2, 3, 5, 8, 10, 15, 20, 30, 50) if c <= max_cap} | {max_cap})
    thresholds = np.round(np.arange(0.05, 0.96, 0.05), 2)
    n_pos = targets.sum()
    best = {"threshold": 0.5, "cap": caps[0], "criterion": -1.0}
    if n_pos == 0 or probs.size == 0:
        return best
    order = np.argsort(-probs, axis=1, kind="stable")
    ranked_probs = np.take_along_axis(probs, order, axis=1)
    ranked_hits = np.take_along_axis(targets, order, axis=1)
    for cap in caps:
        p, h = ranked_probs[:, :cap], ranked_hits[:, :cap]
        for t in thresholds:
            kept = p >= t
            predicted = kept.sum()
            if predicted == 0:
                continue
            recall = (h * kept).sum() / n_pos
            criterion = recall**2 / (predicted / probs.size)
            if criterion > best["criterion"] + 1e-12:
                best = {"threshold": float(t), "cap": int(cap), "criterion": float(criterion)}
    return best


# --- save, load, predict -----------------------------------------------------------------------


@dataclass
class AnnotatorSpec:
    """Everything config.json records: enough to rebuild the model and to decide."""

    encoder: str  # a name or a path; "encoder" (relative to the folder) when fine-tuned
    dim: int
    hidden: int
    dropout: float
    domains: dict[str, dict]  # domain -> {"offset", "size", "threshold", "cap"}; "content" first
    library_sha256: str = ""
    format: int = ANNOTATOR_FORMAT

    def aux_sizes(self) -> dict[str, int]:
        return {d: v["size"] for d, v in self.domains.items() if d != "content"}


def save_annotator(folder: Path, heads: AnnotatorHeads, spec: AnnotatorSpec, encoder=None) -> None:
    """Write weights (safetensors) and config.json; with ``encoder`` (fine-tuned) also ``encoder/``."""
    from safetensors.torch import save_file

    from atlas.core.files import atomic_write_json

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / ".model.safetensors.tmp"
    save_file({k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}, str(tmp),
              metadata={"format": str(ANNOTATOR_FORMAT)})
    tmp.replace(folder / "model.safetensors")
    if encoder is not None:
        encoder.save(str(folder / "encoder"), safe_serialization=True)
    atomic_write_json(folder / "config.json", spec.__dict__)


class Annotator:
    """A trained annotator, loaded from its folder. Cheap to construct; weights load in ``setup``.

    ``annotate(texts)`` -> per text, per domain, [(global concept id, probability)], decided by the
    per-domain threshold and cap chosen on the held-out split.
    """

    def __init__(self, folder: str | Path, device: str | None = None, batch_size: int = 64):
        from atlas.core.files import ArtifactError, read_json

        self.folder = Path(folder)
        config_path = self.folder / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{config_path}: no trained annotator here (run the train_annotator stage)")
        data = read_json(config_path)
        if data.get("format") != ANNOTATOR_FORMAT:
            raise ArtifactError(f"{config_path}: annotator format {data.get('format')!r}, this Atlas reads "
                                f"{ANNOTATOR_FORMAT}; {RETRAIN}")
        try:
            self.spec = AnnotatorSpec(**data)
        except TypeError as e:
            raise ArtifactError(f"{config_path}: not an annotator config ({e}); {RETRAIN}") from None
        domains = self.spec.domains
        if not isinstance(domains, dict) or "content" not in domains or not all(
                isinstance(v, dict) and {"offset", "size", "threshold", "cap"} <= v.keys() for v in domains.values()):
            raise ArtifactError(f"{config_path}: 'domains' must map 'content' and each auxiliary domain to its "
                                f"offset, size, threshold and cap; {RETRAIN}")
        # config.json stores keys sorted; labels are listed domain by domain in id order (content first)
        self.spec.domains = dict(sorted(domains.items(), key=lambda kv: kv[1]["offset"]))
        self.device, self.batch_size = device, batch_size
        self.heads: AnnotatorHeads | None = None
        self.embedder = None

    def setup(self) -> Annotator:
        from atlas.models.embedder import Embedder

        if self.heads is None:
            self.heads = self.load_heads()
        if self.embedder is None:
            s = self.spec
            encoder = str(self.folder / s.encoder) if (self.folder / s.encoder).is_dir() else s.encoder
            self.embedder = Embedder(encoder, device=self.device, batch_size=self.batch_size)
        return self

    def load_heads(self) -> AnnotatorHeads:
        """The heads from ``model.safetensors``, checked against config.json (cheap: the encoder is not loaded)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from atlas.core.files import ArtifactError

        s, path = self.spec, self.folder / "model.safetensors"
        if not path.is_file():
            raise ArtifactError(f"{path}: missing (config.json is there, the weights are not); {RETRAIN}")
        try:
            weights = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise ArtifactError(f"{path}: not a readable safetensors file ({e}); {RETRAIN}") from None
        n_content = s.domains["content"]["size"]
        if "concepts" not in weights or weights["concepts"].shape != (n_content, s.dim):
            found = tuple(weights["concepts"].shape) if "concepts" in weights else "missing"
            raise ArtifactError(f"{path}: concept matrix is {found}, config.json says ({n_content}, {s.dim}); "
                                f"{RETRAIN}")
        heads = AnnotatorHeads(s.dim, n_content, s.aux_sizes(), s.hidden, s.dropout)
        try:
            heads.load_state_dict(weights)
        except RuntimeError as e:
            raise ArtifactError(f"{path}: the weights do not fit config.json ({e}); {RETRAIN}") from None
        return heads.eval()

    def check_library(self, concepts: list[dict]) -> None:
        """Fail clearly when this annotator was trained on another label space than ``concepts``."""
        from atlas.core.files import ArtifactError

        for domain, v in self.spec.domains.items():
            found = sum(c["domain"] == domain for c in concepts)
            if found != v["size"]:
                raise ArtifactError(f"{self.folder / 'config.json'}: the annotator knows {v['size']} {domain} "
                                    f"concepts but the library has {found}; {RETRAIN}")

    def check_library_file(self, path: str | Path) -> None:
        """Fail clearly when ``path`` (library/concepts.parquet) is not the file this annotator was trained on."""
        from atlas.core.files import ArtifactError, sha256_bytes

        path = Path(path)
        if self.spec.library_sha256 and sha256_bytes(path.read_bytes()) != self.spec.library_sha256:
            raise ArtifactError(f"{path}: not the library this annotator was trained on (its sha256 differs from "
                                f"the one in {self.folder / 'config.json'}): the file was changed or replaced; "
                                f"restore it, or {RETRAIN}")

    def probabilities(self, embeddings: np.ndarray) -> dict[str, np.ndarray]:
        """Per domain, [N, n_domain] probabilities from pooled L2-normalized embeddings."""
        self.setup()
        with torch.no_grad():
            logits = self.heads(torch.as_tensor(np.asarray(embeddings, dtype=np.float32)))
        return {d: torch.sigmoid(z).numpy() for d, z in logits.items()}

    def decide(self, probs: dict[str, np.ndarray]) -> list[dict[str, list[tuple[int, float]]]]:
        """Per row, per domain: [(global id, probability)] after the domain's threshold and cap."""
        n = len(next(iter(probs.values())))
        out = [{} for _ in range(n)]
        for domain, v in self.spec.domains.items():
            for row, labels in zip(out, decide(probs[domain], v["threshold"], v["cap"])):
                row[domain] = [(v["offset"] + j, p) for j, p in labels]
        return out

    def annotate(self, texts: list[str]) -> list[dict[str, list[tuple[int, float]]]]:
        self.setup()
        return self.decide(self.probabilities(self.embedder.encode(texts)))
