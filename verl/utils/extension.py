"""How ``verl._C`` is built from csrc/: ahead of time by setup.py, or on first import.

Two ways, one source list and one CUDA rule:

- **ahead of time**: when torch is importable while verl is installed (``pip install
  --no-build-isolation -e .``, ``tools/setup_env.sh``, CI), setup.py compiles ``verl._C`` into the
  package; Python then imports that compiled module and never reads ``verl/_C.py``;
- **on first import**: a build without torch (pip's default isolated build of ``pip install .``,
  ``pip install -e .`` or an sdist, which must not pull a torch of its own) ships only the
  sources (``verl/_csrc/`` in a wheel; csrc/ of the checkout for an editable install). The first
  ``import verl._C`` then compiles them against the running torch with
  ``torch.utils.cpp_extension.load`` and ninja, into a per-user cache keyed by the torch build,
  the Python ABI, the CUDA choice and a hash of the sources; later imports load the cached
  module without a compiler. A file lock makes concurrent ranks build once and wait for it.

setup.py loads this file by path (no verl or torch import at module level).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

CPU_SOURCES = ("byte_copy.cpp", "copy_ranges.cpp", "bindings.cpp")
CUDA_SOURCES = ("byte_copy_cuda.cpp", "byte_copy_kernel.cu")
HEADERS = ("byte_copy.h", "byte_copy_kernel.h", "copy_ranges.h")
# OpenMP: the CPU copy's at::parallel_for is a header template that runs its threads through
# `#pragma omp parallel` only when the extension itself is compiled with -fopenmp (torch's own build
# flags are not passed on); linked with -fopenmp too, the module needs libgomp.so.1, the runtime
# torch's libtorch_cpu already loaded (same soname), so both share one pool and one thread setting
# (torch.set_num_threads). Not on macOS, whose clang has no -fopenmp (the copy runs serially there).
OPENMP_FLAGS = ("-fopenmp",) if sys.platform.startswith("linux") else ()
CXX_FLAGS = ("-O3", *OPENMP_FLAGS)  # torch's build adds the C++ standard its headers need
LD_FLAGS = OPENMP_FLAGS
NVCC_FLAGS = ("-O3",)
CUDA_MACRO = ("VERL_WITH_CUDA", "1")
# Where a wheel keeps the sources (setup.py copies csrc/ there), relative to the package.
PACKAGED_SOURCES = "_csrc"
# The first-use build's cache; default $XDG_CACHE_HOME/verl/torch_extensions (~/.cache/...).
CACHE_ENV = "VERL_EXTENSION_DIR"
_MODULE = "verl._C"
_DONE = "build-complete"  # written after the module built and imported once


def cuda_skip_reason(torch: Any, cuda_home: str | None) -> str:
    """Why the CUDA kernels are left out ("" when they are built): VERL_BUILD_CUDA=0, a CPU
    torch, or no CUDA toolkit (``cuda_home`` is torch.utils.cpp_extension.CUDA_HOME)."""
    if os.environ.get("VERL_BUILD_CUDA", "auto").lower() in ("0", "false", "no", "off"):
        return "VERL_BUILD_CUDA=0"
    if not torch.version.cuda:
        return f"torch {torch.__version__} is a CPU build"
    if cuda_home is None:
        return "no CUDA toolkit found (set CUDA_HOME to one with nvcc)"
    return ""


def source_dir() -> Path:
    """The csrc/ sources: beside the installed package (a wheel) or in the checkout (editable)."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / PACKAGED_SOURCES, package.parent / "csrc"):
        if all((candidate / name).is_file() for name in CPU_SOURCES):
            return candidate
    raise ImportError(
        f"verl._C has neither a compiled module nor its C++ sources: looked in "
        f"{package / PACKAGED_SOURCES} and {package.parent / 'csrc'}; reinstall verl "
        f"(pip install . from a checkout or an sdist)"
    )


