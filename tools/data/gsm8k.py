"""Convert a local GSM8K file (columns ``question``, ``answer`` ending in ``#### N``) to verl parquet.

python tools/data/gsm8k.py --input test.jsonl --output data/gsm8k/test.parquet --split test
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
from verl.data.tasks import gsm8k  # noqa: E402
from verl.data.tasks.common import convert_file  # noqa: E402

logger = logging.getLogger("tools.data.gsm8k")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input", required=True, help="GSM8K file: .jsonl, .parquet or .arrow in the public schema"
    )
    p.add_argument("--output", required=True, help="output parquet file in the verl format")
    p.add_argument(
        "--split", default="train", help="split name stored in extra_info.split (default %(default)s)"
    )
    args = p.parse_args(argv)
    # Not verl.utils.logging.setup_logging: it imports torch, which these tools do not need.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        records = convert_file(args.input, gsm8k.convert_row, split=args.split)
        write_parquet(records, args.output)
    except ValueError as e:
        p.error(str(e))
    logger.info("wrote %d %s records to %s", len(records), gsm8k.DATA_SOURCE, args.output)


if __name__ == "__main__":
    main()
