"""Training data: token sources and the step-indexed, world-size-independent batch order.

Elastic training needs the data order to depend on the step only (design.md, "Elastic
semantics"): the global batch of step s is a pure function of (seed, s), and rank r of W
takes a contiguous slice of it, so any world size covers exactly the same samples and a
step redone after a failure sees the same ones. A sample is window i of the token stream
(``seq_len + 1`` tokens, inputs plus shifted targets) and its id is i.

Sources, none of which downloads anything at run time:
- ``generated``: a synthetic corpus made on the fly from a seed (see ``generate_corpus``);
  it is not natural text, only a learnable stream for demos and tests;
- a local file, memory-mapped: ``.txt`` (UTF-8 bytes are the tokens, vocabulary 256),
  ``.bin`` (raw uint16 tokens, the nanoGPT convention) or ``.npy`` (a 1-D integer array);
- ``hf:NAME[:CONFIG]``: a Hugging Face dataset's ``text`` column, for users with network
  access; it is fetched once, byte-encoded and cached as a local ``.txt`` file.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lazarus_core.runtime_config import DataConfig


def generate_corpus(num_tokens: int, vocab: int, seed: int) -> np.ndarray:
    """A synthetic token stream with structure a small model can learn quickly.

    Random choices from a bank of 256 random 16-token phrases: once a phrase has started,
    its remaining tokens are predictable, so the loss falls well below log(vocab) in a few
    steps and training progress is visible in demos and tests.
    """
    rng = np.random.default_rng(seed)
    bank = rng.integers(0, vocab, size=(256, 16))
    picks = rng.integers(0, len(bank), size=-(-num_tokens // 16))
    return bank[picks].reshape(-1)[:num_tokens]


def open_tokens(source: str, vocab: int, seed: int, generated_tokens: int,
                cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """The 1-D token array of a source (memory-mapped for files)."""
    if source == "generated":
        return _generated(generated_tokens, vocab, seed)
    if source.startswith("hf:"):
        return open_tokens(str(_fetch_hf(source[3:], cache_dir)), vocab, seed, generated_tokens)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"dataset: {source!r} is not 'generated', 'hf:NAME' or an existing file")
    if path.suffix == ".txt":
        tokens = np.memmap(path, dtype=np.uint8, mode="r")
        limit = 256
    elif path.suffix == ".bin":
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        limit = vocab
    elif path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"dataset: {source} must hold a 1-D integer array")
        limit = vocab
    else:
        raise ValueError(f"dataset: unsupported file type {path.suffix!r}; use .txt, .bin or .npy")
    if limit > vocab:
        raise ValueError(f"vocab: {source} is byte-level and needs vocab >= 256, got {vocab}")
    return tokens


@functools.lru_cache(maxsize=4)
def _generated(num_tokens: int, vocab: int, seed: int) -> np.ndarray:
    return generate_corpus(num_tokens, vocab, seed)


def _fetch_hf(spec: str, cache_dir) -> Path:
    name, _, subset = spec.partition(":")
    cache = Path(cache_dir or Path.home() / ".cache" / "lazarus" / "datasets")
    path = cache / f"{name.replace('/', '__')}__{subset or 'default'}.txt"
    if not path.exists():
        try:
            import datasets  # only users who ask for hf: need it (and network)
        except ImportError:
            raise ValueError("dataset: hf: sources need the 'datasets' package "
                             "(pip install datasets)") from None
        rows = datasets.load_dataset(name, subset or None, split="train")
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(row["text"])
        tmp.replace(path)
    return path


@dataclass(frozen=True)
class Batch:
    """One rank's share of a step: sample ids and their (input, target) token windows."""

    sample_ids: torch.Tensor  # (B,) int64
    inputs_BS: torch.Tensor   # (B, S) int64
    targets_BS: torch.Tensor  # (B, S) int64


class StepBatches:
    """Maps (step, rank, world size) to that rank's samples of the step's global batch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"dataset: {len(tokens)} tokens cannot fill one sample of "
                             f"seqLen {seq_len}")

    @classmethod
    def from_config(cls, data: DataConfig, seq_len: int, vocab: int) -> "StepBatches":
        tokens = open_tokens(data.source, vocab, data.seed, data.generated_tokens)
        return cls(tokens, seq_len, data.global_batch, data.seed)

    def global_sample_ids(self, step: int) -> np.ndarray:
        """Sample ids of step ``step``: consecutive positions of per-epoch permutations."""
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        epochs, offsets = np.divmod(positions, self.num_samples)
        return np.array([self._epoch_order(int(ep))[off] for ep, off in zip(epochs, offsets)],
                        dtype=np.int64)

    @functools.lru_cache(maxsize=2)
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)

    def shard(self, rank: int, world_size: int) -> slice:
        """Rank ``rank``'s contiguous slice of a global batch: shares differ by at most one."""
        if world_size > self.global_batch:
            raise ValueError(f"globalBatch: {self.global_batch} samples cannot be shared by "
                             f"{world_size} ranks; use globalBatch >= workers")
        return slice(rank * self.global_batch // world_size,
                     (rank + 1) * self.global_batch // world_size)

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        ids = self.global_sample_ids(step)[self.shard(rank, world_size)]
        windows = np.stack([np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1],
                                       dtype=np.int64) for i in ids])
        windows = torch.from_numpy(windows)
        return Batch(torch.from_numpy(ids), windows[:, :-1], windows[:, 1:])
