"""Attribution for the concept-bottleneck LM (paper Steerling-8B 6.1): which concepts, which input tokens and which
training chunks a prediction comes from.

Concept attribution (6.1.1, Eq. 8 and 17). At inference h_bar = k_hat + u_hat + eps exactly, so the logit of token y
at a position is a sum of one term per known concept (k_c K_c.W_y), one per unknown concept (u_j U_j.W_y) and a
residual (eps.W_y). ``concept_attribution`` returns these terms per token (``decompose`` in model.py) and, summed
over the positions of each chunk, the chunk-level Gamma of Eq. 17. The split is exact, so it is also an intervention:
setting k_c to 0 (``model(idx, edit=...)``) moves the logit by exactly minus c's known term.

Input attribution (6.1.2, Eq. 16). ``input_attribution`` scores each input token's part in one logit, either with
integrated gradients on the token embeddings (all tokens move together from the [MASK] embedding to their own; right
Riemann sum of ``steps`` points) or by occlusion (the logit lost when that one token becomes [MASK]). IG is complete
in the limit: its scores sum to logit(x) - logit(all [MASK]); what ``steps`` points leave over is reported as
``completeness_error``. Gradients need the model to start from embeddings: ``hidden_from_embeddings`` repeats
``CBLM.hidden``'s loop here, so model.py stays only the model.

Training-data attribution (6.1.3, App. B.1). The run's IVFPQ index (stage ``index``) holds the annotator's embedding
of every training chunk, a space the LM knows nothing of. A small MLP, the ``Transducer``, maps a chunk's mean-pooled
h_bar into that space (trained with 1 - cos, Eq. 34, on the chunks of the training windows), so whatever the LM
reads can be looked up in the index (``nearest_training_chunks``). ``transducer_recall`` is the self-retrieval check:
the share of held-out chunks that find themselves among their top 10. ``build_training_attribution`` does it all for
a trained model and saves the transducer to MODEL/transducer/ (safetensors weights + config.json, no pickle).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from atlas.cblm.model import CBLM, decompose

TRANSDUCER = "transducer"


@contextlib.contextmanager
def _eval(model: nn.Module):
    """Dropout off and no teacher forcing inside the block (h_bar == h); the caller's mode comes back after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _head_input(model: CBLM, h: torch.Tensor) -> torch.Tensor:
    """h_bar, what the LM head reads: the concept module's output, or h itself without one."""
    return h if model.concepts is None else model.concepts(h).h_bar


# --- concepts -------------------------------------------------------------------------------------------------------