def cache_root() -> Path:
    """The per-user directory of first-use builds (``$VERL_EXTENSION_DIR`` overrides it)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "verl" / "torch_extensions"


def build_key(torch: Any, sources: Path, with_cuda: bool) -> str:
    """A directory name unique to the torch build, the Python ABI, the CUDA choice and the sources."""
    digest = hashlib.sha256()
    for name in (*CPU_SOURCES, *CUDA_SOURCES, *HEADERS):
        path = sources / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    digest.update(repr((CXX_FLAGS, LD_FLAGS, NVCC_FLAGS, with_cuda, torch.version.git_version)).encode())
    torch_tag = torch.__version__.replace("+", "_")
    return (
        f"torch{torch_tag}-{sys.implementation.cache_tag}-{platform.machine()}-"
        f"{'cuda' if with_cuda else 'cpu'}-{digest.hexdigest()[:16]}"
    )


def _import_built(path: Path) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(_MODULE, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built_module(build_dir: Path) -> Path | None:
    """The cached module of a complete earlier build, or None."""
    module = build_dir / "_C.so"  # what cpp_extension.load(name="_C") links
    return module if (build_dir / _DONE).is_file() and module.is_file() else None


def _no_compiler_message(build_dir: Path) -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler):
        return None
    return (
        f"verl._C was not compiled when verl was installed, and compiling it now needs a C++ "
        f"compiler: {compiler!r} was not found on PATH (install one, e.g. apt-get install g++, or "
        f"point CXX at it); or install verl where torch and a compiler are present with "
        f"pip install --no-build-isolation . (build dir: {build_dir})"
    )


def _compile(build_dir: Path, sources: Path, with_cuda: bool, reason: str) -> ModuleType:
    """Compile into ``build_dir`` (the caller holds its lock) and import the result."""
    from torch.utils import cpp_extension

    from verl.utils.env import environ

    missing = _no_compiler_message(build_dir)
    if missing:
        raise ImportError(missing)
    # torch's own baton is free (we hold the lock): a stale one left by a killed build would
    # make torch wait forever.
    (build_dir / "lock").unlink(missing_ok=True)
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    logger.warning(
        "verl._C is not prebuilt for this torch: compiling it once from %s into %s (%s; about a "
        "minute on 2 cores; later imports load the cached module)",
        sources,
        build_dir,
        "with CUDA kernels" if with_cuda else f"CPU kernels only: {reason}",
    )
    # The ninja that pip installs lies beside the interpreter, which need not be on PATH.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    start = time.perf_counter()
    try:
        with environ({"PATH": path}):
            module = cpp_extension.load(
                name="_C",
                sources=[str(sources / n) for n in names],
                extra_cflags=list(CXX_FLAGS) + ([f"-D{CUDA_MACRO[0]}={CUDA_MACRO[1]}"] if with_cuda else []),
                extra_cuda_cflags=list(NVCC_FLAGS) + [f"-D{CUDA_MACRO[0]}={CUDA_MACRO[1]}"],
                extra_ldflags=list(LD_FLAGS),
                extra_include_paths=[str(sources)],
                build_directory=str(build_dir),
                with_cuda=with_cuda,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as exc:
        raise ImportError(f"compiling verl._C in {build_dir} failed: {exc}") from exc
    (build_dir / _DONE).write_text(f"{time.perf_counter() - start:.1f} s\n")
    logger.info("verl._C compiled in %.1f s (%s)", time.perf_counter() - start, build_dir)
    return module


def load_extension() -> ModuleType:
    """``verl._C`` from the first-use cache, compiling it there first when needed (see module doc).

    Raises ImportError with the reason (no compiler, compile error) when it cannot be built.
    """
    import fcntl

    import torch  # first: the module links against libc10/libtorch
    from torch.utils import cpp_extension

    sources = source_dir()
    reason = cuda_skip_reason(torch, cpp_extension.CUDA_HOME)
    with_cuda = not reason
    root = cache_root()
    build_dir = root / build_key(torch, sources, with_cuda)
    cached = _built_module(build_dir)
    if cached is not None:
        return _import_built(cached)
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ImportError(
            f"cannot create the verl._C build cache {build_dir} ({exc}); set {CACHE_ENV} to a writable directory"
        ) from None
    # One process compiles; the others (ranks of one job, parallel test runs) wait for it. The
    # kernel drops the lock when its holder dies, so a killed build never blocks the next one.
    with open(root / f"{build_dir.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is compiling verl._C into %s", build_dir)
            fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _built_module(build_dir)
        if cached is not None:
            return _import_built(cached)
        return _compile(build_dir, sources, with_cuda, reason)
