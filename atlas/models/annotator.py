"""The concept annotator (paper 4.2.3): model, positive-unlabeled losses, calibration, decision rule, save and load.

One model labels any chunk with content concepts and with the labels of the auxiliary domains::

    text --encoder--> z (pooled, L2-normalized, d)
    content logits   = scale * z @ K^T + b            K [n_content, d], initialized from the concepts'
                                                       "name: description" embeddings (kNN-like at step 0)
    trunk            = LayerNorm -> Linear -> ReLU -> Dropout -> Linear (projection)
    <aux> logits     = Linear(trunk(z))                one head per auxiliary domain
    probability      = sigmoid(a_domain * logit + b_domain)      Platt calibration, one (a, b) per domain

Training data is positive-unlabeled: a concept a chunk did not inherit may still apply. The loss
(``annotator_loss``) is masked BCE on the positives plus the non-negative PU risk of Kiryo et
al. (2017) for every concept, with a class prior per concept (``pu_priors``).

**Calibration.** BCE on positives + nnPU ranks labels well but its raw sigmoid is not a probability:
held-out scores saturate near 1 (the positives' BCE pushes logits up without bound, and the PU
priors are an assumption). After training, each label domain gets a Platt map (Platt 1999)
``p = sigmoid(a * logit + b)``, fit on the held-out (chunk, label) pairs to the event "the chunk
carries this label as a known positive" (``fit_platt``). Why Platt, per domain:

- it is strictly monotone (``a > 0`` is enforced), so within a domain the ranking of labels, and
  with it recall@k and PR-AUC, is exactly that of the logits; isotonic regression would create ties
  (a step function), which changes both, and needs a table instead of two numbers;
- the failure it corrects is one of scale and offset (over-confident, saturated logits), which is
  what ``a`` and ``b`` express; two parameters per domain cannot overfit even an auxiliary domain
  with a few dozen held-out positives, where a per-label or isotonic map would;
- it is stored as two floats per domain in ``config.json`` (nothing pickled) and costs nothing to apply.

The fit is a weighted logistic regression by Newton's method with Platt's smoothed targets
((N+ + 1) / (N+ + 2) for positives, 1 / (N- + 2) for the others), which keeps ``a`` finite when the
held-out pairs are separable. When a domain has more than ``MAX_CALIBRATION_PAIRS`` pairs, the
fit takes its positives (up to half the budget) and a uniform sample of the other pairs, each
sample weighted by the inverse of its sampling rate, so the fitted probabilities stay calibrated
for the full population (importance weighting), not for the balanced sample. The probability is that
of a *known* positive, a lower bound: an unlabeled pair may be right (under the stated label
frequency f the true rate would be about p / f).

**Decision rule** (``decide``): per domain, the labels whose calibrated probability reaches the
domain's threshold (and an auxiliary label's own threshold against the null, where higher), best first, at
most ``cap`` of them; the cap is only a safety limit, so a chunk gets as many labels as pass the threshold.
The thresholds are chosen by the ``train_annotator`` stage.

Saved as ``model.safetensors`` (heads; plus ``encoder/`` when fine-tuned) and ``config.json``
(encoder, dims, label space, thresholds, caps and calibration per domain). Nothing is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

ANNOTATOR_FORMAT = 1
NULL_FILE = "null_embeddings.npy"  # the null's texts (atlas.io.neutral_text) as the encoder embeds them, float16
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


# --- calibration -------------------------------------------------------------------------------

MAX_CALIBRATION_PAIRS = 2_000_000  # (chunk, label) pairs a Platt fit uses at most (the rest: a weighted sample)
MIN_SLOPE = 1e-3  # a > 0 keeps the map strictly increasing: a domain's ranking never changes


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -x))


def _positive_flat_indices(truth, shape: tuple[int, int]) -> np.ndarray:
    """Sorted flat indices (row * n_labels + col) of the known positives of a dense or CSR ``truth``."""
    if hasattr(truth, "tocoo"):
        coo = truth.tocoo()
        keep = coo.data != 0
        flat = coo.row[keep].astype(np.int64) * shape[1] + coo.col[keep].astype(np.int64)
        return np.unique(flat)
    return np.flatnonzero(np.asarray(truth).reshape(shape) != 0).astype(np.int64)


def _newton_logistic(x: np.ndarray, t: np.ndarray, w: np.ndarray, a: float, b: float,
                     fit_slope: bool = True) -> tuple[float, float]:
    """Weighted logistic regression of soft targets ``t`` on ``a * x + b`` (Newton with backtracking; convex)."""

    def loss(a_: float, b_: float) -> float:
        s = a_ * x + b_
        return float(w @ (t * _softplus(-s) + (1 - t) * _softplus(s)))

    current = loss(a, b)
    for _ in range(100):
        p = _sigmoid(a * x + b)
        r, h = w * (p - t), w * p * (1 - p)
        if fit_slope:
            gradient = np.array([r @ x, r.sum()])
            hessian = np.array([[h @ (x * x), h @ x], [h @ x, h.sum()]]) + 1e-12 * np.eye(2)
            step = np.linalg.solve(hessian, gradient)
        else:
            step = np.array([0.0, r.sum() / max(h.sum(), 1e-300)])
        scale = 1.0
        while scale > 1e-10:
            a_new, b_new = a - scale * step[0], b - scale * step[1]
            new = loss(a_new, b_new)
            if new <= current:
                break
            scale /= 2
        else:
            break
        converged = current - new <= 1e-13 * max(abs(current), 1.0) and abs(scale * step).max() < 1e-9
        a, b, current = a_new, b_new, new
        if converged:
            break
    return float(a), float(b)


def fit_platt(logits: np.ndarray, truth, max_pairs: int = MAX_CALIBRATION_PAIRS, seed: int = 0) -> dict:
    """Platt scaling of one domain: (a, b) so that sigmoid(a * logit + b) is the probability of a known positive.

    ``logits`` [N, L]; ``truth`` [N, L] (dense or sparse) marks the known positives. Every pair is used when
    there are at most ``max_pairs``; otherwise the positives (up to half the budget) and a uniform sample of
    all pairs (of which the negatives are kept), each weighted by its inverse sampling rate. Returns
    {"method": "platt", "a", "b", "fit_pairs", "pairs", "known_positives"}; ``a`` is at least ``MIN_SLOPE``.
    """
    z = np.asarray(logits, dtype=np.float32)
    n = z.size
    if n == 0:
        return {"method": "platt", "a": 1.0, "b": 0.0, "fit_pairs": 0, "pairs": 0, "known_positives": 0}
    positives = _positive_flat_indices(truth, z.shape)
    n_pos, n_neg = len(positives), n - len(positives)
    flat = z.ravel()
    if n <= max_pairs:
        x = flat.astype(np.float64)
        y = np.zeros(n, dtype=bool)
        y[positives] = True
        w = np.ones(n)
    else:
        rng = np.random.default_rng(seed)
        pos = positives
        if n_pos > max_pairs // 2:
            pos = np.sort(rng.choice(positives, max_pairs // 2, replace=False))
        draw = np.sort(rng.choice(n, max_pairs - len(pos), replace=False))
        neg = draw[~np.isin(draw, positives, assume_unique=True)]
        x = np.concatenate([flat[pos], flat[neg]]).astype(np.float64)
        y = np.concatenate([np.ones(len(pos), dtype=bool), np.zeros(len(neg), dtype=bool)])
        w = np.concatenate([np.full(len(pos), n_pos / max(len(pos), 1)), np.full(len(neg), n_neg / max(len(neg), 1))])
    t = np.where(y, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))  # Platt's targets: no infinite slope
    prior = (n_pos + 1) / (n + 2)
    a, b = _newton_logistic(x, t, w, 0.0, float(np.log(prior / (1 - prior))))
    if a < MIN_SLOPE:  # no (or an inverted) signal: keep the ranking, fit the level only
        a, b = _newton_logistic(x, t, w, MIN_SLOPE, b, fit_slope=False)
    return {"method": "platt", "a": a, "b": b, "fit_pairs": int(len(x)), "pairs": int(n), "known_positives": n_pos}


def calibrate(logits, calibration: dict) -> np.ndarray:
    """Calibrated probabilities (float32) of one domain: sigmoid(a * logit + b), computed in float64."""
    z = torch.as_tensor(logits).to(torch.float64)
    return torch.sigmoid(calibration["a"] * z + calibration["b"]).to(torch.float32).numpy()


def valid_calibration(calibration) -> bool:
    """Whether a domain's stored calibration is one this Atlas applies: {"method": "platt", "a" > 0, "b"}."""
    return (isinstance(calibration, dict) and calibration.get("method") == "platt"
            and all(isinstance(calibration.get(k), (int, float)) and not isinstance(calibration.get(k), bool)
                    and np.isfinite(calibration[k]) for k in ("a", "b")) and calibration["a"] > 0)


