"""Checkpoint folders: their layout (the one place its names live: the trainers, the engines and
the model converters import them from here) and ``global_step_N/`` directories written
atomically, with a tracker file.

Layout under the run's checkpoint root (``trainer.default_local_dir``)::

    global_step_20/                 # step_dir_name(20)
        actor/                      # ACTOR_SUBDIR: the engine's save (EngineState below)
            model/                  # MODEL_SUBDIR: Megatron dist checkpoint (+ hf/: HF_SUBDIR)
            optim/  extra/          # OPTIM_SUBDIR, EXTRA_SUBDIR
            engine.json             # ENGINE_META
        critic/                     # CRITIC_SUBDIR (PPO with a critic)
        trainer_state.json          # TRAINER_STATE_FILE: global step, data-loader position, ...
        checkpoint_complete.json    # MANIFEST_FILE: every file with its size and checksum, written last
    latest_checkpointed_iteration.txt   # TRACKER_FILE: "20", rewritten after the directory is in place

How a save survives being killed at any moment:

1. everything is written into ``.tmp_global_step_N`` (a stale one from a killed run is removed first);
2. the manifest is written (and fsynced) last inside it;
3. the directory is renamed to ``global_step_N`` (one ``rename``, atomic on POSIX);
4. the tracker is rewritten through a temp file and ``os.replace``;
5. only then are checkpoints beyond ``max_to_keep`` deleted (never the one the tracker names).

A kill before 3 leaves the previous checkpoint and tracker untouched; between 3 and 4 the
new directory is complete but the tracker still names the previous one (resume uses the
previous one; the newer one is picked up when no tracker exists). A full disk or quota
(``ENOSPC``, ``EDQUOT``, also inside Megatron's and torch's distributed-checkpoint errors) on any
rank before 3: the staging folder is removed and every rank raises the same
:class:`CheckpointDiskFull` line naming the folder, the bytes free and the fix.

The manifest lists every file of the checkpoint with its size and XXH3-128 content checksum
(:mod:`verl.utils.checksum`), and carries a checksum of itself. :meth:`CheckpointManager.validate`
refuses, naming the file, a checkpoint whose manifest is missing or damaged, or whose files
are missing, of another size, of other content (corrupted in place), or not listed. Resume
(``auto``) then falls back to the previous valid checkpoint with a warning naming the bad
one; a checkpoint named explicitly (``resume_path``) is an error. Manifests written before
checksums existed (``{path: size}``) are still accepted, with sizes checked only and a warning.

Every rank calls ``save``, ``validate``, ``latest`` and ``resolve_resume`` together when
torch.distributed is initialised: checksums are computed and verified with the files split
over the ranks (threads within each), and every decision is made once, on rank 0's view or
on the gathered results, so every rank returns the same checkpoint or raises the same error.
Rank 0 does the renames. The checkpoint root must be visible to all ranks (a shared file
system on multi-node runs).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import xxhash

from verl.utils.checksum import ALGORITHM, checksum_files
from verl.utils.logging import log_rank0, warn_once

logger = logging.getLogger(__name__)

__all__ = [
    "ACTOR_SUBDIR",
    "CRITIC_SUBDIR",
    "CheckpointDiskFull",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotShared",
    "ENGINE_META",
    "EXTRA_SUBDIR",
    "HF_SUBDIR",
    "MANIFEST_FILE",
    "MODEL_SUBDIR",
    "OPTIM_SUBDIR",
    "TRAINED_MODEL_ROLE",
    "TRACKER_FILE",
    "TRAINER_STATE_FILE",
    "check_checkpoint",
    "step_dir_name",
    "step_of_dir_name",
    "validate_enclosing_checkpoint",
]

# The layout's names (module docstring).
ACTOR_SUBDIR = "actor"
CRITIC_SUBDIR = "critic"
TRAINED_MODEL_ROLE = ACTOR_SUBDIR
"""The role whose model a trainer checkpoint's ``global_step_N/`` stands for (SFT's model, RL's policy)."""
MODEL_SUBDIR = "model"
OPTIM_SUBDIR = "optim"
EXTRA_SUBDIR = "extra"
ENGINE_META = "engine.json"
HF_SUBDIR = "hf"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "checkpoint_complete.json"
TRAINER_STATE_FILE = "trainer_state.json"
MANIFEST_VERSION = 2
"""2: ``{path: {"size", "xxh3_128"}}`` plus the manifest's own checksum; 1 (no version key):
``{path: size}``."""
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_TMP_PREFIX = ".tmp_"
_OLD_PREFIX = "old_"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete or inconsistent (the message names it)."""


class CheckpointDiskFull(CheckpointError):
    """A save the disk (or the user's quota) had no room for; the message names the folder, the
    bytes free and the fix. The unfinished checkpoint is removed, the earlier ones are kept."""


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full(exc: BaseException | None) -> BaseException | None:
    """The error in ``exc``'s chain that says the disk or the quota is full, or None. Megatron's and
    torch's distributed checkpoints wrap each rank's OSError (``CheckpointException.failures``) and
    re-raise with ``from``; their text keeps the OSError's strerror."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return e
        if any(os.strerror(code) in str(e) for code in _DISK_FULL):
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # torch.distributed.checkpoint: {rank: (exception, trace)}
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, (tuple, BaseException))]
    return None


