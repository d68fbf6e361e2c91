"""Single-process tests of ``verl.protocol.Batch``: construction, indexing and every operation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.protocol import Batch


def make_batch(n: int = 4, t: int = 3) -> Batch:
    """Rows whose values encode their row number, so any reordering is visible in the expectations."""
    rows = torch.arange(n)
    return Batch.from_dict(
        tensors={
            "input_ids": rows[:, None] * 10 + torch.arange(t),  # [B, T] int64
            "attention_mask": torch.ones(n, t, dtype=torch.bool),  # [B, T]
            "old_log_probs": -rows[:, None].float().expand(n, t).contiguous() / 10,  # [B, T] float32
            "scores": rows.to(torch.bfloat16),  # [B]
        },
        non_tensors={
            "uid": [f"p{i}" for i in range(n)],
            "reward_model": [{"ground_truth": str(i), "style": "rule"} for i in range(n)],
        },
        meta_info={"temperature": 0.7, "global_step": 3},
    )


def uids(batch: Batch) -> list[str]:
    return list(batch["uid"])


# ---------------------------------------------------------------------- construction


def test_from_dict_and_len():
    batch = make_batch(5)
    assert len(batch) == 5 and batch.batch_size == 5
    assert batch.keys() == ["input_ids", "attention_mask", "old_log_probs", "scores", "uid", "reward_model"]
    assert batch["uid"].dtype == object and batch["uid"].shape == (5,)
    assert "uid" in batch and "nope" not in batch
    assert batch.meta_info == {"temperature": 0.7, "global_step": 3}


def test_list_of_lists_becomes_one_dim_object_column():
    # np.array would make this [2, 2] (or fail for ragged rows); a column must stay [B].
    batch = Batch.from_dict(non_tensors={"msgs": [["a", "b"], ["c", "d"]], "ragged": [[1], [2, 3]]})
    assert batch["msgs"].shape == (2,) and batch["msgs"][1] == ["c", "d"]
    assert batch["ragged"][1] == [2, 3]


def test_batch_size_mismatch_names_key_and_sizes():
    with pytest.raises(ValueError, match=r"tensors\['responses'\] has 3 rows.*tensors\['input_ids'\] has 4"):
        Batch.from_dict(tensors={"input_ids": torch.zeros(4, 2), "responses": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"non_tensors\['uid'\] has 2 rows.*tensors\['x'\] has 4"):
        Batch.from_dict(tensors={"x": torch.zeros(4)}, non_tensors={"uid": ["a", "b"]})
    with pytest.raises(ValueError, match=r"tensors\['x'\] has 4 rows.*batch_size is 3"):
        Batch.from_dict(tensors={"x": torch.zeros(4)}, batch_size=3)


def test_construction_rejects_wrong_types():
    with pytest.raises(ValueError, match=r"tensors\['x'\] is a ndarray"):
        Batch.from_dict(tensors={"x": np.zeros(3)})
    with pytest.raises(ValueError, match=r"non_tensors\['x'\] is a torch.Tensor"):
        Batch.from_dict(non_tensors={"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="0-d"):
        Batch.from_dict(tensors={"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="both as a tensor and as a non-tensor"):
        Batch.from_dict(tensors={"x": torch.zeros(2)}, non_tensors={"x": ["a", "b"]})


def test_empty_batch():
    empty = Batch.from_dict(tensors={"input_ids": torch.zeros(0, 5, dtype=torch.long)}, non_tensors={"uid": []})
    assert len(empty) == 0
    assert len(empty[:]) == 0 and len(empty[[]]) == 0
    assert empty.split(2) == []
    assert [len(c) for c in empty.chunk(3)] == [0, 0, 0]
    assert len(empty.repeat(4)) == 0
    padded, pad = empty.pad_to_divisor(4)
    assert pad == 0 and len(padded) == 0
    both = Batch.concat([empty, make_batch(2, 5).select(["input_ids", "uid"])])
    assert len(both) == 2 and both["input_ids"].shape == (2, 5)
    assert len(Batch()) == 0 and len(Batch(batch_size=7)) == 7


# ---------------------------------------------------------------------- indexing


def test_getitem_int_slice_and_negative():
    batch = make_batch(5)
    one = batch[-1]
    assert len(one) == 1 and uids(one) == ["p4"]
    assert one["input_ids"].tolist() == [[40, 41, 42]]
    assert uids(batch[1:4]) == ["p1", "p2", "p3"]
    assert uids(batch[::2]) == ["p0", "p2", "p4"]
    assert uids(batch[::-2]) == ["p4", "p2", "p0"]
    assert batch[::-1]["input_ids"][:, 0].tolist() == [40, 30, 20, 10, 0]
    # A forward slice is a view (no copy of the tensors), as in torch.
    assert batch[1:3]["input_ids"].data_ptr() == batch["input_ids"][1].data_ptr()
    with pytest.raises(IndexError, match="row 5 is out of range for a batch of 5"):
        batch[5]
    with pytest.raises(KeyError, match="no column 'responses'"):
        batch["responses"]


def test_getitem_index_tensor_list_and_bool_mask():
    batch = make_batch(5)
    expected = ["p3", "p0", "p3"]
    assert uids(batch[torch.tensor([3, 0, -2])]) == expected
    assert uids(batch[[3, 0, 3]]) == expected
    assert uids(batch[np.array([3, 0, 3])]) == expected
    assert batch[torch.tensor([3, 0, 3])]["scores"].tolist() == [3.0, 0.0, 3.0]
    mask = torch.tensor([True, False, True, False, True])
    assert uids(batch[mask]) == ["p0", "p2", "p4"]
    assert uids(batch[mask.numpy()]) == ["p0", "p2", "p4"]
    assert uids(batch[[False] * 5]) == []
    with pytest.raises(IndexError, match=r"bool mask must have shape \[5\]"):
        batch[torch.tensor([True, False])]
    with pytest.raises(IndexError, match="row -6 is out of range"):
        batch[[0, -6]]
    with pytest.raises(TypeError, match="integer or bool"):
        batch[torch.tensor([0.0, 1.0])]


def test_setitem_validates_rows():
    batch = make_batch(3)
    batch["values"] = torch.zeros(3, 2)
    batch["note"] = ["x", "y", "z"]
    assert "values" in batch.tensors and list(batch["note"]) == ["x", "y", "z"]
    batch["values"] = ["now", "a", "column"]  # replacing moves it across kinds
    assert "values" not in batch.tensors and "values" in batch.non_tensors
    with pytest.raises(ValueError, match=r"tensors\['bad'\] has shape \[2\] but the batch has 3 rows"):
        batch["bad"] = torch.zeros(2)


# ---------------------------------------------------------------------- columns


def test_select_and_pop():
    batch = make_batch(3)
    picked = batch.select(["input_ids", "uid"], meta_keys=["global_step"])
    assert picked.keys() == ["input_ids", "uid"] and picked.meta_info == {"global_step": 3}
    assert picked["input_ids"] is batch["input_ids"]  # shared, not copied
    assert batch.select("uid").keys() == ["uid"]  # a single name is not split into letters
    with pytest.raises(KeyError, match=r"no column\(s\) \['responses'\]"):
        batch.select(["input_ids", "responses"])

    popped = batch.pop(["old_log_probs", "reward_model"])
    assert popped.keys() == ["old_log_probs", "reward_model"]
    assert batch.keys() == ["input_ids", "attention_mask", "scores", "uid"]
    assert len(popped) == 3 and popped.meta_info == batch.meta_info
    with pytest.raises(KeyError):
        batch.pop(["old_log_probs"])


def test_results_do_not_share_meta_info_dict():
    batch = make_batch(2)
    sub = batch[0:1]
    sub.meta_info["extra"] = 1
    assert "extra" not in batch.meta_info


def test_union_merges_and_refuses_conflicts():
    batch = make_batch(3)
    extra = Batch.from_dict(
        tensors={"values": torch.ones(3, 3), "input_ids": batch["input_ids"].clone()},
        non_tensors={"uid": np.array(["p0", "p1", "p2"], dtype=object)},
        meta_info={"temperature": 0.7, "kl_coef": 0.1},
    )
    merged = batch.union(extra)
    assert set(merged.keys()) == set(batch.keys()) | {"values"}
    assert merged.meta_info == {"temperature": 0.7, "global_step": 3, "kl_coef": 0.1}
    assert "values" not in batch  # union does not modify its inputs

    conflict = extra.select(["input_ids"])
    conflict["input_ids"] = conflict["input_ids"] + 1
    with pytest.raises(ValueError, match=r"union: tensors\['input_ids'\] conflicts"):
        batch.union(conflict)
    other_dtype = Batch.from_dict(tensors={"input_ids": batch["input_ids"].int()})
    with pytest.raises(ValueError, match=r"tensors\['input_ids'\] conflicts"):
        batch.union(other_dtype)
    narrow = np.array(["p0", "p1", "p2"])  # '<U2' here, object in batch: same values, no conflict
    assert list(batch.union(Batch.from_dict(non_tensors={"uid": narrow}))["uid"]) == ["p0", "p1", "p2"]
    wide = Batch.from_dict(non_tensors={"uid": narrow.astype("<U5")})
    assert Batch.from_dict(non_tensors={"uid": narrow}).union(wide)["uid"].dtype == np.dtype("<U2")
    with pytest.raises(ValueError, match=r"non_tensors\['uid'\] conflicts"):
        batch.union(Batch.from_dict(non_tensors={"uid": ["p0", "p1", "zz"]}))
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs"):
        batch.union(Batch(batch_size=3, meta_info={"temperature": 1.0}))
    with pytest.raises(ValueError, match="batch sizes differ"):
        batch.union(make_batch(2))


def test_union_treats_equal_nan_and_nested_dicts_as_equal():
    values = torch.tensor([[float("nan"), 1.0]])
    a = Batch.from_dict(tensors={"v": values}, non_tensors={"rm": [{"gt": np.array([1, 2])}]})
    b = Batch.from_dict(tensors={"v": values.clone()}, non_tensors={"rm": [{"gt": np.array([1, 2])}]})
    assert a.union(b).equals(a)


# ---------------------------------------------------------------------- split, chunk, concat


def test_split_and_chunk():
    batch = make_batch(6)
    assert [uids(c) for c in batch.split(2)] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    assert [uids(c) for c in batch.chunk(3)] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    with pytest.raises(ValueError, match=r"pad_to_divisor\(4\)"):
        batch.split(4)
    with pytest.raises(ValueError, match=r"pad_to_divisor\(4\)"):
        batch.chunk(4)
    assert [len(c) for c in batch.split(4, allow_uneven=True)] == [4, 2]
    # Always n chunks; the first len % n get one extra row.
    assert [len(c) for c in batch.chunk(4, allow_uneven=True)] == [2, 2, 1, 1]
    assert [len(c) for c in make_batch(2).chunk(3, allow_uneven=True)] == [1, 1, 0]
    with pytest.raises(ValueError, match="positive int"):
        batch.split(0)


def test_concat_round_trip_and_meta_rule():
    batch = make_batch(7)
    parts = batch.split(3, allow_uneven=True)
    assert Batch.concat(parts).equals(batch)

    a, b = make_batch(2), make_batch(2)
    b.meta_info["only_in_b"] = True
    assert Batch.concat([a, b]).meta_info == {"temperature": 0.7, "global_step": 3, "only_in_b": True}
    b.meta_info["global_step"] = 4
    with pytest.raises(ValueError, match=r"meta_info\['global_step'\] differs between batch 0 \(3\) and batch 1 \(4\)"):
        Batch.concat([a, b])


def test_concat_refuses_mismatched_columns():
    a = make_batch(2)
    with pytest.raises(ValueError, match=r"batch 1 lacks \['uid'\]"):
        Batch.concat([a, a.select(["input_ids", "attention_mask", "old_log_probs", "scores", "reward_model"])])
    with pytest.raises(ValueError, match=r"tensors\['input_ids'\] has shape \[\*, 5\] in batch 1 but \[\*, 3\]"):
        Batch.concat([a, make_batch(2, t=5)])
    other = make_batch(2)
    other["scores"] = other["scores"].float()
    with pytest.raises(ValueError, match=r"tensors\['scores'\] is float32 in batch 1 but bfloat16 in batch 0"):
        Batch.concat([a, other])
    with pytest.raises(ValueError, match="no batches"):
        Batch.concat([])


# ---------------------------------------------------------------------- repeat, reorder, pad


def test_repeat_interleaved_and_tiled():
    batch = make_batch(3).select(["input_ids", "uid"])
    inter = batch.repeat(2, interleave=True)
    assert uids(inter) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    expected = torch.tensor([[0, 1, 2], [0, 1, 2], [10, 11, 12], [10, 11, 12], [20, 21, 22], [20, 21, 22]])
    assert torch.equal(inter["input_ids"], expected)
    tiled = batch.repeat(2, interleave=False)
    assert uids(tiled) == ["p0", "p1", "p2", "p0", "p1", "p2"]
    expected = torch.tensor([[0, 1, 2], [10, 11, 12], [20, 21, 22], [0, 1, 2], [10, 11, 12], [20, 21, 22]])
    assert torch.equal(tiled["input_ids"], expected)
    assert len(batch.repeat(1)) == 3
    with pytest.raises(ValueError, match="positive int"):
        batch.repeat(0)


def test_repeat_multi_dim_numpy_column():
    batch = Batch.from_dict(non_tensors={"pairs": np.array([[1, 2], [3, 4]])})
    assert batch.repeat(2)["pairs"].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4]]
    assert batch.repeat(2, interleave=False)["pairs"].tolist() == [[1, 2], [3, 4], [1, 2], [3, 4]]


def test_reorder_and_restore():
    batch = make_batch(5)
    perm = torch.tensor([4, 2, 0, 1, 3])
    shuffled = batch.reorder(perm)
    assert uids(shuffled) == ["p4", "p2", "p0", "p1", "p3"]
    assert shuffled["input_ids"][:, 0].tolist() == [40, 20, 0, 10, 30]
    assert shuffled.reorder(torch.argsort(perm)).equals(batch)
    with pytest.raises(ValueError, match=r"permutation of range\(5\)"):
        batch.reorder([0, 0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"permutation of range\(5\)"):
        batch.reorder([0, 1])
    with pytest.raises(ValueError, match="row numbers"):
        batch.reorder([True] * 5)


@pytest.mark.parametrize("n, divisor, expected_pad", [(5, 4, 3), (8, 4, 0), (1, 3, 2), (2, 7, 5)])
def test_pad_to_divisor_and_unpad_round_trip(n, divisor, expected_pad):
    batch = make_batch(n)
    padded, pad = batch.pad_to_divisor(divisor)
    assert pad == expected_pad and len(padded) % divisor == 0
    # Padding rows repeat the first rows cyclically, so they are valid inputs.
    expected_uids = [f"p{i % n}" for i in range(n + pad)]
    assert uids(padded) == expected_uids
    assert padded.unpad(pad).equals(batch)
    with pytest.raises(ValueError, match=r"pad_size must be an int in \[0, "):
        padded.unpad(len(padded) + 1)


def test_unpad_bounds_on_both_sides():
    batch = make_batch(3)
    assert len(batch.unpad(3)) == 0  # every row: the upper bound itself is allowed
    assert batch.unpad(0).equals(batch)
    with pytest.raises(ValueError, match=r"pad_size must be an int in \[0, 3\], got -1"):
        batch.unpad(-1)
    with pytest.raises(ValueError, match=r"pad_size must be an int in \[0, 3\], got 4"):
        batch.unpad(4)


# ---------------------------------------------------------------------- devices, files, repr


def test_to_device_keeps_values():
    batch = make_batch(3)
    moved = batch.to("cpu")
    assert moved.equals(batch) and moved is not batch


def test_save_load_round_trip(tmp_path):
    batch = make_batch(4)
    batch["raw_prompt"] = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
    batch["score_np"] = np.arange(4, dtype=np.float32)
    batch["nested"] = [{"k": np.int64(i), "arr": np.array([i, i])} for i in range(4)]
    batch.meta_info["mask"] = torch.tensor([1, 0])
    path = tmp_path / "batch.pt"
    batch.save(path)
    loaded = Batch.load(path)
    assert loaded.equals(batch)
    assert loaded["scores"].dtype == torch.bfloat16
    assert loaded["score_np"].dtype == np.float32
    assert loaded["raw_prompt"][2] == [{"role": "user", "content": "q2"}]


def test_save_of_a_slice_writes_only_its_rows(tmp_path):
    big = Batch.from_dict(tensors={"x": torch.zeros(10_000, 16)})
    big[:2].save(tmp_path / "small.pt")
    big.save(tmp_path / "big.pt")
    assert (tmp_path / "small.pt").stat().st_size * 50 < (tmp_path / "big.pt").stat().st_size
    assert len(Batch.load(tmp_path / "small.pt")) == 2


class _Custom:
    def __eq__(self, other):
        return isinstance(other, _Custom)


def test_load_refuses_arbitrary_classes_unless_allowed(tmp_path):
    batch = Batch.from_dict(non_tensors={"obj": [_Custom()]})
    path = tmp_path / "custom.pt"
    batch.save(path)
    with pytest.raises(ValueError, match="allow_pickle=True"):
        Batch.load(path)
    assert Batch.load(path, allow_pickle=True).equals(batch)


def test_load_refuses_foreign_files(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(ValueError, match="not written by Batch.save"):
        Batch.load(path)
    path.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="weights-only loading refuses"):
        Batch.load(path)


def test_repr_is_readable():
    text = repr(make_batch(2))
    assert text.startswith("Batch(len=2,")
    assert "input_ids: int64[2, 3]" in text and "scores: bfloat16[2]" in text
    assert "uid: object[2]" in text and "temperature: 0.7" in text
