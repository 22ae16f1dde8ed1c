"""Training windows from a run's token shards (written by the ``tokenize`` stage), in a compact vocabulary.

The tokenize stage writes, per shard, a uint32 token stream and an index with each chunk's span
[token_start, token_end) in the stream and its concept ids, read here through ``atlas.io.tokens.TokenShards``.
Spans tile the stream, so every token belongs to exactly one chunk. ``TokenData`` cuts each stream into
windows of ``seq_len + 1`` tokens (AR inputs are the first seq_len, targets the last seq_len) and
keeps, for every token, the row of its chunk, so a batch comes with the multi-hot concepts of the chunks it touches.

The last ``val_fraction`` of each shard's windows is held out: the windows are contiguous, so this keeps all but
one boundary document out of training.

Compact vocabulary: a cl100k_base embedding table (100,281 rows) would dwarf a toy model, so by default the model's
vocabulary is the sorted set of ids present in the shards plus the special tokens; ``vocab[i]`` is the cl100k id of
model id ``i``, so outputs decode with cl100k_base as they are. Everything is held in memory: a toy corpus of a few
million tokens takes tens of MB.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from atlas.core.files import InputError
from atlas.io import layout
from atlas.io.tokens import TokenShards
from atlas.models.tokenizer import BOS, ENDOFTEXT, EOC, MASK, PAD, VOCAB_SIZE

SPECIAL_IDS = (ENDOFTEXT, PAD, BOS, EOC, MASK)


@dataclass
class Batch:
    tokens: torch.Tensor  # int64 [B, seq_len + 1], model vocabulary
    chunk_rows: torch.Tensor  # int64 [B, seq_len + 1]: index into ``labels``
    labels: torch.Tensor  # float [C, n]: multi-hot concepts of the C chunks the batch touches

    def known_target(self, length: int) -> torch.Tensor:
        """[B, length, n]: each of the first ``length`` positions' chunk concepts."""
        return self.labels[self.chunk_rows[:, :length]]

    def to(self, device: str) -> Batch:
        return Batch(self.tokens.to(device), self.chunk_rows.to(device), self.labels.to(device))