def _full_reason(exc: BaseException) -> str | None:
    """``No space left on device`` or ``Disk quota exceeded`` when ``exc`` says so, else None."""
    found = _disk_full(exc)
    if found is None:
        return None
    code = getattr(found, "errno", None)
    if code in _DISK_FULL:
        return os.strerror(code)
    return next(os.strerror(c) for c in _DISK_FULL if os.strerror(c) in str(found))


def _size(path: str) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


class CheckpointNotShared(CheckpointError):
    """A checkpoint folder some ranks see differently from rank 0 (not on a shared file system).
    Never skipped as a bad checkpoint: an older one would be just as invisible."""


def step_dir_name(step: int) -> str:
    """``global_step_{step}``."""
    return f"global_step_{step}"


def step_of_dir_name(name: str) -> int | None:
    """The step of a ``global_step_{step}`` folder name; None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _view(path: str) -> str:
    """What this rank sees at checkpoint folder ``path``, in words (equal views: equal strings)."""
    if not os.path.isdir(path):
        return "does not see it" if not os.path.exists(path) else "sees a file, not a folder"
    manifest = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(manifest):
        return "sees it without its manifest"
    return f"sees it with a manifest of {os.path.getsize(manifest)} bytes"


def _check_shared(path: str) -> None:
    """Every rank sees checkpoint folder ``path`` as rank 0 does (collective; nothing to do in a
    world of one). Each rank reads and writes its share of a checkpoint's files, so a folder on a
    disk of one node (or a relative path resolved per node) used to end in a raw KeyError from the
    checksum split or a wait in the engines' load; now every rank raises the same
    :class:`CheckpointNotShared` naming the ranks, their hosts and what each sees."""
    if not _distributed():
        return
    import socket

    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), _view(path)))
    host0, view0 = views[0]
    differ = [(r, host, view) for r, (host, view) in enumerate(views) if view != view0]
    if not differ:
        return
    shown = "; ".join(f"rank {r} ({host}) {view}" for r, host, view in differ[:4])
    more = f" and {len(differ) - 4} more ranks" if len(differ) > 4 else ""
    raise CheckpointNotShared(
        f"checkpoint folder {path} is not the same on every rank: rank 0 ({host0}) {view0}, but {shown}{more}. "
        "Every rank reads and writes its share of a checkpoint: put trainer.default_local_dir (and "
        "trainer.resume_from_path) on a file system all nodes share, as an absolute path"
    )


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on rank 0 only; its result, or its error, on every rank (collective).

    A CheckpointError is raised with the same message on every rank; any other exception is
    re-raised on rank 0 and reported as a RuntimeError elsewhere, so no rank is left waiting.
    """
    if not _distributed():
        return fn()
    holder: list[Any] = [None]
    error: BaseException | None = None
    if _rank() == 0:
        try:
            holder[0] = ("ok", fn())
        except CheckpointError as exc:
            holder[0] = ("checkpoint_error", (type(exc), str(exc)))
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks are told
            holder[0] = ("error", f"{type(exc).__name__}: {exc}")
            error = exc
    dist.broadcast_object_list(holder, src=0)
    kind, value = holder[0]
    if error is not None:
        raise error
    if kind == "checkpoint_error":
        cls, message = value
        raise cls(message)
    if kind == "error":
        raise RuntimeError(f"rank 0 failed in the checkpoint folder: {value}")
    return value


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old or the new content, never a part."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _list_files(root: str) -> list[str]:
    """Relative path of every file under ``root`` (the manifest excluded), sorted."""
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def _manifest_checksum(manifest: dict[str, Any]) -> str:
    """Checksum of the manifest's content (all keys but its own checksum), canonically serialised."""
    body = {k: v for k, v in manifest.items() if k != "manifest_" + ALGORITHM}
    return xxhash.xxh3_128(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _shown(problems: list[str]) -> str:
    return "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")