@torch.no_grad()
def concept_attribution(model: CBLM, idx: torch.Tensor, targets: torch.Tensor,
                        chunk_rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The exact split of the logit of ``targets`` [B, T] at every position of ``idx`` [B, T].

    Per token: known [B, T, n], unknown [B, T, m], residual [B, T], logit [B, T] (their sum). Per chunk (Eq. 17):
    gamma_known [C, n], gamma_unknown [C, m], gamma_residual [C], the sums of those terms over each chunk's
    positions; ``chunk_rows`` ([B, T] or [T], values 0..C-1) gives each position's chunk, None = one chunk.
    """
    with _eval(model):
        _, parts = model(idx)
    if parts is None:
        raise ValueError("the model has no concept module (n_concepts = 0): there are no concepts to attribute to")
    terms = decompose(model, parts, targets)
    rows = torch.zeros_like(targets) if chunk_rows is None else torch.as_tensor(chunk_rows).to(targets.device)
    rows = rows.expand_as(targets).reshape(-1)
    n_chunks = int(rows.max()) + 1

    def per_chunk(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(rows.numel(), -1)
        return torch.zeros(n_chunks, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, rows, x)

    terms.update(gamma_known=per_chunk(terms["known"]), gamma_unknown=per_chunk(terms["unknown"]),
                 gamma_residual=per_chunk(terms["residual"])[:, 0])
    return terms


def top_concepts(gamma_known_row: torch.Tensor, names=None, k: int = 10) -> list[tuple]:
    """The ``k`` concepts with the largest contribution, [(name, value)] best first (index when ``names`` is None)."""
    values, order = torch.as_tensor(gamma_known_row).float().sort(descending=True)
    return [(names[i] if names is not None else i, v) for v, i in zip(values[:k].tolist(), order[:k].tolist())]


# --- input tokens ---------------------------------------------------------------------------------------------------


def hidden_from_embeddings(model: CBLM, x: torch.Tensor) -> torch.Tensor:
    """h_bar [B, T, d] from token embeddings ``x`` [B, T, d]: CBLM.hidden and the concept module, minus the lookup."""
    for block in model.blocks:
        x = block(x, model.rope_cos, model.rope_sin, model.attn_mask)
    return _head_input(model, model.norm(x))


def input_attribution(model: CBLM, idx: torch.Tensor, position: int, target: int, method: str = "ig",
                      steps: int = 16, baseline_id: int | None = None) -> tuple[torch.Tensor, dict]:
    """Each input token's part in the logit of ``target`` at ``position`` (an index into the logits: for "ar" the
    prediction of token position + 1, for "diffusion" of the token at ``position``).

    Returns (scores [T], info). ``method`` "ig": integrated gradients from the all-``baseline_id`` input (default
    [MASK]), ``steps`` points; "occlusion": logit(x) - logit(x with token i set to ``baseline_id``). info holds
    ``logit`` (of x), ``baseline_logit`` (every token the baseline) and ``completeness_error`` =
    sum(scores) - (logit - baseline_logit): near 0 for IG with enough steps, unconstrained for occlusion.
    """
    baseline_id = model.config.mask_id if baseline_id is None else baseline_id
    idx = idx.reshape(1, -1)
    target_row = model.tok_emb.weight[target].detach()

    def logit(x: torch.Tensor) -> torch.Tensor:  # the target's logit at the position, one per row of x [N, T, d]
        return hidden_from_embeddings(model, x)[:, position] @ target_row

    with _eval(model):
        with torch.no_grad():
            x = model.tok_emb(idx)
            base = model.tok_emb.weight[baseline_id].expand_as(x)
            full, empty = float(logit(x)), float(logit(base))
        if method == "ig":
            diff, grads = x - base, torch.zeros_like(x[0])
            alphas = torch.arange(1, steps + 1, dtype=x.dtype, device=x.device) / steps  # right Riemann sum
            for group in alphas.split(16):  # a few path points per forward bounds the memory
                path = (base + group[:, None, None] * diff).requires_grad_(True)
                with torch.enable_grad():
                    grads += torch.autograd.grad(logit(path).sum(), path)[0].sum(0)
            scores = (grads / steps * diff[0]).sum(-1)
        elif method == "occlusion":
            occluded = idx.repeat(idx.shape[1], 1)
            occluded.fill_diagonal_(baseline_id)  # row i: token i replaced
            with torch.no_grad():
                scores = full - logit(model.tok_emb(occluded))
        else:
            raise ValueError(f"method must be 'ig' or 'occlusion', got {method!r}")
    scores = scores.detach()
    return scores, {"logit": full, "baseline_logit": empty,
                    "completeness_error": float(scores.sum()) - (full - empty)}


# --- training data --------------------------------------------------------------------------------------------------


@torch.no_grad()
def pooled_chunk_states(model: CBLM, data, windows: np.ndarray, batch_size: int = 16,
                        device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """(chunk_rows [K], states float32 [K, d]): the mean h_bar over each chunk's input positions (the first seq_len
    tokens of each window, unmasked whatever the objective) in ``windows``; a chunk cut by a window boundary is
    pooled over its positions in both windows. Rows index ``data.chunk_ids``."""
    T = data.seq_len
    windows = torch.as_tensor(np.asarray(windows), dtype=torch.int64)
    chunks, local = torch.unique(data.chunk_rows[windows, :T], return_inverse=True)
    sums = torch.zeros(len(chunks), model.config.d_model, dtype=torch.float64)
    counts = torch.zeros(len(chunks), dtype=torch.float64)
    with _eval(model):
        for start in range(0, len(windows), batch_size):
            ids = windows[start:start + batch_size]
            h_bar = _head_input(model, model.hidden(data.windows[ids, :T].to(device)))
            where = local[start:start + batch_size].reshape(-1)
            sums.index_add_(0, where, h_bar.reshape(where.numel(), -1).double().cpu())
            counts.index_add_(0, where, torch.ones(where.numel(), dtype=torch.float64))
    return chunks.numpy(), (sums / counts[:, None]).float().numpy()


class Transducer(nn.Module):
    """LM space -> annotator space: d -> hidden -> hidden -> d_index (GELU), unit-length output (the index is
    searched by inner product on unit vectors, i.e. by cosine).

    Inputs are standardized with the training states' per-dimension mean and std (buffers, saved with the weights):
    pooled states share a large common part and differ by little (on runs/demo, per-dimension std ~0.01 of the
    norm), and without this the MLP learns only the mean target (recall@10 at chance)."""

    def __init__(self, d_in: int, d_out: int, hidden: int = 256):
        super().__init__()
        self.config = {"d_in": d_in, "d_out": d_out, "hidden": hidden}
        self.register_buffer("shift", torch.zeros(d_in))
        self.register_buffer("scale", torch.ones(d_in))
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net((x - self.shift) / self.scale), dim=-1)


def _tensor(x, device: str = "cpu") -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.float32), device=device)


@torch.no_grad()
def mean_cos(transducer: Transducer, states: np.ndarray, targets: np.ndarray) -> float:
    """Mean cosine between the transduced ``states`` and ``targets``."""
    device = next(transducer.parameters()).device
    return float((transducer(_tensor(states, device)) * F.normalize(_tensor(targets, device), dim=-1)).sum(-1).mean())


def train_transducer(states: np.ndarray, targets: np.ndarray, hidden: int = 256, steps: int = 1000, lr: float = 1e-3,
                     batch_size: int = 256, seed: int = 0, device: str = "cpu") -> Transducer:
    """Fit a ``Transducer`` from ``states`` [N, d] to ``targets`` [N, d_index] (annotator embeddings of the same
    chunks) with the loss 1 - cos (Eq. 34), AdamW on seeded random minibatches."""
    x, y = _tensor(states, device), F.normalize(_tensor(targets, device), dim=-1)
    with torch.random.fork_rng(devices=[]):  # seeded init without moving the caller's random state
        torch.manual_seed(seed)
        transducer = Transducer(x.shape[1], y.shape[1], hidden).to(device)
    transducer.shift.copy_(x.mean(0))
    transducer.scale.copy_(x.std(0, unbiased=False).clamp_min(1e-6))  # a constant dimension stays 0, not NaN
    optimizer = torch.optim.AdamW(transducer.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    transducer.train()
    for _ in range(steps):
        batch = torch.randint(len(x), (min(batch_size, len(x)),), generator=generator).to(device)
        loss = 1 - (transducer(x[batch]) * y[batch]).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return transducer.eval()


def save_transducer(folder: str | Path, transducer: Transducer) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in transducer.state_dict().items()},
              folder / "transducer.safetensors")
    (folder / "config.json").write_text(json.dumps(transducer.config))


def load_transducer(folder: str | Path, device: str = "cpu") -> Transducer:
    folder = Path(folder)
    transducer = Transducer(**json.loads((folder / "config.json").read_text()))
    transducer.load_state_dict(load_file(folder / "transducer.safetensors", device=device))
    return transducer.to(device).eval()


def nearest_training_chunks(run_dir: str | Path, transducer: Transducer, states: np.ndarray, k: int = 10,
                            nprobe: int = 16, index_folder: str | Path | None = None) -> list[list[tuple[str, float]]]:
    """The ``k`` training chunks nearest to each transduced state [Q, d], [(chunk_id, cosine)] best first, from the
    run's index (RUN/index unless ``index_folder``); index row i is row i of RUN/embeddings.zarr."""
    from atlas.core.rundir import RunDir
    from atlas.io import layout
    from atlas.io.embedding_store import stored_ids
    from atlas.models.ivfpq import load_index, search

    folder = Path(index_folder) if index_folder else RunDir(run_dir).output_dir(layout.INDEX)
    index = load_index(folder, nprobe=nprobe)
    device = next(transducer.parameters()).device
    with torch.no_grad():
        queries = transducer(_tensor(states, device)).cpu().numpy()
    scores, rows = search(index, queries, k)
    chunk_ids = stored_ids(run_dir)  # checked: a store whose ids were deleted is an error, not empty ids
    return [[(str(chunk_ids[r]), float(s)) for s, r in zip(score_row, row) if r >= 0]
            for score_row, row in zip(scores, rows)]