# --- decision rule -----------------------------------------------------------------------------


def decide(probs: np.ndarray, threshold: float | np.ndarray, cap: int) -> list[list[tuple[int, float]]]:
    """Per row, the labels with probability >= threshold (one for the domain, or one per label), highest first,
    at most ``cap`` of them (a safety limit)."""
    if probs.shape[1] == 0:
        return [[] for _ in range(len(probs))]
    k = min(cap, probs.shape[1])
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    needed = np.broadcast_to(np.asarray(threshold, dtype=np.float64), (probs.shape[1],))
    return [[(int(j), float(row[j])) for j in order if row[j] >= needed[j]] for row, order in zip(probs, top)]


def withhold_like_null(probs: np.ndarray, domain: dict, like_null: np.ndarray | None) -> np.ndarray:
    """``probs`` of one domain with the null-checked labels (a positive ``label_thresholds`` entry) set to 0 on the
    rows that read like the null: on text of the null's kind these labels abstain, as the targets stage's do."""
    own = domain.get("label_thresholds")
    if like_null is None or own is None or not np.any(like_null):
        return probs
    checked = np.asarray(own, np.float64) > 0
    return np.where(np.asarray(like_null, bool)[:, None] & checked[None, :], 0.0, probs).astype(probs.dtype)


def label_thresholds(domain: dict) -> float | np.ndarray:
    """What each label of a domain (an entry of ``AnnotatorSpec.domains``) must reach: the domain's threshold, or a
    label's own where that is higher (``label_thresholds``: an auxiliary label calibrated against the null)."""
    own = domain.get("label_thresholds")
    return domain["threshold"] if own is None else np.maximum(domain["threshold"], np.asarray(own, np.float64))


