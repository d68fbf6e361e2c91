"""The install commands the tutorials write: ``pip install -e .`` and ``pip install .`` from an
sdist, in a fresh venv that holds only the CPU torch, each ending with a working ``verl._C``
(compiled on first import, verl/utils/extension.py), and never pulling a torch of their own.

The fast tests here check the first-use build's rules (cache key, cache hit, missing compiler)
without compiling; the slow ones install into a fresh venv and compile (a few minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

import pytest
import torch

from verl.utils import extension

ROOT = Path(__file__).resolve().parents[2]


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a command run in another venv: nothing of this interpreter's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", **extra)
    return env


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{(result.stdout + result.stderr)[-6000:]}"
    return result


# ------------------------------------------------------------------------------------------
# fast: the rules, no compiler run


def test_build_requirements_hold_no_torch():
    """An isolated build installs exactly these: a torch among them would be fetched into the
    build environment (a CUDA build of several GB on a CPU machine)."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not [r for r in requires if r.lower().startswith("torch")], requires


def test_every_csrc_file_is_listed():
    """A wheel ships, and the first-use cache key hashes, exactly the listed files: a source or
    header added to csrc/ but not to verl/utils/extension.py would be missing from a wheel (its
    compile fails) or leave a stale cached module after an edit."""
    on_disk = {p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h", ".cuh")}
    listed = {*extension.CPU_SOURCES, *extension.CUDA_SOURCES, *extension.HEADERS}
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))


def test_cuda_rule(monkeypatch):
    class FakeTorch:
        __version__ = "2.13.0+cu130"

        class version:
            cuda = "13.0"

    assert extension.cuda_skip_reason(FakeTorch, "/usr/local/cuda") == ""
    assert "no CUDA toolkit" in extension.cuda_skip_reason(FakeTorch, None)
    FakeTorch.version.cuda = None
    assert extension.cuda_skip_reason(FakeTorch, "/usr/local/cuda") == "torch 2.13.0+cu130 is a CPU build"
    monkeypatch.setenv("VERL_BUILD_CUDA", "0")
    FakeTorch.version.cuda = "13.0"
    assert extension.cuda_skip_reason(FakeTorch, "/usr/local/cuda") == "VERL_BUILD_CUDA=0"


def test_build_key_follows_sources_torch_and_cuda(tmp_path):
    sources = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", sources)
    key = extension.build_key(torch, sources, with_cuda=False)
    assert key.startswith(f"torch{torch.__version__.replace('+', '_')}-{sys.implementation.cache_tag}-")
    assert key == extension.build_key(torch, sources, with_cuda=False)
    assert key != extension.build_key(torch, sources, with_cuda=True)
    (sources / "copy_ranges.h").write_text((sources / "copy_ranges.h").read_text() + "\n// edited\n")
    assert key != extension.build_key(torch, sources, with_cuda=False)


def test_missing_compiler_is_one_clear_import_error(tmp_path):
    """No cached build and no compiler: ImportError saying what to install, before any build."""
    code = "import verl.utils.extension as e; e.load_extension()"
    env = _clean_env(PYTHONPATH=str(ROOT), VERL_EXTENSION_DIR=str(tmp_path), CXX="no-such-compiler-here")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: verl._C was not compiled when verl was installed"), result.stderr
    assert "'no-such-compiler-here' was not found on PATH" in last and "apt-get install g++" in last, last


def test_cached_build_loads_without_compiler(tmp_path):
    """A complete build in the cache is imported as is: no compiler, ninja or rebuild needed."""
    prebuilt = sorted((ROOT / "verl").glob("_C.*.so"))
    if not prebuilt:
        pytest.skip("no ahead-of-time verl._C in the checkout to stand in for a cached build")
    build_dir = tmp_path / extension.build_key(torch, extension.source_dir(), with_cuda=False)
    build_dir.mkdir()
    shutil.copy(prebuilt[0], build_dir / "_C.so")
    (build_dir / "build-complete").write_text("0 s\n")
    code = "import verl.utils.extension as e; m = e.load_extension(); print(m.__file__)"
    env = _clean_env(PYTHONPATH=str(ROOT), VERL_EXTENSION_DIR=str(tmp_path), CXX="no-such-compiler-here",
                     VERL_BUILD_CUDA="0")
    result = _run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=120)
    assert result.stdout.strip() == str(build_dir / "_C.so"), result.stdout + result.stderr
    assert "compiling" not in result.stderr


# ------------------------------------------------------------------------------------------
# slow: fresh venvs, real installs, real compiles


def _checkout_copy(dest: Path) -> Path:
    """The project's files as a fresh clone has them (no build outputs, no compiled verl._C)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, timeout=60,
    )
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (ROOT / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, dest / name)
    else:  # not a git checkout (an unpacked sdist): everything but build outputs
        shutil.copytree(ROOT, dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.so", "build", "dist", "*.egg-info", "__pycache__", ".venv"))
    assert not list(dest.glob("verl/_C*.so"))
    return dest


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new venv holding only the torch this suite runs on (pip takes it from the local CPU wheel)."""
    if not torch.__version__.endswith("+cpu"):
        pytest.skip(f"the fresh-venv installs are measured with the CPU torch; this torch is {torch.__version__}")
    venv = tmp_path_factory.mktemp("fresh-venv")
    _run([sys.executable, "-m", "venv", str(venv)], cwd=venv, env=_clean_env(), timeout=120)
    # --no-compile: no .pyc files for torch's ~2,300 modules (tens of seconds on 2 busy cores); the
    # tutorial commands below run as written.
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
          f"torch=={torch.__version__.split('+')[0]}"], cwd=venv, env=_clean_env(), timeout=400)
    return venv


