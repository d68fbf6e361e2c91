"""ReMax's baseline and dynamic sampling's cut go by prompt group (``uid``), not by ``n`` rows a
prompt: a split agent-program episode gives its group a row per trajectory."""

import numpy as np
import pytest
import torch

from verl.protocol import Batch
from verl.trainer.step.ops import first_groups
from verl.trainer.step.pieces import baseline_per_row


def _batch(uids):
    return Batch.from_dict(tensors={"row": torch.arange(len(uids))}, non_tensors={"uid": np.array(uids, dtype=object)})


def test_remax_baseline_follows_the_group_not_n_rows():
    baseline = torch.tensor([10.0, 20.0, 30.0])
    # n = 2; the second prompt's first episode was split into two trajectories: 3 rows.
    uids = ["p0", "p0", "p1", "p1", "p1", "p2", "p2"]
    assert baseline_per_row(baseline, uids).tolist() == [10.0, 10.0, 20.0, 20.0, 20.0, 30.0, 30.0]
    # Unsplit, it is exactly repeat_interleave(n).
    plain = ["a", "a", "b", "b", "c", "c"]
    assert torch.equal(baseline_per_row(baseline, plain), baseline.repeat_interleave(2))


def test_remax_baseline_refuses_a_count_mismatch():
    with pytest.raises(ValueError, match="2 greedy baselines for 3 prompt groups"):
        baseline_per_row(torch.tensor([1.0, 2.0]), ["a", "b", "c"])


def test_dynamic_sampling_keeps_whole_groups():
    # want = 2 groups, n = 2; group g1 has 3 rows: a cut at want * n = 4 rows would split it.
    batch = _batch(["g0", "g0", "g1", "g1", "g1", "g2", "g2"])
    kept = first_groups(batch, 2)
    assert list(kept.non_tensors["uid"]) == ["g0", "g0", "g1", "g1", "g1"]
    assert kept["row"].tolist() == [0, 1, 2, 3, 4]
    assert len(first_groups(_batch(["a", "a", "b", "b"]), 2)) == 4
