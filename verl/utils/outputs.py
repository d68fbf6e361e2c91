"""Output locations that lose nothing: checked before work starts, written beside the target, renamed in.

Every directory verl produces as a whole (a converted checkpoint, a Hugging Face export) goes
through three steps:

1. :func:`check_output_dir` before any work: the target may not be an input, hold an input or
   sit inside one (exporting onto the model being trained would delete its tokenizer); an
   existing non-empty directory verl did not write (no :data:`MARKER_FILE`) is always refused,
   an explicit overwrite included (it would delete the user's files); one verl wrote is replaced
   when the caller allows replacing such outputs or the user passed an explicit overwrite, unless
   it holds a file its marker does not list (put there by the user since: refused, naming it).
2. :func:`staging_dir`: the work is written into a hidden sibling of the target.
3. :func:`commit_output`: the finished sibling is renamed to the target (an old verl output is
   moved aside first and deleted only once the new one is in place), so an interrupted run
   never leaves a partial directory under the target name and never deletes the old one early.

:func:`probe_writable` finds an unwritable location at start-up instead of at the first save;
:func:`log_output_locations` tells the user, at the start and at the end of a run, where every
output of the run is (absolute paths), once.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "MARKER_FILE",
    "OutputLocation",
    "added_since_written",
    "OutputPathError",
    "check_output_apart",
    "check_output_dir",
    "commit_output",
    "log_output_locations",
    "probe_writable",
    "staging_dir",
]

logger = logging.getLogger(__name__)

MARKER_FILE = ".verl_output.json"
"""Written into every directory :func:`commit_output` puts in place: who wrote it, and when."""


class OutputPathError(ValueError):
    """An output location that cannot be used as asked (the message names the setting and the fix)."""


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def _inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (both real, absolute)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_output_apart(
    output: str,
    key: str,
    inputs: Mapping[str, str | Iterable[str] | None],
    *,
    owns: Callable[[str], bool] | None = None,
) -> None:
    """OutputPathError when the output ``output`` (setting or flag ``key``) is an input of ``inputs``
    ({setting or flag: path or paths}), lies inside one, or contains one: writing it would replace or
    delete what the run reads. The one rule every output (file or directory) of verl follows.

    ``owns(name)``: for an output folder whose writer replaces only some entries of it (a
    checkpoint root: ``global_step_N/``, its staging folders, the tracker), whether the entry
    ``name`` is one of them; an input in another entry of the folder is left alone (the Python
    API's ``output_dir/model_init/`` beside its checkpoints)."""
    target = _real(output)
    for name, value in inputs.items():
        for item in [value] if isinstance(value, str) else list(value or []):
            source = _real(item)
            if owns is not None and source != target and _inside(source, target):
                if not owns(os.path.relpath(source, target).split(os.sep)[0]):
                    continue
            if _inside(target, source) or _inside(source, target):
                relation = "is" if target == source else ("is inside" if _inside(target, source) else "contains")
                raise OutputPathError(
                    f"{key}={output} {relation} the input {name}={item}; writing there would replace or delete "
                    f"what it is made from: choose a {key} elsewhere"
                )


def written_by_verl(path: str) -> bool:
    """Whether ``path`` is a directory :func:`commit_output` created."""
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def check_output_dir(
    path: str,
    *,
    key: str,
    inputs: Mapping[str, str | Iterable[str] | None] = {},
    protected: Mapping[str, str | None] = {},
    overwrite: bool = False,
    replace_verl_outputs: bool = False,
) -> str:
    """Refuse an output directory that would lose something; returns its absolute path.

    Args:
        path: the directory a whole output will be renamed to.
        key: how the user named it (``trainer.hf_export_dir``, ``--out-dir``), for messages.
        inputs: setting -> path(s) the run reads; the output may not equal, contain or lie inside one.
        protected: setting -> another output of the run (checkpoints, logs); the output may lie
            inside one but not equal or contain it (replacing it would delete that output).
        overwrite: the user asked to replace an earlier output of verl there (``--overwrite``); a
            directory verl did not write is refused all the same.
        replace_verl_outputs: an existing directory verl wrote earlier may be replaced without
            ``overwrite`` (a trainer's export at the end of every run).
    """
    check_output_apart(path, key, inputs)
    target = _real(path)
    for name, item in protected.items():
        if item and _inside(_real(item), target):
            relation = "is" if _real(item) == target else "contains"
            raise OutputPathError(
                f"{key}={path} {relation} {name}={item}: replacing it would delete that output; "
                f"choose a {key} that does not hold it"
            )
    if os.path.lexists(target):
        if not os.path.isdir(target):
            raise OutputPathError(f"{key}={path} exists and is not a directory; choose another {key}")
        names = sorted(os.listdir(target))
        if names and not written_by_verl(target):
            # Never replaced, --overwrite or not: the user's files in it would be deleted with it.
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            asked = "; --overwrite replaces only a folder verl wrote" if overwrite else ""
            raise OutputPathError(
                f"{key}={path} already exists, is not empty and was not written by verl (it holds {shown}){asked}: "
                f"choose another {key} (nothing was changed)"
            )
        added = added_since_written(target)
        if added:
            # The folder is verl's, but these were put in it since: replacing it would delete them.
            shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
            raise OutputPathError(
                f"{key}={path} holds {shown}, which verl did not write (added after its {_what_verl_wrote(target)}); "
                f"replacing the folder would delete {'it' if len(added) == 1 else 'them'}: move "
                f"{'it' if len(added) == 1 else 'them'} out, or choose another {key} (nothing was changed)"
            )
        if names and not (overwrite or replace_verl_outputs):
            raise OutputPathError(
                f"{key}={path} holds an earlier {_what_verl_wrote(target)}; pass --overwrite to replace it "
                f"(once the new one is complete) or choose another {key} (nothing was changed)"
            )
    return target


def _marker(path: str) -> dict:
    """The marker file of the verl output ``path`` ({} when it cannot be read)."""
    try:
        with open(os.path.join(path, MARKER_FILE), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def added_since_written(path: str) -> list[str]:
    """The entries of the verl output ``path`` that its marker does not list: put there after
    verl wrote it. (A marker from before the list was kept lists nothing: nothing is reported.)"""
    listed = _marker(path).get("files")
    if not isinstance(listed, list) or not os.path.isdir(path):
        return []
    return sorted(set(os.listdir(path)) - set(listed) - {MARKER_FILE})


def _what_verl_wrote(path: str) -> str:
    """The ``what`` of a verl output's marker file ("output of verl" when it cannot be read)."""
    try:
        with open(os.path.join(path, MARKER_FILE), encoding="utf-8") as f:
            what = json.load(f).get("what")
    except (OSError, ValueError, AttributeError):
        what = None
    return f"{what} written by verl" if isinstance(what, str) and what else "output of verl"


def probe_writable(path: str, *, key: str) -> None:
    """Check that ``path`` can be created and written, leaving nothing behind: write and remove a
    probe file in ``path`` when it exists, else make and remove a uniquely named directory in its
    nearest existing ancestor (making ``path`` then needs nothing more). Every rank of a job may
    probe the same path at once. OutputPathError naming ``key`` if the probe fails."""
    target = os.path.abspath(os.path.expanduser(path))
    existing = target
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), existing)
        if existing == target:
            fd, probe = tempfile.mkstemp(prefix=".verl-write-probe-", dir=target)
            os.close(fd)
            os.remove(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".verl-write-probe-", dir=existing))
    except OSError as exc:
        raise OutputPathError(
            f"{key}={path} cannot be written ({exc.strerror or exc}); choose a directory this user can write"
        ) from None


