"""Write a Geometry3K-shaped parquet (an ``images`` column, ``<image>`` placeholders) from your images.

The input is JSON lines, one problem per line: ``{"problem": "...", "answer": "...", "images": ["a.png"]}``
(or ``"image": "a.png"``), paths relative to the file. Every image is read and embedded as bytes.

python tools/make_vlm_data.py --input train.jsonl --output data/geo/train.parquet --split train
"""

import argparse
import sys

from verl.data.tasks.vision import GEO3K_SOURCE, convert_image_jsonl, write_image_parquet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSON lines file: problem, answer, images (or image)")
    parser.add_argument("--output", required=True, help="parquet file to write")
    parser.add_argument("--split", default="train", help="split name kept in extra_info")
    parser.add_argument("--data-source", default=GEO3K_SOURCE, help="data_source (selects the reward rule)")
    args = parser.parse_args(argv)
    try:
        records = convert_image_jsonl(args.input, split=args.split, data_source=args.data_source)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_image_parquet(records, args.output)
    print(f"wrote {len(records)} records with {sum(len(r['images']) for r in records)} images to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
