"""Trainer checkpoints: ``global_step_N/`` directories, written atomically, with a tracker file.

Layout under the run's checkpoint root (``trainer.default_local_dir``)::

    global_step_20/
        actor/                      # MegatronEngine.save (model/, optim/, extra/, engine.json)
        critic/                     # (PPO with a critic)
        trainer_state.json          # global step, data-loader position, anything the trainer adds
        checkpoint_complete.json    # manifest: every file with its size, written last
    latest_checkpointed_iteration.txt   # "20", rewritten after the directory is in place

How a save survives being killed at any moment:

1. everything is written into ``.tmp_global_step_N`` (a stale one from a killed run is removed first);
2. the manifest is written (and fsynced) last inside it;
3. the directory is renamed to ``global_step_N`` (one ``rename``, atomic on POSIX);
4. the tracker is rewritten through a temp file and ``os.replace``;
5. only then are checkpoints beyond ``max_to_keep`` deleted (never the one the tracker names).

A kill before 3 leaves the previous checkpoint and tracker untouched; between 3 and 4 the
new directory is complete but the tracker still names the previous one (resume uses the
previous one; the newer one is picked up when no tracker exists). A checkpoint whose
manifest is missing or disagrees with the files on disk is reported by name and never loaded.

Every rank calls ``save`` together (the write function is collective); rank 0 does the
renames. The checkpoint root must be visible to all ranks (a shared file system on
multi-node runs).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from verl.utils.logging import log_rank0

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "MANIFEST_FILE",
    "TRACKER_FILE",
    "TRAINER_STATE_FILE",
    "step_dir_name",
]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "checkpoint_complete.json"
TRAINER_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_TMP_PREFIX = ".tmp_"
_OLD_PREFIX = "old_"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete or inconsistent (the message names it)."""


def step_dir_name(step: int) -> str:
    """``global_step_{step}``."""
    return f"global_step_{step}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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


def _list_files(root: str) -> dict[str, int]:
    """Relative path -> size of every file under ``root`` (the manifest excluded)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if rel != MANIFEST_FILE:
                out[rel] = os.path.getsize(full)
    return out


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
        if _rank() == 0:
            os.makedirs(self.root, exist_ok=True)
            self._remove_stale_temps()
            os.makedirs(tmp)
        _barrier()
        write(tmp)
        _barrier()
        if _rank() == 0:
            state = dict(trainer_state)
            state["global_step"] = step
            with open(os.path.join(tmp, TRAINER_STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(state, f, indent=2, sort_keys=True)
            manifest = {"global_step": step, "files": _list_files(tmp)}
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
        _barrier()
        return final

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
    def validate(path: str) -> int:
        """Check that ``path`` is a complete checkpoint; returns its step.

        Raises CheckpointError naming what is wrong.
        """
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint {path} does not exist")
        manifest_path = os.path.join(path, MANIFEST_FILE)
        if not os.path.isfile(manifest_path):
            raise CheckpointError(
                f"checkpoint {path} is incomplete: {MANIFEST_FILE} is missing (the save was interrupted or "
                "the "
                "directory was copied partially); resume from an earlier checkpoint with "
                "trainer.resume_mode=resume_path trainer.resume_from_path=...global_step_K"
            )
        try:
            with open(manifest_path, encoding="utf-8") as f:
                manifest = json.load(f)
            files: dict[str, int] = manifest["files"]
            step = int(manifest["global_step"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE} is unreadable ({exc})") from None
        problems = []
        for rel, size in sorted(files.items()):
            full = os.path.join(path, rel)
            if not os.path.isfile(full):
                problems.append(f"{rel} is missing")
            elif os.path.getsize(full) != size:
                problems.append(f"{rel} has {os.path.getsize(full)} bytes, the manifest says {size}")
        if problems:
            shown = "; ".join(problems[:5]) + (
                f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            )
            raise CheckpointError(f"checkpoint {path} is corrupt: {shown}")
        return step

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint to resume from: the tracker's, else the newest complete one; None if there is none.

        A tracker that names a missing or corrupt checkpoint is an error (never silently
        replaced by an older one).
        """
        if os.path.isfile(self.tracker_path):
            with open(self.tracker_path, encoding="utf-8") as f:
                text = f.read().strip()
            if not text.isdigit():
                raise CheckpointError(f"{self.tracker_path} holds {text!r}, not a step number")
            step = int(text)
            path = self.step_path(step)
            self.validate(path)
            newer = [s for s in self._step_dirs() if s > step]
            if newer:
                logger.warning(
                    "%s names step %d but %s exist (a save finished after the tracker was last written?); "
                    "resuming from step %d as the tracker says",
                    self.tracker_path,
                    step,
                    ", ".join(step_dir_name(s) for s in sorted(newer)),
                    step,
                )
            return CheckpointInfo(step=step, path=path)
        for step in sorted(self._step_dirs(), reverse=True):
            path = self.step_path(step)
            try:
                self.validate(path)
            except CheckpointError as exc:
                logger.warning("skipping %s", exc)
                continue
            logger.warning(
                "no %s in %s: using the newest complete checkpoint %s", TRACKER_FILE, self.root, path
            )
            return CheckpointInfo(step=step, path=path)
        return None

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
        """The ``trainer_state.json`` of a (validated) checkpoint."""
        with open(os.path.join(path, TRAINER_STATE_FILE), encoding="utf-8") as f:
            return json.load(f)
