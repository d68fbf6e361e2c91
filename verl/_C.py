"""``verl._C`` for an install that did not compile it (pip's isolated build: ``pip install .``,
``pip install -e .``, an sdist).

When setup.py compiled the extension (torch importable at install time), the compiled
``_C.*.so`` lies beside this file and Python imports it instead: extension modules take
precedence over source files of the same name. Otherwise ``import verl._C`` runs this file,
which compiles csrc/ against the running torch once per user and torch build (see
:mod:`verl.utils.extension`) and puts the compiled module in its own place.
"""

import sys

from verl.utils.extension import load_extension

sys.modules[__name__] = load_extension()
