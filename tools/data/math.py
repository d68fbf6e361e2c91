"""Convert a local MATH file (``problem``, ``solution`` with \\boxed{}, ``level``, ``type``) to verl parquet.

python tools/data/math.py --input test.jsonl --output data/math/test.parquet --split test
"""

# Running a script puts its folder first on sys.path, where tools/data/math.py would shadow
# the standard library's math module for numpy and torch: drop the folder before they load.
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from verl.data.tasks import math as math_task  # noqa: E402
from verl.data.tasks.common import convert_file_cli  # noqa: E402

if __name__ == "__main__":
    convert_file_cli(None, task=math_task, dataset="MATH", doc=__doc__)
