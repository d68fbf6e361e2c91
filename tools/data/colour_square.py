"""Generate the colour-square task (a vision-language model names the colour of a square) in the verl format.

    python tools/data/colour_square.py --out-dir data/colour_square --train 2000 --val 128

Writes DIR/train.parquet, DIR/test.parquet (data_source "verl/colour_square") and DIR/blank.parquet:
the test prompts with the square left out of the image (data_source "verl/colour_square_blank"),
where a model that reads the image scores at chance. Images are Geometry3K-shaped rows'
``images`` column (PNG bytes); ``extra_info.answer`` is the reference response for SFT.
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
from verl.data.tasks.colour_square import COLOURS, colour_square_records  # noqa: E402
from verl.utils.cli import positive_int, user_errors  # noqa: E402
from verl.utils.logging import setup_logging  # noqa: E402

logger = logging.getLogger("tools.data.colour_square")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="output folder")
    p.add_argument("--train", type=positive_int, default=2000, help="training prompts (default %(default)s)")
    p.add_argument("--val", type=positive_int, default=128, help="validation prompts, and as many blank ones (default %(default)s)")
    p.add_argument("--colours", default=",".join(COLOURS), help="the choices, comma-separated (default %(default)s)")
    p.add_argument("--size", type=positive_int, default=28, help="image side in pixels (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    args = p.parse_args(argv)
    setup_logging()
    with user_errors(p.prog):
        colours = tuple(c.strip() for c in args.colours.split(",") if c.strip())
        splits = {
            "train": colour_square_records(args.train, seed=args.seed, split="train", colours=colours, size=args.size),
            "test": colour_square_records(args.val, seed=args.seed + 1, split="test", colours=colours, size=args.size),
            "blank": colour_square_records(args.val, seed=args.seed + 1, split="test", colours=colours, size=args.size,
                                           blank=True),
        }
        os.makedirs(args.out_dir, exist_ok=True)
        for name, records in splits.items():
            path = os.path.join(args.out_dir, f"{name}.parquet")
            write_parquet(records, path)
            logger.info("wrote %d rows to %s", len(records), path)


if __name__ == "__main__":
    main()