# --- save, load, predict -----------------------------------------------------------------------


@dataclass
class AnnotatorSpec:
    """Everything config.json records: enough to rebuild the model and to decide."""

    encoder: str  # a name or a path; "encoder" (relative to the folder) when fine-tuned
    dim: int
    hidden: int
    dropout: float
    # domain -> {"offset", "size", "threshold", "cap", "calibration": {"method": "platt", "a", "b"}}, and for an
    # auxiliary domain "label_thresholds" (per label, from the null; see label_thresholds); "content" first
    domains: dict[str, dict]
    library_sha256: str = ""
    format: int = ANNOTATOR_FORMAT
    # a chunk whose nearest null text (NULL_FILE, in the encoder's space) is at this cosine or more reads like the
    # null: its null-checked auxiliary labels are withheld (None: no null was saved)
    null_nearest: float | None = None

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

    ``probabilities(embeddings)`` -> per domain, calibrated probabilities (the Platt map of each domain,
    fit on the held-out split). ``annotate(texts)`` -> per text, per domain, [(global concept id,
    probability)], decided by the per-domain threshold and safety cap.
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
        if bad := sorted(d for d, v in domains.items() if v.get("label_thresholds") is not None and not (
                isinstance(v["label_thresholds"], list) and len(v["label_thresholds"]) == v["size"]
                and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in v["label_thresholds"]))):
            raise ArtifactError(f"{config_path}: 'label_thresholds' of domain(s) {', '.join(bad)} must list one "
                                f"number per label; {RETRAIN}")
        uncalibrated = sorted(d for d, v in domains.items() if not valid_calibration(v.get("calibration")))
        if uncalibrated:
            raise ArtifactError(f"{config_path}: no calibration for domain(s) {', '.join(uncalibrated)} (an annotator "
                                f"trained before its probabilities were calibrated: each domain needs 'calibration' "
                                f"{{'method': 'platt', 'a' > 0, 'b'}}); {RETRAIN}")
        # config.json stores keys sorted; labels are listed domain by domain in id order (content first)
        self.spec.domains = dict(sorted(domains.items(), key=lambda kv: kv[1]["offset"]))
        self.device, self.batch_size = device, batch_size
        self.heads: AnnotatorHeads | None = None
        self.embedder = None
        self.null: np.ndarray | None = None

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

    def logits(self, embeddings: np.ndarray) -> dict[str, np.ndarray]:
        """Per domain, [N, n_domain] raw head logits (uncalibrated) from pooled L2-normalized embeddings."""
        if self.heads is None:
            self.heads = self.load_heads()
        with torch.no_grad():
            logits = self.heads(torch.as_tensor(np.asarray(embeddings, dtype=np.float32)))
        return {d: z.numpy() for d, z in logits.items()}

    def probabilities(self, embeddings: np.ndarray) -> dict[str, np.ndarray]:
        """Per domain, [N, n_domain] calibrated probabilities (float32) from pooled L2-normalized embeddings:
        the probability that the chunk carries the label as a known positive."""
        return {d: calibrate(z, self.spec.domains[d]["calibration"]) for d, z in self.logits(embeddings).items()}

    def reads_like_null(self, embeddings: np.ndarray) -> np.ndarray | None:
        """Per row, whether the chunk's nearest null text is at ``null_nearest`` or more (None: no null saved)."""
        if self.spec.null_nearest is None or not (self.folder / NULL_FILE).is_file():
            return None
        from atlas.models.auxiliary import reads_like_null

        if self.null is None:
            self.null = np.load(self.folder / NULL_FILE, allow_pickle=False).astype(np.float32)
        return reads_like_null(np.asarray(embeddings, np.float32), self.null, self.spec.null_nearest)

    def decide(self, probs: dict[str, np.ndarray], embeddings: np.ndarray | None = None
               ) -> list[dict[str, list[tuple[int, float]]]]:
        """Per row, per domain: [(global id, probability)] after the domain's threshold and cap; with the rows'
        ``embeddings``, a row that reads like the null gets no null-checked auxiliary label."""
        n = len(next(iter(probs.values())))
        like_null = None if embeddings is None else self.reads_like_null(embeddings)
        out = [{} for _ in range(n)]
        for domain, v in self.spec.domains.items():
            kept = withhold_like_null(probs[domain], v, like_null)
            for row, labels in zip(out, decide(kept, label_thresholds(v), v["cap"])):
                row[domain] = [(v["offset"] + j, p) for j, p in labels]
        return out

    def annotate(self, texts: list[str]) -> list[dict[str, list[tuple[int, float]]]]:
        self.setup()
        embeddings = self.embedder.encode(texts)
        return self.decide(self.probabilities(embeddings), embeddings)
