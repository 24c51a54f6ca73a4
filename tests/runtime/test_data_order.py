"""The data order depends on the step alone, so any world size trains on the same samples."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lazarus_core.runtime_config import DataConfig
from lazarus_runtime.data import StepBatches, generate_corpus, open_tokens

SEQ = 16


def batches(global_batch=12, seed=3, tokens=None) -> StepBatches:
    tokens = generate_corpus(5_000, 256, seed=1) if tokens is None else tokens
    return StepBatches(tokens, SEQ, global_batch, seed)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 7, 12])
def test_every_world_size_covers_the_same_samples_once(world_size):
    data = batches()
    for step in (0, 1, 17, 40):  # 40 crosses into later epochs (311 samples per epoch)
        shards = [data.batch(step, r, world_size) for r in range(world_size)]
        ids = torch.cat([b.sample_ids for b in shards]).tolist()
        assert ids == data.global_sample_ids(step).tolist()
        inputs = torch.cat([b.inputs_BS for b in shards])
        np.testing.assert_array_equal(inputs, data.batch(step, 0, 1).inputs_BS)


def test_a_sample_is_its_window_of_the_stream_and_targets_are_shifted():
    data = batches()
    b = data.batch(5, 1, 3)
    for i, sid in enumerate(b.sample_ids.tolist()):
        window = data.tokens[sid * SEQ: sid * SEQ + SEQ + 1]
        np.testing.assert_array_equal(b.inputs_BS[i], window[:-1])
        np.testing.assert_array_equal(b.targets_BS[i], window[1:])


def test_order_is_a_pure_function_of_seed_and_step():
    a, b = batches(seed=3), batches(seed=3)
    assert [a.global_sample_ids(s).tolist() for s in (9, 2, 9)] == \
           [b.global_sample_ids(s).tolist() for s in (9, 2, 9)]
    assert batches(seed=4).global_sample_ids(2).tolist() != a.global_sample_ids(2).tolist()


def test_each_epoch_visits_every_sample_once():
    data = batches(global_batch=10, tokens=generate_corpus(50 * SEQ + 1, 256, seed=0))
    ids = np.concatenate([data.global_sample_ids(s) for s in range(5)])
    assert sorted(ids.tolist()) == list(range(50))


def test_more_ranks_than_samples_is_a_clear_error():
    with pytest.raises(ValueError, match="globalBatch"):
        batches(global_batch=2).batch(0, 0, 3)


def test_local_files_are_memory_mapped(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello lazarus " * 100)
    tokens = open_tokens(str(text), vocab=256, seed=0, generated_tokens=0)
    assert isinstance(tokens, np.memmap) and bytes(tokens[:5]) == b"hello"
    ids = tmp_path / "corpus.bin"
    np.arange(1000, dtype=np.uint16).tofile(ids)
    assert open_tokens(str(ids), vocab=1000, seed=0, generated_tokens=0)[999] == 999
    with pytest.raises(ValueError, match="vocab"):
        open_tokens(str(text), vocab=100, seed=0, generated_tokens=0)
    with pytest.raises(ValueError, match="dataset"):
        open_tokens(str(tmp_path / "missing.txt"), vocab=256, seed=0, generated_tokens=0)


def test_from_config_uses_the_generated_corpus_by_default():
    data = StepBatches.from_config(DataConfig(global_batch=4, generated_tokens=3_000), SEQ, 256)
    assert data.num_samples == (3_000 - 1) // SEQ
    assert data.batch(0, 0, 1).inputs_BS.shape == (4, SEQ)


def test_hugging_face_datasets_are_fetched_once_and_cached_as_bytes(tmp_path, monkeypatch):
    # A stand-in for the optional `datasets` package: no network in tests.
    calls = []

    class FakeDatasets:
        @staticmethod
        def load_dataset(name, subset, split):
            calls.append((name, subset, split))
            return [{"text": "ab"}, {"text": "c"}]

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    monkeypatch.setattr(Path, "home", lambda: tmp_path)
    for _ in range(2):
        tokens = open_tokens("hf:org/wiki:raw", vocab=256, seed=0, generated_tokens=0)
        assert bytes(tokens) == b"abc"
    assert calls == [("org/wiki", "raw", "train")]
