"""Prompts with images: the tiny VLM's processor, the dataset's image tokens and pixels, bad input, the data tool."""

from __future__ import annotations

import importlib.util
import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl.data.rl_dataset import RLPromptDataset, collate_fn
from verl.data.tiny_vlm import TinyVLMSpec, tiny_image_processor, tiny_vlm_tokenizer
from verl.data.vlm import IMAGE_GRID_THW, PIXEL_VALUES, ImagePromptEncoder, model_image_inputs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def png(color: str, size: tuple[int, int] = (28, 28)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def image(data: bytes) -> dict:
    return {"bytes": data, "path": None}


def write(path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def row(content: str, images: list) -> dict:
    return {"prompt": [{"role": "user", "content": content}], "images": images, "data_source": "colour"}


@pytest.fixture(scope="module")
def encoder() -> ImagePromptEncoder:
    spec = TinyVLMSpec(corpus_lines=500)  # the tiny VLM's tokenizer and image processor (no weights needed here)
    return ImagePromptEncoder(tiny_vlm_tokenizer(spec), tiny_image_processor(spec))


def dataset(files, encoder, max_prompt_length: int = 64, **kwargs) -> RLPromptDataset:
    return RLPromptDataset(files, encoder.tokenizer, processor=encoder, max_prompt_length=max_prompt_length, **kwargs)


def test_placeholders_become_image_tokens_and_pixels(encoder, tmp_path):
    path = write(tmp_path / "d.parquet", [
        row("<image>Which colour?", [image(png("red"))]),
        row("<image> or <image>?", [image(png("red")), image(png("blue", (56, 42)))]),
    ])
    ds = dataset(path, encoder)
    first, second = ds[0], ds[1]
    pad = encoder.image_token_id
    # 28x28: 2x2 patches of 14, merged 2x2 -> 1 token; 56x42 resizes to 56x56: 4x4 patches -> 4 tokens.
    assert first["raw_prompt_ids"].count(pad) == 1 and second["raw_prompt_ids"].count(pad) == 5
    batch = collate_fn([first, second])
    assert batch[PIXEL_VALUES].shape == (2, 4 + 16, 3 * 2 * 14 * 14)  # the widest row's patches
    assert batch[IMAGE_GRID_THW].tolist() == [[[1, 2, 2], [0, 0, 0]], [[1, 2, 2], [1, 4, 4]]]
    # Back to the model's layout: every real patch once, in row order.
    inputs = model_image_inputs(batch)
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2], [1, 4, 4]]
    assert inputs["pixel_values"].shape[0] == 4 + 4 + 16
    expected = encoder.pixels([ds_image(png("red")), ds_image(png("blue", (56, 42)))])[0]
    torch.testing.assert_close(inputs["pixel_values"][4:], expected, atol=0, rtol=0)


def ds_image(data: bytes):
    from verl.data.vlm import load_image

    return load_image({"bytes": data}, where="test")


def test_prompt_length_counts_image_tokens(encoder, tmp_path):
    # The same text with a 28x28 image (1 token) and a 112x112 one (64 patches -> 16 tokens).
    path = write(tmp_path / "d.parquet", [
        row("<image>Which colour?", [image(png("red"))]),
        row("<image>Which colour?", [image(png("red", (112, 112)))]),
    ])
    short = len(dataset(path, encoder)[0]["raw_prompt_ids"])
    ds = RLPromptDataset(path, encoder.tokenizer, processor=encoder, max_prompt_length=short + 5,
                         filter_overlong_prompts=True)
    assert len(ds) == 1 and ds[0]["raw_prompt_ids"].count(encoder.image_token_id) == 1
    with pytest.raises(ValueError, match=r"1 of 2 prompts are longer .* row 1 \(" + str(short + 15)):
        RLPromptDataset(path, encoder.tokenizer, processor=encoder, max_prompt_length=short + 5)


@pytest.mark.parametrize(
    "images, content, message",
    [
        ([{"bytes": None, "path": "nowhere.png"}], "<image>?", r"row 1: images\[0\]: image file nowhere.png not found"),
        ([image(b"not an image")], "<image>?", r"row 1: images\[0\]: unreadable image"),
        ([image(png("red"))], "<image> and <image>?", r"row 1: prompt: 2 <image> placeholders for 1 images"),
        ([image(png("red", (200, 200)))], "<image>?", r"row 1: images\[0\]: 200x200 = 40000 pixels, above .* 12544"),
    ],
    ids=["missing", "unreadable", "placeholders", "pixels"],
)
def test_bad_images_are_refused_at_load_in_one_line(encoder, tmp_path, images, content, message):
    path = write(tmp_path / "bad.parquet", [row("<image>fine", [image(png("red"))]), row(content, images)])
    with pytest.raises(ValueError, match=message) as info:
        dataset(path, encoder)
    text = str(info.value)
    assert "\n" not in text and text.startswith(path)