def chunk_documents(run_dir: str | Path, chunk_ids) -> dict[str, str]:
    """The document (doc_id) of each of ``chunk_ids``, from the run's embeddings store, the record of every chunk
    that ``nearest_training_chunks`` reads its results from; {} when the run has no store (no annotate stage)."""
    from atlas.io.embedding_store import open_embeddings

    try:
        store = open_embeddings(run_dir)
    except FileNotFoundError:
        return {}
    wanted = set(chunk_ids)
    return {str(c): str(d) for c, d in zip(store["chunk_id"][:], store["doc_id"][:]) if c in wanted}


def transducer_recall(run_dir: str | Path, transducer: Transducer, states: np.ndarray, chunk_ids: list[str],
                      k: int = 10, nprobe: int = 16, index_folder: str | Path | None = None) -> float:
    """Self-retrieval: the share of chunks (states [Q, d], their ``chunk_ids``) found among their own top ``k``."""
    found = nearest_training_chunks(run_dir, transducer, states, k, nprobe, index_folder)
    return float(np.mean([cid in {c for c, _ in hits} for cid, hits in zip(chunk_ids, found)]))


def transducer_key(run_dir: str | Path, model_folder: str | Path, settings: dict) -> str:
    """What a fitted transducer depends on: the model's weights (sha256 of its checkpoint), the fitting settings and
    the index it maps into (the run's annotate and index stage hashes)."""
    from atlas.core.rundir import RunDir

    stages = RunDir(run_dir).read_manifest().get("stages", {})
    upstream = {name: stages.get(name, {}).get("hash") for name in ("annotate", "index")}
    return hashlib.sha256(json.dumps([checkpoint_digest(model_folder), settings, upstream],
                                     sort_keys=True).encode()).hexdigest()


