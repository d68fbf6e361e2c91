"""Deferred optional imports: the probe sees the package, the first use imports it, and walks over
sys.modules (inspect.getmodule, which torch.library runs at import) do not."""

from __future__ import annotations

import inspect
import sys

import pytest

from verl.utils.imports import defer_import, is_deferred

PACKAGE = "verl_deferred_probe_pkg"


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package whose import is recorded in a file, so a test can tell when it really ran."""
    root = tmp_path / PACKAGE
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).touch()\n"
        "VALUE = 42\n"
    )
    (root / "sub" / "__init__.py").write_text("NAME = 'sub'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "imported"
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def test_the_first_attribute_imports_the_package(package):
    assert defer_import(PACKAGE)
    import verl_deferred_probe_pkg as probed  # what a dependency's `try: import x` does

    assert is_deferred(PACKAGE) and not package.exists()
    assert probed.VALUE == 42
    assert package.exists() and not is_deferred(PACKAGE)
    assert sys.modules[PACKAGE].VALUE == 42


def test_a_submodule_import_imports_the_package_first(package):
    defer_import(PACKAGE)
    import verl_deferred_probe_pkg.sub

    assert package.exists()
    assert verl_deferred_probe_pkg.sub.NAME == "sub"


def test_inspect_getmodule_does_not_import_it(package):
    defer_import(PACKAGE)
    # torch.library's registration calls inspect.getmodule on a frame, which (for a file it has
    # not seen) reads __file__ of every module in sys.modules.
    inspect.getmodule(sys._getframe(), str(package.parent / "not_a_module_yet.py"))
    assert is_deferred(PACKAGE) and not package.exists()


def test_nothing_to_defer():
    assert not defer_import("verl_no_such_package_here")
    assert "verl_no_such_package_here" not in sys.modules
    assert not defer_import("json")  # already imported
    assert not defer_import("os.path")  # only top-level packages
