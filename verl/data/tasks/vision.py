"""Image prompts in the verl record format: a user's images and JSON lines to a Geometry3K-shaped file.

A Geometry3K-shaped record (the reference verl's layout, scored by the ``hiyouga/geometry3k``
rule) is a verl record (``verl.data.tasks.common.make_record``) with an ``images`` column: a
list of ``{"bytes": <the encoded file>, "path": <its name>}``, one per ``<image>`` placeholder of the
prompt, in order.

The input of :func:`convert_image_jsonl` is one JSON object per line: ``problem`` (or
``question``), ``answer``, and ``images`` (a list of image files) or ``image`` (one), paths
relative to the JSON lines file. A problem without ``<image>`` placeholders gets one per image
in front of it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from verl.data.tasks.common import make_record
from verl.data.vlm import IMAGE_PLACEHOLDER, load_image

__all__ = ["GEO3K_SOURCE", "convert_image_jsonl", "image_record", "write_image_parquet"]

GEO3K_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = " Reason it through first, then put the final answer in \\boxed{}."


def image_record(problem: str, answer: str, images: list[dict[str, Any]], *, data_source: str, split: str,
                 index: int) -> dict[str, Any]:
    """One Geometry3K-shaped record: ``problem`` (placeholders added in front when it has none) and the
    instruction as the user turn, ``images`` as given."""
    if IMAGE_PLACEHOLDER not in problem:
        problem = IMAGE_PLACEHOLDER * len(images) + problem
    record = make_record(
        data_source=data_source, prompt=problem + INSTRUCTION, ground_truth=answer,
        extra_info={"split": split, "index": index, "answer": answer, "question": problem},
    )
    record["images"] = images
    return record


def convert_image_jsonl(path: str, *, split: str, data_source: str = GEO3K_SOURCE) -> list[dict[str, Any]]:
    """Records of every line of the JSON lines file ``path`` (module docstring), each image read and embedded;
    ValueError naming the file, line and key of a bad line or image."""
    if not os.path.isfile(path):
        raise ValueError(f"input file {path} does not exist")
    base = os.path.dirname(os.path.abspath(path))
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc}); write one JSON object per line") from exc
            problem = row.get("problem", row.get("question"))
            if not isinstance(problem, str):
                raise ValueError(f"{where}: no 'problem' (or 'question') string; add the question text")
            if "answer" not in row:
                raise ValueError(f"{where}: no 'answer'; add the reference answer the reward compares against")
            files = row.get("images", [row["image"]] if "image" in row else None)
            key = "images" if "images" in row else "image"
            if not isinstance(files, list) or not files or not all(isinstance(p, str) for p in files):
                raise ValueError(f"{where}: no image files ('images': a list of paths, or 'image': a path); add them")
            images = []
            for i, name in enumerate(files):
                full = name if os.path.isabs(name) else os.path.join(base, name)
                load_image(full, where=f"{where}: {key}[{i}]")  # missing or unreadable: named here, not at training
                with open(full, "rb") as img:
                    images.append({"bytes": img.read(), "path": os.path.basename(name)})
            placeholders = problem.count(IMAGE_PLACEHOLDER)
            if placeholders and placeholders != len(images):
                raise ValueError(
                    f"{where}: problem has {placeholders} {IMAGE_PLACEHOLDER} placeholders for {len(images)} images; "
                    f"write one per image, or none (then they go in front)"
                )
            records.append(image_record(problem, str(row["answer"]), images, data_source=data_source, split=split,
                                        index=len(records)))
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def write_image_parquet(records: list[dict[str, Any]], out_path: str) -> str:
    """Write ``records`` as a parquet file (folders made); returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), out_path)
    return out_path
