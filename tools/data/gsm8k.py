"""Convert a local GSM8K file (columns ``question``, ``answer`` ending in ``#### N``) to verl parquet.

python tools/data/gsm8k.py --input test.jsonl --output data/gsm8k/test.parquet --split test
"""

# Running a script puts its folder first on sys.path, where tools/data/math.py would shadow
# the standard library's math module for numpy and torch: drop the folder before they load.
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from verl.data.tasks import gsm8k  # noqa: E402
from verl.data.tasks.common import convert_file_cli  # noqa: E402

if __name__ == "__main__":
    convert_file_cli(None, task=gsm8k, dataset="GSM8K", doc=__doc__)