def staging_dir(out_dir: str) -> str:
    """A fresh hidden sibling of ``out_dir`` to write the output into (its parent is created)."""
    target = os.path.abspath(out_dir)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=parent)


def commit_output(tmp_dir: str, out_dir: str, *, what: str) -> None:
    """Put the finished ``tmp_dir`` in place as ``out_dir``; an old ``out_dir`` is deleted only afterwards.

    ``what`` (e.g. "Hugging Face export") goes into the marker file.
    """
    target = os.path.abspath(out_dir)
    with open(os.path.join(tmp_dir, MARKER_FILE), "w", encoding="utf-8") as f:
        files = sorted(os.listdir(tmp_dir))  # what verl put there; anything else found later is the user's
        json.dump({"written_by": "verl", "what": what, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}, f)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_dir, 0o777 & ~umask)  # mkdtemp makes it private; the result should not be
    old = None
    if os.path.lexists(target):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(target))
        os.rmdir(old)
        os.rename(target, old)
    os.rename(tmp_dir, target)
    if old is not None:
        for name in added_since_written(old):  # put there since verl wrote it (after the start-up check)
            kept = name if not os.path.lexists(os.path.join(target, name)) else f"{name}.kept"
            os.rename(os.path.join(old, name), os.path.join(target, kept))
            logger.warning("%s: kept %s, which verl did not write, in the new output (as %s)", target, name, kept)
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class OutputLocation:
    """One output of a run, for :func:`log_output_locations`."""

    label: str
    """What it is ("checkpoints", "metrics (jsonl)", "W&B run")."""
    path: str
    """Where: a local path (made absolute when listed) or a URL/URI (kept as given)."""
    when: str = ""
    """When it is written ("every 600 steps and at the end"), said at the start only."""
    use: str = ""
    """How to use it ("tensorboard --logdir ..."), said at the start and at the end."""


def _is_local(path: str) -> bool:
    return "://" not in path and not path.startswith("sqlite:")


def log_output_locations(
    title: str, locations: Sequence[OutputLocation], *, logger: logging.Logger, at_end: bool = False
) -> None:
    """Log ``title`` and one aligned line per location (local paths absolute). ``at_end``: a local
    path that does not exist is marked "not written" (its ``use`` still said: how to make it).
    Callers log on one rank only."""
    if not locations:
        return
    width = max(len(loc.label) for loc in locations)
    logger.info("%s:", title)
    for loc in locations:
        path = os.path.abspath(os.path.expanduser(loc.path)) if _is_local(loc.path) else loc.path
        if at_end and _is_local(loc.path) and not os.path.exists(path):
            notes = ["not written", *([loc.use] if loc.use else [])]
        else:
            notes = [n for n in ((loc.when if not at_end else ""), loc.use) if n]
        logger.info("  %s  %s%s", loc.label.ljust(width), path, f"  ({'; '.join(notes)})" if notes else "")