def checkpoint_digest(model_folder: str | Path) -> str:
    """sha256 of the weights of the model in ``model_folder``: what a result derived from the model depends on."""
    from atlas.cblm import checkpoint

    found = checkpoint.find(Path(model_folder))
    if found is None:
        raise FileNotFoundError(f"{model_folder}: no checkpoint; train the model first (atlas cblm train RUN)")
    digest = hashlib.sha256()
    with open(found / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_training_attribution(run_dir: str | Path, model_folder: str | Path, hidden: int = 256, steps: int = 1000,
                               lr: float = 1e-3, batch_size: int = 16, nprobe: int = 16, seed: int = 0,
                               device: str = "cpu", index_folder: str | Path | None = None,
                               force: bool = False) -> dict:
    """Train the transducer of the model in ``model_folder`` (RUN/cblm/<name>) on the pooled states of the chunks
    of its training windows, save it to ``model_folder/transducer/`` and score it on the held-out chunks (those of
    the validation windows that no training window touches).

    ``transducer/fit.json`` records the fit's key (``transducer_key``: checkpoint, settings, index) and its scores:
    when the key is unchanged the saved transducer is kept and its scores are returned with ``reused`` True (no
    refit), unless ``force``."""
    from atlas.cblm import checkpoint
    from atlas.cblm.data import TokenData
    from atlas.io.embedding_store import open_embeddings, stored_ids

    folder = Path(model_folder) / TRANSDUCER
    settings = {"hidden": hidden, "steps": steps, "lr": lr, "batch_size": batch_size, "nprobe": nprobe, "seed": seed,
                "index_folder": str(index_folder) if index_folder else None}
    key = transducer_key(run_dir, model_folder, settings)
    fit = folder / "fit.json"
    if not force and fit.exists() and (folder / "transducer.safetensors").exists():
        saved = json.loads(fit.read_text())
        if saved.get("key") == key:
            return saved["result"] | {"key": key[:12], "reused": True}
    fit.unlink(missing_ok=True)  # a fit interrupted from here on leaves no record that claims it

    model, state = checkpoint.load(Path(model_folder), device)
    data = TokenData(run_dir, model.config.seq_len, state["train_config"]["val_fraction"], vocab=state["vocab"])
    store = open_embeddings(run_dir)
    row_of = {cid: i for i, cid in enumerate(stored_ids(run_dir).tolist())}

    def aligned(windows: np.ndarray, skip: set) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Pooled states, annotator embeddings and chunk ids of the chunks in ``windows`` that have an embedding."""
        rows, states = pooled_chunk_states(model, data, windows, batch_size, device)
        keep = [i for i, r in enumerate(rows) if data.chunk_ids[r] in row_of and r not in skip]
        ids = [data.chunk_ids[rows[i]] for i in keep]
        store_rows = np.asarray([row_of[c] for c in ids], dtype=np.int64)
        order = np.argsort(store_rows)  # zarr reads sorted rows; put them back in our order
        targets = np.empty((len(ids), store["embeddings"].shape[1]), dtype=np.float32)
        targets[order] = store["embeddings"].get_orthogonal_selection((store_rows[order], slice(None)))
        return states[keep], targets, ids

    train_states, train_targets, train_ids = aligned(data.train_windows, set())
    train_rows = {int(r) for r in np.unique(data.chunk_rows[data.train_windows, :data.seq_len].numpy())}
    val_states, val_targets, val_ids = aligned(data.val_windows, train_rows)
    transducer = train_transducer(train_states, train_targets, hidden, steps, lr, seed=seed, device=device)
    save_transducer(folder, transducer)
    result = {"train_chunks": len(train_ids), "val_chunks": len(val_ids),
              "recall_at_10": transducer_recall(run_dir, transducer, val_states, val_ids, 10, nprobe, index_folder)
              if val_ids else float("nan"),
              "mean_cos_val": mean_cos(transducer, val_states, val_targets) if val_ids else float("nan"),
              "mean_cos_train": mean_cos(transducer, train_states, train_targets)}
    tmp = fit.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "settings": settings, "result": result}, indent=2))
    tmp.rename(fit)
    return result | {"key": key[:12], "reused": False}
