"""Countdown puzzles in the verl format: generate solvable ones, or convert a local file.

    python tools/data/countdown.py generate --out-dir data/countdown --train 1000 --val 100
    python tools/data/countdown.py convert --input countdown.parquet --output data/countdown/train.parquet

A file to convert has the public schema: ``nums`` (list of integers) and ``target`` (integer).
"""

# Running a script puts its folder first on sys.path, where tools/data/math.py would shadow
# the standard library's math module for numpy and torch: drop the folder before they load.
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import logging  # noqa: E402

from verl.data.io import write_parquet  # noqa: E402
from verl.data.tasks import countdown  # noqa: E402
from verl.data.tasks.common import convert_file  # noqa: E402
from verl.utils.cli import positive_int, user_errors  # noqa: E402
from verl.utils.outputs import check_output_apart  # noqa: E402
from verl.utils.logging import setup_logging  # noqa: E402

logger = logging.getLogger("tools.data.countdown")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="generate solvable puzzles into OUT_DIR/train.parquet and OUT_DIR/test.parquet",
        description="Generate countdown puzzles that have a solution (reach a target from --count numbers in "
        "[1, --max-number] with + - * /, each number at most once) into OUT_DIR/train.parquet (--train puzzles) and "
        "OUT_DIR/test.parquet (--val puzzles), in the verl format (prompt, data_source, reward_model.ground_truth).",
    )
    g.add_argument("--out-dir", required=True, help="output folder")
    g.add_argument("--train", type=positive_int, default=1000, help="training puzzles (default %(default)s)")
    g.add_argument("--val", type=positive_int, default=100, help="validation puzzles (default %(default)s)")
    g.add_argument(
        "--count", type=positive_int, default=4, help="numbers per puzzle, the difficulty knob (default %(default)s)"
    )
    g.add_argument("--max-number", type=positive_int, default=99, help="largest number drawn (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    c = sub.add_parser(
        "convert",
        help="convert a file with nums/target columns",
        description="Convert a local countdown file (.jsonl, .parquet or .arrow with columns nums, a list of "
        "integers, and target, an integer) into one verl-format parquet file.",
    )
    c.add_argument("--input", required=True, help="input .jsonl, .parquet or .arrow file")
    c.add_argument("--output", required=True, help="output parquet file")
    c.add_argument(
        "--split", default="train", help="split name stored in extra_info.split (default %(default)s)"
    )
    args = p.parse_args(argv)
    setup_logging()
    with user_errors(p.prog):
        if args.command == "generate":
            # Both splits are made before either is written: a bad setting writes nothing.
            splits = {
                split: countdown.generate(n, count=args.count, max_number=args.max_number, seed=seed, split=split)
                for split, n, seed in (("train", args.train, args.seed), ("test", args.val, args.seed + 1))
            }
            for split, records in splits.items():
                path = os.path.join(args.out_dir, f"{split}.parquet")
                write_parquet(records, path)
                logger.info("wrote %d countdown puzzles to %s", len(records), path)
        else:
            check_output_apart(args.output, "--output", {"--input": args.input})
            records = convert_file(args.input, countdown.convert_row, split=args.split)
            write_parquet(records, args.output)
            logger.info("wrote %d countdown records to %s", len(records), args.output)


if __name__ == "__main__":
    main()
