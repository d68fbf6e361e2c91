"""The package layers of shared/DESIGN.md hold: imports run down, never up.

Every ``import verl.X`` / ``from verl.X import`` in verl/ (at module level or inside a function)
is an edge from the importing package to X; each package has a layer, and an edge must go to a
lower layer (or stay inside the package). The Python API (``verl.api`` and the tutorials' import
paths ``verl``, ``verl.operator``, ``verl.monitor``) is on top: nothing below imports it; the
trainer is imported by nothing but the API; models import neither the engines nor the trainer
(the checkpoint folder layout is ``verl.utils.checkpoint``, below them all).
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = {
    "<root>": 9, "operator": 9, "monitor": 9,  # the tutorials' import paths of the API
    "api": 8,
    "trainer": 7, "serving": 7,
    "planning": 6, "roles": 6, "testing": 6,
    "hybrid": 5,
    "rollout": 4.5, "engine": 4,
    "models": 3.5, "data": 3.5,
    "tools": 3.4, "rewards": 3.2, "sandbox": 3.1, "config": 3,
    "algos": 2.5, "parallel": 2.5,
    "protocol": 2,
    "_C": 1.5,  # the C++ extension's loader (verl.utils.extension builds it)
    "utils": 1,
}
# The reference verl's import path of the RL dataset (``from verl.utils.dataset import RLHFDataset``):
# an alias module, not a dependency of utils.
ALIASES = {"verl.utils.dataset", "verl.utils.dataset.rl_dataset"}
# The tutorials' ``from verl.trainer import RLTrainer`` (issue #58: the import path is a contract):
# verl/trainer/__init__.py's module ``__getattr__`` imports the facade on first access of that one
# name, so importing the trainer never imports the API (test_the_trainer_reexports_only_the_facade).
UPWARD_ALLOWED = {("verl.trainer", "api")}


def _package(module: str) -> str:
    parts = module.split(".")
    return "<root>" if len(parts) == 1 or (len(parts) == 2 and parts[1] == "__init__") else parts[1]


def _edges(root: str = ROOT) -> list[tuple[str, str, str]]:
    """(importing module, its package, imported package) for every verl import in verl/."""
    edges = []
    for folder, _, files in os.walk(os.path.join(root, "verl")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [node.module]
                else:
                    continue
                for target in targets:
                    if target.startswith("verl.") and _package(target) != _package(module):
                        edges.append((module, _package(module), _package(target)))
    return edges


def test_every_package_has_a_layer():
    packages = {pkg for _, pkg, target in _edges()} | {target for _, _, target in _edges()}
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))


def test_imports_run_down_the_layers():
    upward = [
        f"{module} ({pkg}, layer {LAYERS[pkg]}) imports verl.{target} (layer {LAYERS[target]})"
        for module, pkg, target in _edges()
        if module not in ALIASES and (module, target) not in UPWARD_ALLOWED and LAYERS[target] >= LAYERS[pkg]
    ]
    assert upward == []


def test_the_trainer_reexports_only_the_facade():
    """The allowed upward edge stays what it is: one import of ``verl.api.facade`` inside the module
    ``__getattr__`` of verl/trainer/__init__.py (never at import time), returning the API's class."""
    import subprocess
    import sys

    path = os.path.join(ROOT, "verl", "trainer", "__init__.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    upward = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("verl.api")]
    assert [(n.module, [a.name for a in n.names]) for n in upward] == [("verl.api.facade", ["RLTrainer"])]
    getattr_fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__")
    assert upward[0] in list(ast.walk(getattr_fn))
    code = (
        "import sys, verl.trainer; before = 'verl.api' in sys.modules\n"
        "from verl.trainer import RLTrainer; import verl\n"
        "print(before, RLTrainer is verl.RLTrainer)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]


def test_the_layer_test_sees_an_upward_import(tmp_path):
    """The check is not vacuous: an engine module importing the trainer is an upward edge."""
    fake = tmp_path / "verl" / "engine"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from verl.trainer.loop import Loop\n")
    assert _edges(str(tmp_path)) == [("verl.engine.bad", "engine", "trainer")]
    assert LAYERS["trainer"] >= LAYERS["engine"]
