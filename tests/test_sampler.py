"""Sampler: windows come from the right shard, weights are followed, state restores exactly."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from engine.data.sampler import Sampler
from engine.data.shards import open_shard, write_shard
from engine.errors import UserError

SHA = hashlib.sha256(b"t").hexdigest()
SIZES = [500, 1200, 40]  # shard k holds base[k] + arange(size): a token says where it came from
BASES = [0, 1000, 3000]
T = 16


@pytest.fixture
def shards(tmp_path):
    out = []
    for k, (base, n) in enumerate(zip(BASES, SIZES, strict=True)):
        path = tmp_path / f"{k}.bin"
        write_shard(path, np.arange(base, base + n, dtype=np.uint16), 8449, SHA)
        out.append(open_shard(path))
    return out


def test_rows_are_contiguous_windows_of_their_source(shards):
    s = Sampler(shards, T, seed=1)
    tokens, src = s.sample(64, np.array([0.3, 0.3, 0.4]))
    assert tokens.shape == (64, T + 1) and tokens.dtype == np.int32 and src.dtype == np.int32
    for row, k in zip(tokens, src, strict=True):
        start = row[0] - BASES[k]
        assert 0 <= start <= SIZES[k] - (T + 1)
        np.testing.assert_array_equal(row, np.arange(row[0], row[0] + T + 1))


def test_every_start_is_reachable(shards):
    s = Sampler(shards, T, seed=2)
    starts = set()
    for _ in range(50):
        tokens, _ = s.sample(8, np.array([0.0, 0.0, 1.0]))
        starts.update((tokens[:, 0] - BASES[2]).tolist())
    assert starts == set(range(SIZES[2] - T))  # 40 tokens: starts 0..23


def test_weights_are_followed(shards):
    s = Sampler(shards, T, seed=3)
    _, src = s.sample(20000, np.array([0.1, 0.6, 0.3]))
    freq = np.bincount(src, minlength=3) / len(src)
    np.testing.assert_allclose(freq, [0.1, 0.6, 0.3], atol=0.015)
    _, src = s.sample(100, np.array([0.0, 1.0, 0.0]))
    assert set(src.tolist()) == {1}


def test_same_seed_same_batches_other_seed_differs(shards):
    w = np.array([0.2, 0.5, 0.3])
    a, b, c = Sampler(shards, T, 5), Sampler(shards, T, 5), Sampler(shards, T, 6)
    for _ in range(3):
        ta, sa = a.sample(8, w)
        tb, sb = b.sample(8, w)
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(sa, sb)
    assert not np.array_equal(a.sample(8, w)[0], c.sample(8, w)[0])


def test_state_round_trip_through_json(shards):
    w = np.array([0.2, 0.5, 0.3])
    a = Sampler(shards, T, 9)
    for _ in range(4):
        a.sample(8, w)
    state = json.loads(json.dumps(a.state_dict()))
    b = Sampler(shards, T, 12345)
    b.load_state_dict(state)
    for _ in range(5):
        ta, sa = a.sample(8, w)
        tb, sb = b.sample(8, w)
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(sa, sb)


def test_state_for_other_shape_is_refused(shards):
    state = Sampler(shards, T, 1).state_dict()
    with pytest.raises(UserError, match="seq_len 32"):
        Sampler(shards, 32, 1).load_state_dict(state)


def test_shard_shorter_than_a_window(shards):
    with pytest.raises(UserError, match="at least seq_len\\+1 = 41 tokens, got 40"):
        Sampler(shards, 40, 1)


def test_bad_weights(shards):
    s = Sampler(shards, T, 1)
    for w in ([0.5, 0.5], [0.5, -0.1, 0.6], [np.nan, 0.5, 0.5], [0, 0, 0]):
        with pytest.raises(ValueError, match="weights"):
            s.sample(4, np.array(w))
