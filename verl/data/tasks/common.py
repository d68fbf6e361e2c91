"""The verl record format shared by every task converter."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def user_prompt(text: str) -> list[dict[str, str]]:
    """A one-turn chat prompt: ``[{"role": "user", "content": text}]``."""
    return [{"role": "user", "content": text}]


def make_record(
    *,
    data_source: str,
    prompt: str | list[dict[str, str]],
    ground_truth: Any,
    ability: str = "math",
    style: str = "rule",
    extra_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One record in the verl RL format.

    ``data_source`` picks the reward function, ``reward_model.ground_truth`` is what the
    scorer compares against, ``extra_info`` carries anything else (split, index, the full
    reference answer for SFT).
    """
    if isinstance(prompt, str):
        prompt = user_prompt(prompt)
    return {
        "data_source": data_source,
        "prompt": prompt,
        "ability": ability,
        "reward_model": {"style": style, "ground_truth": ground_truth},
        "extra_info": dict(extra_info or {}),
    }


def require(row: dict[str, Any], field: str, *, path: str, index: int, kind: type = str) -> Any:
    """``row[field]`` checked to be present and of ``kind``; errors name file, row and field."""
    value = row.get(field)
    if value is None:
        raise ValueError(f"{path}: row {index} has no field {field!r} (fields present: {sorted(row)})")
    if not isinstance(value, kind):
        raise ValueError(
            f"{path}: row {index} field {field!r} is a {type(value).__name__}, expected {kind.__name__}"
        )
    return value


def convert_file(
    input_path: str, convert_row: Callable[..., dict[str, Any]], *, split: str
) -> list[dict[str, Any]]:
    """Every row of a parquet/arrow/jsonl file converted with ``convert_row(row, index=, split=, path=)``."""
    from verl.data.io import read_records

    if not os.path.exists(input_path):
        raise ValueError(f"input file {input_path} does not exist")
    if not os.path.isfile(input_path):
        raise ValueError(f"input {input_path} is not a file; give the data file to convert")
    records = [
        convert_row(row, index=i, split=split, path=input_path)
        for i, row in enumerate(read_records(input_path))
    ]
    if not records:
        raise ValueError(f"{input_path}: no rows to convert")
    return records


def convert_file_cli(argv: list[str] | None, *, task: Any, dataset: str, doc: str) -> None:
    """The command line of a ``tools/data/<task>.py`` converter: ``--input``, ``--output``, ``--split``.

    ``task`` is a module of :mod:`verl.data.tasks` with ``convert_row`` and ``DATA_SOURCE``;
    ``dataset`` names the public dataset in the help text. Bad input exits with status 2 and
    the message of the ``ValueError`` (it names the file, the row and the field).
    """
    import argparse
    import logging

    from verl.data.io import write_parquet
    from verl.utils.cli import user_errors
    from verl.utils.logging import setup_logging
    from verl.utils.outputs import check_output_apart

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help=f"{dataset} file: .jsonl, .parquet or .arrow in the public schema")
    p.add_argument("--output", required=True, help="output parquet file in the verl format")
    p.add_argument("--split", default="train", help="split name stored in extra_info.split (default %(default)s)")
    args = p.parse_args(argv)
    setup_logging()
    with user_errors(p.prog):
        check_output_apart(args.output, "--output", {"--input": args.input})
        records = convert_file(args.input, task.convert_row, split=args.split)
        write_parquet(records, args.output)
    logging.getLogger(f"tools.data.{task.__name__.rsplit('.', 1)[-1]}").info(
        "wrote %d %s records to %s", len(records), task.DATA_SOURCE, args.output
    )