def test_relative_image_paths_read_beside_the_data_file(encoder, tmp_path):
    (tmp_path / "red.png").write_bytes(png("red"))
    path = write(tmp_path / "d.parquet", [row("<image>?", ["red.png"])])
    assert dataset(path, encoder)[0][IMAGE_GRID_THW].tolist() == [[1, 2, 2]]


def make_vlm_data(argv: list[str]) -> int:
    """tools/make_vlm_data.py's main, run in this process."""
    spec = importlib.util.spec_from_file_location("make_vlm_data", os.path.join(REPO, "tools", "make_vlm_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_make_vlm_data_writes_a_geometry3k_shaped_file(encoder, tmp_path, capsys):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png("red"))
    (tmp_path / "imgs" / "b.png").write_bytes(png("blue", (56, 56)))
    lines = [{"problem": "Find x.", "answer": "3", "image": "imgs/a.png"},
             {"question": "<image> vs <image>: which is larger?", "answer": "B", "images": ["imgs/a.png", "imgs/b.png"]}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out" / "train.parquet"
    assert make_vlm_data(["--input", str(src), "--output", str(out)]) == 0
    assert "wrote 2 records with 3 images" in capsys.readouterr().out
    table = pq.read_table(out).to_pylist()
    assert [r["data_source"] for r in table] == ["hiyouga/geometry3k"] * 2
    assert table[0]["prompt"][0]["content"].startswith("<image>Find x.")
    assert table[1]["reward_model"]["ground_truth"] == "B" and len(table[1]["images"]) == 2
    ds = dataset(str(out), encoder, max_prompt_length=128)
    assert ds[1][IMAGE_GRID_THW].tolist() == [[1, 2, 2], [1, 4, 4]]

    (tmp_path / "bad.jsonl").write_text(json.dumps({"problem": "x", "answer": "1", "image": "imgs/none.png"}) + "\n")
    assert make_vlm_data(["--input", str(tmp_path / "bad.jsonl"), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl: line 1: image[0]: image file" in err and err.count("\n") == 1


def test_data_image_key_names_the_column_of_the_images(encoder, tmp_path):
    """``data.image_key`` (the reference's key; default ``images``) picks the column the dataset reads the rows'
    images from; a file without that column is refused in one line naming the key and the fix."""
    from verl.config import PPOConfig, load_config
    from verl.data.rl_dataset import create_rl_dataset

    path = write(tmp_path / "d.parquet", [{"prompt": [{"role": "user", "content": "<image>Which colour?"}],
                                          "pictures": [image(png("red", (56, 56)))], "data_source": "colour"}])
    cfg = load_config(PPOConfig, overrides=["data.image_key=pictures", "data.max_prompt_length=64"])
    item = create_rl_dataset(cfg.data, encoder.tokenizer, [path], processor=encoder)[0]
    pixels, grid = encoder.pixels([ds_image(png("red", (56, 56)))])
    assert item[IMAGE_GRID_THW].tolist() == grid.tolist() == [[1, 4, 4]]
    assert torch.equal(item[PIXEL_VALUES][: len(pixels)], pixels)  # the same processor on the same image: exact
    with pytest.raises(ValueError, match=r"^\S+d.parquet: no column 'images' .*data.image_key='images' .*set "
                                         r"data.image_key to the column that holds them$"):
        create_rl_dataset(load_config(PPOConfig, overrides=["data.max_prompt_length=64"]).data, encoder.tokenizer,
                          [path], processor=encoder)


def test_the_colour_square_task_and_its_scorer():
    """The recipe's task: balanced colours, a square only in the task's images (the control's images are the same
    grey background), and the first word of the response judged."""
    import numpy as np
    from PIL import Image

    from verl.data.tasks.colour_square import BACKGROUND, colour_square_records
    from verl.rewards import default_compute_score

    task = colour_square_records(8, seed=3, split="test")
    blank = colour_square_records(8, seed=3, split="test", blank=True)
    assert sorted(r["reward_model"]["ground_truth"] for r in task) == sorted(["red", "green", "blue", "yellow"] * 2)
    assert [r["prompt"] for r in task] == [r["prompt"] for r in blank]
    for with_square, without in zip(task, blank):
        a = np.asarray(Image.open(io.BytesIO(with_square["images"][0]["bytes"])), np.int16)
        b = np.asarray(Image.open(io.BytesIO(without["images"][0]["bytes"])), np.int16)
        assert a.shape == b.shape == (28, 28, 3)
        assert np.abs(b - BACKGROUND).max() <= 12  # background noise only
        assert (np.abs(a - BACKGROUND).max(-1) > 40).sum() >= 14 * 14  # the square: half the side at least
    assert [default_compute_score(r["data_source"], " Red.", "red") for r in (task[0], blank[0])] == [1.0, 1.0]
    assert default_compute_score("verl/colour_square", "blue red", "red") == 0.0
    assert default_compute_score("verl/colour_square", "", "red") == 0.0
    with pytest.raises(ValueError, match="colours"):
        colour_square_records(4, seed=0, split="x", colours=("red", "purple"))