def _assert_only_cpu_torch(python: Path, cwd: Path) -> None:
    """torch is still the CPU build the venv started with, and no CUDA library came along."""
    listed = _run([str(python), "-m", "pip", "list", "--format=json"], cwd=cwd, env=_clean_env(), timeout=120)
    packages = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
    assert packages["torch"] == torch.__version__, packages["torch"]
    assert not [name for name in packages if name.startswith("nvidia") or name == "triton"], sorted(packages)


# What the issue runs, plus a copy through the wrapper (the module really works).
_SMOKE = (
    "import verl._C, torch; from verl.hybrid.copy_shards import copy_shards_; "
    "d = torch.zeros(6); copy_shards_(d, torch.arange(6.0), [[0, 3, 3], [5, 0, 1]]); "
    "assert d.tolist() == [5, 0, 0, 0, 1, 2], d; print('ok', verl._C.__file__)"
)


def _import_compiles(python: Path, cwd: Path, cache: Path, sources: Path) -> str:
    """``python -c "import verl._C"`` from ``cwd`` compiles into ``cache`` (from ``sources``); returns its log."""
    env = _clean_env(VERL_EXTENSION_DIR=str(cache))
    result = _run([str(python), "-c", "import verl._C"], cwd=cwd, env=env, timeout=500)
    assert f"compiling it once from {sources} into {cache}" in result.stderr, result.stderr
    again = _run([str(python), "-c", _SMOKE], cwd=cwd, env=env, timeout=120)
    assert again.stdout.startswith("ok " + str(cache)), again.stdout + again.stderr
    assert "compiling" not in again.stderr, again.stderr  # the second import loads the cached build
    return result.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_install_editable_in_fresh_venv(fresh_venv, tmp_path):
    """``pip install -e .`` (isolated build, as the tutorials write it), then ``import verl._C``
    in two processes at once: one compiles, the other waits on the lock; both get the module."""
    checkout = _checkout_copy(tmp_path / "checkout")
    python = fresh_venv / "bin" / "python"
    start = time.perf_counter()
    _run([str(python), "-m", "pip", "install", "-e", "."], cwd=checkout, env=_clean_env(), timeout=600)
    install_s = time.perf_counter() - start
    _assert_only_cpu_torch(python, tmp_path)
    assert not list(checkout.glob("verl/_C*.so")), "the isolated build compiled verl._C (it saw a torch)"

    cache = tmp_path / "ext-cache"
    env = _clean_env(VERL_EXTENSION_DIR=str(cache))
    start = time.perf_counter()
    procs = [subprocess.Popen([str(python), "-c", "import verl._C"], cwd=tmp_path, env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    logs = [proc.communicate(timeout=600)[1] for proc in procs]
    compile_s = time.perf_counter() - start
    assert [proc.returncode for proc in procs] == [0, 0], logs
    compiled = [log for log in logs if f"compiling it once from {checkout / 'csrc'} into {cache}" in log]
    assert len(compiled) == 1, logs
    again = _run([str(python), "-c", _SMOKE], cwd=tmp_path, env=env, timeout=120)
    assert again.stdout.startswith("ok " + str(cache)) and "compiling" not in again.stderr, again.stdout + again.stderr
    print(f"pip install -e . {install_s:.0f} s; first import (compile) {compile_s:.0f} s")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_install_sdist_in_fresh_venv(fresh_venv, tmp_path):
    """``python -m build --sdist``, then ``pip install verl-*.tar.gz``: the sdist carries csrc/,
    the wheel built from it carries the sources in verl/_csrc, and they compile on first import."""
    checkout = _checkout_copy(tmp_path / "checkout")
    python = fresh_venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-compile", "build"], cwd=tmp_path, env=_clean_env(),
         timeout=300)
    dist = tmp_path / "dist"
    _run([str(python), "-m", "build", "--sdist", "--outdir", str(dist), "."], cwd=checkout, env=_clean_env(),
         timeout=300)
    (sdist,) = dist.glob("verl-*.tar.gz")
    with tarfile.open(sdist) as tar:
        shipped = {Path(name).relative_to(Path(name).parts[0]).as_posix() for name in tar.getnames()}
    for name in (*extension.CPU_SOURCES, *extension.CUDA_SOURCES, *extension.HEADERS):
        assert f"csrc/{name}" in shipped, name

    start = time.perf_counter()
    _run([str(python), "-m", "pip", "install", str(sdist)], cwd=tmp_path, env=_clean_env(), timeout=600)
    install_s = time.perf_counter() - start
    _assert_only_cpu_torch(python, tmp_path)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path, env=_clean_env(), timeout=60).stdout.strip())
    assert not list((site / "verl").glob("_C*.so"))
    start = time.perf_counter()
    _import_compiles(python, tmp_path, tmp_path / "ext-cache", site / "verl" / "_csrc")
    print(f"pip install <sdist> {install_s:.0f} s; first import (compile) {time.perf_counter() - start:.0f} s")