@dataclass(frozen=True)
class _Manifest:
    step: int
    sizes: dict[str, int]
    digests: dict[str, str] | None  # None: a version-1 manifest (sizes only)


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """One complete checkpoint on disk."""

    step: int
    """Global step it was taken after."""
    path: str
    """Its ``global_step_N`` directory."""


class CheckpointManager:
    """Saves, finds, validates and prunes ``global_step_N`` checkpoints under ``root``.

    Args:
        root: the run's checkpoint directory (created on first save).
        max_to_keep: keep at most this many complete checkpoints (oldest deleted first); None keeps all.
    """

    def __init__(self, root: str, *, max_to_keep: int | None = None) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be None or >= 1, got {max_to_keep}")
        self.root = os.path.abspath(os.path.expanduser(root))
        self.max_to_keep = max_to_keep

    # -- paths -----------------------------------------------------------------------------

    @property
    def tracker_path(self) -> str:
        """The ``latest_checkpointed_iteration.txt`` file."""
        return os.path.join(self.root, TRACKER_FILE)

    def step_path(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives (whether or not it exists)."""
        return os.path.join(self.root, step_dir_name(step))

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, write: Callable[[str], None], trainer_state: dict[str, Any]) -> str:
        """Write the checkpoint of ``step`` (collective: every rank calls it); returns its path.

        ``write(tmp_dir)`` is called on every rank to write the engines' state into
        ``tmp_dir`` (e.g. ``engine.save(os.path.join(tmp_dir, "actor"))``); ``trainer_state``
        (JSON-serialisable, identical on every rank) goes to ``trainer_state.json``.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        final = self.step_path(step)
        tmp = os.path.join(self.root, _TMP_PREFIX + step_dir_name(step))

        def on_disk(fn: Callable[[], Any]) -> Callable[[], Any]:
            """``fn`` (run on rank 0) with a full disk raised as :class:`CheckpointDiskFull`."""

            def run() -> Any:
                try:
                    return fn()
                except OSError as exc:
                    reason = _full_reason(exc)
                    if reason is None:
                        raise
                    raise CheckpointDiskFull(self._disk_full_message(step, tmp, reason)) from None

            return run

        def prepare() -> None:
            os.makedirs(self.root, exist_ok=True)
            self._remove_stale_temps()
            os.makedirs(tmp)

        _on_rank0(on_disk(prepare))  # every rank raises rank 0's error (no rank left at a barrier)
        try:
            _check_shared(tmp)
        except CheckpointNotShared:
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            write(tmp)
            error = None
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error = exc
        self._agree_on_write(step, tmp, error)

        def write_state_and_list() -> list[str]:
            state = dict(trainer_state)
            state["global_step"] = step
            with open(os.path.join(tmp, TRAINER_STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(state, f, indent=2, sort_keys=True)
            return _list_files(tmp)

        # Rank 0's listing, hashed by every rank (each its share of the files).
        files = _on_rank0(on_disk(write_state_and_list))
        digests = checksum_files(tmp, files)
        unreadable = [f"{rel}: {d.error}" for rel, d in digests.items() if d.digest is None]
        if unreadable:
            raise OSError(f"checkpoint {tmp}: cannot read back what was written: {_shown(unreadable)}")
        _on_rank0(on_disk(lambda: self._finish(step, tmp, final, digests)))
        return final

    def _finish(self, step: int, tmp: str, final: str, digests: dict[str, Any]) -> None:
        """Rank 0: the manifest written last into ``tmp``, ``tmp`` renamed to ``final``, the tracker, pruning."""
        manifest: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "global_step": step,
            "hash": ALGORITHM,
            "files": {rel: {"size": d.size, ALGORITHM: d.digest} for rel, d in digests.items()},
        }
        manifest["manifest_" + ALGORITHM] = _manifest_checksum(manifest)
        with open(os.path.join(tmp, MANIFEST_FILE), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):
            # Re-saving a step (e.g. after resuming from it): the old copy goes only once
            # the new one is complete.
            old = os.path.join(self.root, _TMP_PREFIX + _OLD_PREFIX + step_dir_name(step))
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.root)
        _write_atomic(self.tracker_path, f"{step}\n")
        self._prune(keep=step)
        log_rank0(logger, logging.INFO, "saved checkpoint %s", final)

    def _agree_on_write(self, step: int, tmp: str, error: BaseException | None) -> None:
        """After every rank's ``write(tmp)`` (collective): nothing when all succeeded; otherwise every
        rank raises: one :class:`CheckpointDiskFull` line when any rank found the disk full, else
        this rank's own error (a RuntimeError naming the failed rank on the others, which would
        otherwise wait for it at the next barrier)."""
        mine = None if error is None else (_full_reason(error), f"{type(error).__name__}: {error}".split("\n")[0])
        outcomes = [mine]
        if _distributed():
            outcomes = [None] * dist.get_world_size()
            dist.all_gather_object(outcomes, mine)
        failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
        if not failed:
            return
        full = [(rank, reason) for rank, (reason, _) in failed if reason is not None]
        if full:
            ranks = [rank for rank, _ in full] if _distributed() else None
            message = _on_rank0(lambda: self._disk_full_message(step, tmp, full[0][1], ranks=ranks))
            raise CheckpointDiskFull(message) from None
        if error is not None:
            raise error
        rank, (_, text) = failed[0]
        raise RuntimeError(f"checkpoint of step {step}: rank {rank} failed writing it ({text:.300}); see that rank's log")

    def _disk_full_message(self, step: int, tmp: str, reason: str | None, *, ranks: list[int] | None = None) -> str:
        """Rank 0: the unfinished ``tmp`` removed (its space given back) and the one line saying so."""
        written = _size(tmp)
        removed = os.path.isdir(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        where = os.path.abspath(self.root)
        while not os.path.isdir(where) and os.path.dirname(where) != where:
            where = os.path.dirname(where)
        free = shutil.disk_usage(where).free
        by = f" on rank(s) {', '.join(map(str, ranks))}" if ranks else ""
        done = (
            f"the unfinished checkpoint ({_bytes(written)} written) was removed and the earlier checkpoints are kept"
            if removed
            else "the earlier checkpoints are kept"
        )
        return (
            f"checkpoint of step {step} into {self.root}: {reason or os.strerror(errno.ENOSPC)}{by}; {_bytes(free)} "
            f"free there now ({done}): "
            "free space on that disk, or point trainer.default_local_dir at a folder on a disk with room"
        )

    def _remove_stale_temps(self) -> None:
        for name in sorted(os.listdir(self.root)):
            if name.startswith(_TMP_PREFIX):
                path = os.path.join(self.root, name)
                replaced = (
                    name[len(_TMP_PREFIX + _OLD_PREFIX) :]
                    if name.startswith(_TMP_PREFIX + _OLD_PREFIX)
                    else None
                )
                if replaced is not None and not os.path.exists(os.path.join(self.root, replaced)):
                    # Killed between moving the old copy aside and renaming the new one in.
                    logger.warning(
                        "restoring %s from %s (a save was interrupted while replacing it)", replaced, path
                    )
                    os.replace(path, os.path.join(self.root, replaced))
                    continue
                logger.warning("removing %s left by an interrupted save", path)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)

    def _prune(self, *, keep: int) -> None:
        if self.max_to_keep is None:
            return
        steps = sorted(self._step_dirs())
        excess = len(steps) - self.max_to_keep
        for step in steps:
            if excess <= 0:
                break
            if step == keep:
                continue
            path = self.step_path(step)
            logger.info("removing old checkpoint %s (max_to_keep=%d)", path, self.max_to_keep)
            shutil.rmtree(path)
            excess -= 1

    # -- finding and validating ------------------------------------------------------------

    def _step_dirs(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        steps = []
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            if m and os.path.isdir(os.path.join(self.root, name)):
                steps.append(int(m.group(1)))
        return steps

    @staticmethod
    def validate(path: str, *, within: str | None = None) -> int:
        """Check that ``path`` is a complete checkpoint with the content it was saved with; returns its step.

        Rank 0 reads the manifest and checks that every file is there with its size and that
        nothing unlisted was added; then every file's checksum is verified (only those under
        the subdirectory ``within`` when given), the files split over the ranks (collective
        when torch.distributed is initialised: every rank calls it and gets the same answer).
        Raises CheckpointError naming what is wrong.
        """
        _check_shared(path)
        manifest = _on_rank0(lambda: _read_manifest(path))
        if manifest.digests is None:
            warn_once(
                logger,
                "checkpoint %s has a manifest without checksums (written by an older verl): only file "
                "sizes are checked, content is not verified",
                path,
            )
            return manifest.step
        prefix = None if within is None else os.path.normpath(within) + os.sep
        checked = sorted(rel for rel in manifest.digests if prefix is None or rel.startswith(prefix))
        digests = checksum_files(path, checked)
        problems = []
        for rel in checked:
            expected, got = manifest.digests[rel], digests[rel]
            if got.digest is None:
                problems.append(f"{rel} cannot be read ({got.error})")
            elif got.size != manifest.sizes[rel]:
                problems.append(f"{rel} has {got.size} bytes, the manifest says {manifest.sizes[rel]}")
            elif got.digest != expected:
                problems.append(
                    f"{rel} does not hold what was saved ({ALGORITHM} {got.digest}, the manifest says "
                    f"{expected}: corrupted in place?)"
                )
        if problems:
            raise CheckpointError(f"checkpoint {path} is corrupt: {_shown(problems)}")
        return manifest.step

    def _read_tracker_and_steps(self) -> tuple[int | None, list[int]]:
        """(the tracker's step, or None when there is no readable tracker; every step dir, newest first)."""
        tracked = None
        if os.path.isfile(self.tracker_path):
            with open(self.tracker_path, encoding="utf-8", errors="replace") as f:
                text = f.read().strip()
            if text.isdigit():
                tracked = int(text)
            else:
                logger.warning(
                    "%s holds %r, not a step number: ignoring it and using the newest complete checkpoint",
                    self.tracker_path,
                    text[:40],
                )
        return tracked, sorted(self._step_dirs(), reverse=True)

    def _newest_valid(self, steps: list[int]) -> CheckpointInfo | None:
        """The first of ``steps`` (newest first) that validates; the others are skipped with a warning."""
        for step in steps:
            path = self.step_path(step)
            try:
                self.validate(path)
            except CheckpointNotShared:
                raise
            except CheckpointError as exc:
                log_rank0(logger, logging.WARNING, "skipping %s", exc)
                continue
            return CheckpointInfo(step=step, path=path)
        return None

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint to resume from; None if there is none.

        The tracker's checkpoint when it validates. When it is missing, incomplete or corrupt:
        the newest valid checkpoint older than it, with a warning naming the bad one (an error
        when there is none: never a silent fresh start). Without a readable tracker: the newest
        valid checkpoint. Collective when torch.distributed is initialised.
        """
        tracked, steps = _on_rank0(self._read_tracker_and_steps)
        if tracked is None:
            found = self._newest_valid(steps)
            if found is not None:
                log_rank0(
                    logger,
                    logging.WARNING,
                    "no usable %s in %s: using the newest complete checkpoint %s",
                    TRACKER_FILE,
                    self.root,
                    found.path,
                )
            return found
        path = self.step_path(tracked)
        try:
            self.validate(path)
        except CheckpointNotShared:
            raise
        except CheckpointError as exc:
            found = self._newest_valid([s for s in steps if s < tracked])
            if found is None:
                raise CheckpointError(
                    f"{exc}; {TRACKER_FILE} names it and there is no earlier complete checkpoint in "
                    f"{self.root} to fall back to"
                ) from None
            log_rank0(
                logger,
                logging.WARNING,
                "%s names step %d, which cannot be used (%s); resuming from the previous complete "
                "checkpoint %s",
                self.tracker_path,
                tracked,
                exc,
                found.path,
            )
            return found
        newer = [s for s in steps if s > tracked]
        if newer:
            log_rank0(
                logger,
                logging.WARNING,
                "%s names step %d but %s exist (a save finished after the tracker was last written?); "
                "resuming from step %d as the tracker says",
                self.tracker_path,
                tracked,
                ", ".join(step_dir_name(s) for s in sorted(newer)),
                tracked,
            )
        return CheckpointInfo(step=tracked, path=path)

    def resolve_resume(self, resume_mode: str, resume_from_path: str | None) -> CheckpointInfo | None:
        """The checkpoint ``trainer.resume_mode`` selects: auto (latest, if any), disable (None), resume_path.

        Collective when torch.distributed is initialised: rank 0 first clears what an
        interrupted save left behind (restoring a checkpoint it was replacing).
        """
        if resume_mode == "disable":
            return None
        if _rank() == 0 and os.path.isdir(self.root):
            self._remove_stale_temps()
        _barrier()
        if resume_mode == "auto":
            return self.latest()
        if resume_mode == "resume_path":
            if not resume_from_path:
                raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
            path = os.path.abspath(os.path.expanduser(resume_from_path))
            step = self.validate(path)
            return CheckpointInfo(step=step, path=path)
        raise ValueError(f"trainer.resume_mode={resume_mode!r}; use auto, disable or resume_path")

    @staticmethod
    def read_trainer_state(path: str) -> dict[str, Any]:
        """The ``trainer_state.json`` of a (validated) checkpoint; CheckpointError when it is unreadable."""
        state_path = os.path.join(path, TRAINER_STATE_FILE)
        try:
            with open(state_path, encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{state_path} is unreadable ({exc})") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{state_path} holds {type(state).__name__}, not a JSON object")
        return state


def check_checkpoint(path: str) -> int:
    """The step of checkpoint folder ``path`` after a cheap look: its manifest is there and readable,
    every listed file is there with its size, nothing is unlisted (no checksums; not collective).
    What ``trainer.resume_from_path`` is checked with before any model is built; the full
    :meth:`CheckpointManager.validate` runs when it is loaded. Raises CheckpointError naming what
    is wrong."""
    return _read_manifest(os.path.abspath(os.path.expanduser(path))).step


def validate_enclosing_checkpoint(path: str) -> str | None:
    """When ``path`` lies inside a ``global_step_N`` checkpoint, validate it; returns that checkpoint or None.

    For tools that read part of a trainer checkpoint (megatron2hf on ``global_step_N/actor/model``):
    the checkpoint must be complete, and the files under ``path`` must hold what was saved.
    Raises CheckpointError naming the file otherwise. Not collective.
    """
    path = os.path.abspath(path)
    parent = path
    for _ in range(4):
        if _STEP_DIR.match(os.path.basename(parent)) and os.path.isfile(os.path.join(parent, MANIFEST_FILE)):
            within = os.path.relpath(path, parent)
            CheckpointManager.validate(parent, within=None if within == "." else within)
            return parent
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    return None


def _read_manifest(path: str) -> _Manifest:
    """The manifest of checkpoint ``path``, after checking every file's presence and size (no checksums).

    Raises CheckpointError naming what is missing, of another size, unlisted or unreadable.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    manifest_path = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(manifest_path):
        steps = sorted((int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(path)) if m), reverse=True)
        if steps or os.path.isfile(os.path.join(path, TRACKER_FILE)):
            # Not an interrupted save: the run's checkpoint root, given where one checkpoint belongs.
            held = ", ".join(step_dir_name(s) for s in steps[:3]) if steps else TRACKER_FILE
            latest = f"; the newest is {os.path.join(path, step_dir_name(steps[0]))}" if steps else ""
            raise CheckpointError(
                f"{path} is a checkpoint directory of a run (it holds {held}), not one checkpoint: give one "
                f"of its global_step_N directories as trainer.resume_from_path{latest}, or resume its latest "
                f"with trainer.resume_mode=auto trainer.default_local_dir={path}"
            )
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {MANIFEST_FILE} is missing (the save was interrupted or the "
            "directory was copied partially); resume from an earlier checkpoint with "
            "trainer.resume_mode=resume_path trainer.resume_from_path=...global_step_K"
        )
    try:
        with open(manifest_path, encoding="utf-8") as f:
            raw = json.load(f)
        step = int(raw["global_step"])
        files = raw["files"]
        version = raw.get("version", 1)
        if version == 1:
            sizes = {str(rel): int(size) for rel, size in files.items()}
            digests = None
        elif version == MANIFEST_VERSION:
            if raw.get("manifest_" + ALGORITHM) != _manifest_checksum(raw):
                raise CheckpointError(
                    f"checkpoint {path} is corrupt: {MANIFEST_FILE} does not match its own checksum "
                    "(damaged after it was written)"
                )
            if raw.get("hash") != ALGORITHM:
                raise CheckpointError(
                    f"checkpoint {path}: {MANIFEST_FILE} uses hash {raw.get('hash')!r}; this verl verifies "
                    f"{ALGORITHM!r}"
                )
            sizes = {str(rel): int(entry["size"]) for rel, entry in files.items()}
            digests = {str(rel): str(entry[ALGORITHM]) for rel, entry in files.items()}
        else:
            raise CheckpointError(
                f"checkpoint {path}: {MANIFEST_FILE} has version {version!r}; this verl reads versions 1 and "
                f"{MANIFEST_VERSION} (written by a newer verl?)"
            )
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE} is unreadable ({exc!r})") from None
    problems = []
    for rel, size in sorted(sizes.items()):
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            problems.append(f"{rel} is missing")
        elif os.path.getsize(full) != size:
            problems.append(f"{rel} has {os.path.getsize(full)} bytes, the manifest says {size}")
    unlisted = [rel for rel in _list_files(path) if rel not in sizes]
    problems += [f"{rel} is not in the manifest (added after the save?)" for rel in unlisted]
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupt: {_shown(problems)}")
    return _Manifest(step=step, sizes=sizes, digests=digests)