class TokenData:
    def __init__(self, run_dir: str | Path, seq_len: int, val_fraction: float = 0.1, compact_vocab: bool = True,
                 vocab: np.ndarray | None = None):
        shards = TokenShards(run_dir)
        folder = shards.run.output_dir(layout.TOKENS)
        self.n_concepts = shards.n_concepts
        self.seq_len = seq_len

        windows, chunk_rows, concept_lists, train, val = [], [], [], [], []
        self.chunk_ids: list[str] = []
        for shard in range(len(shards.parts)):
            # Windows of seq_len + 1 tokens every seq_len: they overlap by one token,
            # targets are inputs shifted by one.
            tokens, rows, index = shards.shard_windows(shard, seq_len + 1, stride=seq_len)
            rows = rows + len(self.chunk_ids)
            self.chunk_ids += index["chunk_id"]
            concept_lists += index["concepts"]
            count = len(tokens)
            if count == 0:
                continue
            n_val = int(round(count * val_fraction)) if count > 1 else 0
            offset = sum(len(w) for w in windows)
            train.append(offset + np.arange(count - n_val))
            val.append(offset + np.arange(count - n_val, count))
            windows.append(tokens)
            chunk_rows.append(rows)
        if not windows:
            raise InputError(f"{folder}: fewer than {seq_len + 1} tokens in every shard; lower seq_len")
        cl100k_windows = np.concatenate(windows)
        if vocab is None:
            used = np.unique(cl100k_windows) if compact_vocab else np.arange(VOCAB_SIZE)
            vocab = np.union1d(used, np.asarray(SPECIAL_IDS))
        self.vocab = np.asarray(vocab, dtype=np.int64)
        model_ids = np.searchsorted(self.vocab, cl100k_windows)
        if np.any(model_ids >= len(self.vocab)) or np.any(self.vocab[np.minimum(model_ids, len(self.vocab) - 1)]
                                                          != cl100k_windows):
            raise ValueError(f"{folder}: the shards hold token ids that are not in this model's vocabulary")
        self.windows = torch.from_numpy(model_ids)
        self.chunk_rows = torch.from_numpy(np.concatenate(chunk_rows))
        self.train_windows, self.val_windows = np.concatenate(train), np.concatenate(val)
        # Concepts as CSR over chunks: a dense [chunks, n] matrix would not scale with the library.
        self.concept_ptr = np.cumsum([0] + [len(c) for c in concept_lists])
        self.concept_ids = np.asarray([c for cs in concept_lists for c in cs], dtype=np.int64)

    def log_unigram(self, smoothing: float = 0.5) -> torch.Tensor:
        """[vocab] log frequency of each token in the training windows (add-``smoothing`` counts)."""
        counts = np.bincount(self.windows[self.train_windows].reshape(-1).numpy(), minlength=self.vocab_size)
        counts = counts.astype(np.float64) + smoothing
        return torch.from_numpy(np.log(counts / counts.sum())).float()

    def chunk_concepts(self):
        """[chunks, n] scipy CSR matrix: 1 where a chunk is annotated with a concept."""
        from scipy import sparse

        return sparse.csr_matrix((np.ones(len(self.concept_ids), dtype=np.float32), self.concept_ids,
                                  self.concept_ptr), shape=(len(self.concept_ptr) - 1, self.n_concepts))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def model_id(self, cl100k_id: int) -> int:
        return int(np.searchsorted(self.vocab, cl100k_id))

    def chunk_labels(self, rows: np.ndarray) -> torch.Tensor:
        """Multi-hot [len(rows), n] of the chunks at ``rows``."""
        labels = torch.zeros(len(rows), self.n_concepts)
        for i, row in enumerate(rows):
            labels[i, self.concept_ids[self.concept_ptr[row]:self.concept_ptr[row + 1]]] = 1.0
        return labels

    def batch(self, window_ids: np.ndarray) -> Batch:
        window_ids = torch.as_tensor(np.asarray(window_ids), dtype=torch.int64)
        rows = self.chunk_rows[window_ids]
        unique, local = torch.unique(rows, return_inverse=True)
        return Batch(self.windows[window_ids], local, self.chunk_labels(unique.numpy()))

    def train_batch(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        """The window ids of training step ``step``: epochs of seeded permutations, so a step's batch depends only on
        (step, batch size, seed) and a resumed run sees exactly the batches an uninterrupted one would."""
        n = len(self.train_windows)
        first = step * batch_size
        epoch, ids = first // n, []
        while len(ids) < batch_size:
            order = np.random.default_rng([seed, epoch]).permutation(n)
            start = first - epoch * n if not ids else 0
            ids.extend(order[start:start + batch_size - len(ids)].tolist())
            epoch += 1
        return self.train_windows[np.asarray(ids)]


def lifted_tokens(data: TokenData, top: int = 20, min_support: int = 5, with_lift: bool = False) -> list:
    """Per concept, the model-vocabulary ids of its ``top`` tokens by lift P(token | c) / P(token), over the
    training windows' tokens (a token needs ``min_support`` occurrences in the concept's chunks; special tokens are
    left out): the lifted set T_c of paper 4.4 and 10.2.4. Concepts with no chunk get an empty array.
    ``with_lift``: (ids, lifts) pairs instead of ids."""
    from scipy import sparse

    tokens = data.windows[data.train_windows, :-1].reshape(-1).numpy()
    rows = data.chunk_rows[data.train_windows, :-1].reshape(-1).numpy()
    n_chunks, vocab = len(data.concept_ptr) - 1, data.vocab_size
    chunk_tokens = sparse.csr_matrix((np.ones(len(tokens), dtype=np.float32), (rows, tokens)), shape=(n_chunks, vocab))
    concept_tokens = (data.chunk_concepts().T @ chunk_tokens).tocsr()  # [n, vocab]: token counts in c's chunks
    overall = np.asarray(chunk_tokens.sum(0)).ravel()
    p_token = overall / max(overall.sum(), 1.0)
    special = np.searchsorted(data.vocab, np.asarray(SPECIAL_IDS))
    lifted = []
    for c in range(data.n_concepts):
        row = concept_tokens.getrow(c)
        ids, counts = row.indices, row.data
        keep = (counts >= min_support) & ~np.isin(ids, special)
        ids, counts = ids[keep], counts[keep]
        if len(ids) == 0:
            lifted.append((np.zeros(0, dtype=np.int64), np.zeros(0)) if with_lift else np.zeros(0, dtype=np.int64))
            continue
        lift = (counts / counts.sum()) / p_token[ids]
        order = np.argsort(-lift, kind="stable")[:top]
        best = ids[order].astype(np.int64)
        lifted.append((best, lift[order]) if with_lift else best)
    return lifted


class SteeringData:
    """Token-level concept data for steering training (paper 10.2.4: "each token is tagged only with the concepts
    attributed to it"; how the paper made its 400M tokens is not said). Our choice: a predicted token is attributed
    to concept c when it belongs to c's lifted set T_c (its ``top`` most lifted tokens) and its chunk is annotated
    with c; when several of the chunk's concepts claim it, the one in whose T_c it has the highest lift.

    ``lifted_ids`` [n, top] holds each T_c (padded with -1) for the L_express softmax mass."""

    def __init__(self, data: TokenData, top: int = 50, min_support: int = 5):
        from scipy import sparse

        self.top = top
        lifted = lifted_tokens(data, top, min_support, with_lift=True)
        self.lifted_ids = torch.full((data.n_concepts, top), -1, dtype=torch.int64)
        rows, cols, lifts = [], [], []
        for c, (ids, lift) in enumerate(lifted):
            self.lifted_ids[c, :len(ids)] = torch.from_numpy(ids)
            rows.append(ids)
            cols.append(np.full(len(ids), c))
            lifts.append(lift)
        # token-major [vocab, n]: the lift of each (token, concept) pair with the token in T_c, else 0
        self.lift = sparse.csr_matrix((np.concatenate(lifts).astype(np.float32),
                                       (np.concatenate(rows), np.concatenate(cols))),
                                      shape=(data.vocab_size, data.n_concepts))
        self.supported = int(sum(len(ids) > 0 for ids, _ in lifted))

    def concepts_at(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[B, T] concept attributed to each predicted token ``tokens`` [B, T] whose chunk concepts are ``labels``
        [B, T, n] (multi-hot), or -1 where none is."""
        lift = torch.from_numpy(self.lift[tokens.reshape(-1).cpu().numpy()].toarray()).view(*tokens.shape, -1)
        score = lift.to(labels.device) * labels
        best, concept = score.max(-1)
        return torch.where(best > 0, concept, torch.full_like(concept, -1))
