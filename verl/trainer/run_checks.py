"""Start-up checks every trainer runs before it builds a model: inputs exist, outputs can be written.

- :func:`missing_inputs`: a model directory without ``config.json``, a data file that is not there;
- :func:`check_resume_path`: ``trainer.resume_mode=resume_path`` names a complete checkpoint
  (its manifest and files; checksums are verified when it is loaded), found before any model is
  built rather than after the engines started;
- :func:`check_run_outputs`: every directory the run will write (checkpoints, logs, the Hugging
  Face export) is created and probed with a test file now, not at the first checkpoint; none may
  be an input, hold one or lie inside one (the logs in the model's folder would replace its
  ``config.json``); the export may not replace another output of the run or a non-empty
  directory verl did not write (``verl.utils.outputs``); and a run that starts at step 0 may
  not write into an earlier run's checkpoints (its ``global_step_N`` would be replaced one by
  one, the later ones left beside them) or logs (its metrics would be dropped as re-done steps);
  and no file the run would replace may be one verl did not write (a model's ``config.json`` in the
  folder named as ``trainer.log_dir``, a ``latest_checkpointed_iteration.txt`` of the user's in the
  checkpoint folder): other files beside verl's are left alone;
- one run per output folder: global rank 0 takes the lock of the checkpoint and log folders
  (``verl.utils.run_lock``: a second run into either is refused while the first lives, a lock left
  by a run that is gone is taken over with one line) before the checks that read the folders, and
  holds it until :func:`release_run_outputs` (the trainer's ``close``) or its exit; the other
  ranks check that no other run holds them.

Both raise ``ValueError`` (``OutputPathError`` for outputs) naming the setting at fault.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping, Sequence

from verl.config.schema import RunConfig
from verl.utils.outputs import OutputPathError, check_output_apart, check_output_dir, probe_writable
from verl.utils.paths import check_model_dir
from verl.utils.run_lock import LOCK_FILE, hold_folder, in_use_by_another_run, release_folder

__all__ = [
    "as_file_list",
    "checkpoint_entry",
    "check_resume_path",
    "check_run_outputs",
    "foreign_files",
    "hf_export_dir",
    "log_dir_foreign_files",
    "log_entry",
    "missing_inputs",
    "release_run_outputs",
    "show_files",
]


def as_file_list(files: str | Sequence[str] | None) -> list[str]:
    """A data-files setting (one path, a list, or None) as a list of expanded paths."""
    if files is None:
        return []
    return [os.path.expanduser(f) for f in ([files] if isinstance(files, str) else files)]


def show_files(files: str | Sequence[str] | None) -> str:
    """A data-files setting for a log line: absolute paths, one bare or several in brackets."""
    paths = [os.path.abspath(f) for f in as_file_list(files)]
    return paths[0] if len(paths) == 1 else "[" + ", ".join(paths) + "]"


def missing_inputs(
    *, models: Mapping[str, str | None], data: Mapping[str, str | Sequence[str] | None]
) -> list[str]:
    """One message per problem: ``models`` maps a config key to a Hugging Face directory that must
    hold ``config.json`` (None: the key is not set), ``data`` a config key to files that must exist."""
    problems = []
    for key, path in models.items():
        if not path:
            problems.append(f"{key} is not set; give the Hugging Face model directory ({key}=DIR)")
            continue
        try:
            check_model_dir(path, key)
        except ValueError as exc:  # not a directory, unreadable, no (valid) config.json
            problems.append(str(exc))
    for key, files in data.items():
        for f in as_file_list(files):
            if os.path.exists(f):
                continue
            if glob.has_magic(f):  # a shell pattern reaches here quoted, or from a YAML file
                found = sorted(glob.glob(f))
                matches = (
                    f"it matches {len(found)} file(s): list them, e.g. {key}=[{','.join(found[:2])}{',...' if len(found) > 2 else ''}]"
                    if found else "it matches no file either: list the files, e.g. " + f"{key}=[a.parquet,b.parquet]"
                )
                problems.append(f"{key}: {f} is a pattern, and verl reads the files named, not patterns; {matches}")
            else:
                problems.append(f"{key}: {f} does not exist")
    return problems


# What a run leaves in trainer.log_dir that a later run starting at step 0 would empty (its rewind
# drops every record after step 0): the metrics (verl.trainer.tracking), the RL scores and
# samples (verl.trainer.report), and TensorBoard's events, which it purges.
_REWOUND_LOGS = ("metrics.jsonl", "scores.jsonl", "samples.jsonl", "tensorboard")


def _checkpoint_steps(root: str) -> list[int]:
    """The steps of the ``global_step_N`` checkpoint folders in ``root``, ascending."""
    from verl.utils.checkpoint import step_of_dir_name  # imports torch: not at this module's import

    if not os.path.isdir(root):
        return []
    steps = (step_of_dir_name(name) for name in os.listdir(root) if os.path.isdir(os.path.join(root, name)))
    return sorted(step for step in steps if step is not None)


def _earlier_run_logs(log_dir: str) -> list[str]:
    """The names in ``log_dir`` of an earlier run's logs (non-empty) that a run from step 0 would empty."""
    found = []
    for name in _REWOUND_LOGS:
        path = os.path.join(log_dir, name)
        if (os.path.isfile(path) and os.path.getsize(path) > 0) or (os.path.isdir(path) and os.listdir(path)):
            found.append(name)
    return found


def _jsonl_records(path: str) -> bool:
    """Whether the JSON-lines file ``path`` is empty or starts with a ``{"step": N, ...}`` record."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        return not first.strip() or "step" in json.loads(first)
    except (OSError, ValueError, TypeError):
        return False


def _run_config(path: str) -> bool:
    """Whether ``path`` is a run's ``config.json`` as the trainer writes it (a ``trainer`` section;
    a model's config.json has none)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("trainer"), dict)


def _report_page(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return '<p id="summary">' in f.read(1 << 20)
    except OSError:
        return False


# The files a run replaces or rewinds in trainer.log_dir, each with how to tell one verl wrote.
_LOG_FILES = {
    "metrics.jsonl": _jsonl_records,
    "scores.jsonl": _jsonl_records,
    "samples.jsonl": _jsonl_records,
    "config.json": _run_config,
    "report.html": _report_page,
}


def _tracker_file(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip().isdigit()
    except (OSError, UnicodeDecodeError):
        return False


def foreign_files(folder: str, checks: Mapping[str, Callable[[str], bool]]) -> list[str]:
    """The names of ``checks`` ({file name: whether verl wrote the file at a path}) that are files in
    ``folder`` verl did not write: a run would replace them."""
    found = []
    for name, wrote in checks.items():
        path = os.path.join(folder, name)
        if os.path.lexists(path) and not (os.path.isfile(path) and wrote(path)):
            found.append(name)
    return found


def _refuse_foreign(folder: str, key: str, checks: Mapping[str, Callable[[str], bool]]) -> None:
    names = foreign_files(os.path.expanduser(folder), checks)
    if names:
        raise OutputPathError(
            f"{key}={folder} holds {', '.join(names)}, which verl did not write (a model's or another tool's?); this "
            f"run would replace {'it' if len(names) == 1 else 'them'}: choose a {key} of its own, e.g. an empty "
            "folder (nothing was changed)"
        )


# What else a run writes in trainer.log_dir (appended to or purged, never replaced whole).
_LOG_FOLDERS = ("tensorboard", "wandb", "mlflow.db", "mlartifacts")


def log_entry(name: str) -> bool:
    """Whether ``name``, an entry of ``trainer.log_dir``, is one a run writes there."""
    return name in _LOG_FILES or name in _LOG_FOLDERS or name.removesuffix(".tmp") in _LOG_FILES or name == LOCK_FILE


def log_dir_foreign_files(log_dir: str) -> list[str]:
    """The files in ``log_dir`` that a run's logs would replace and verl did not write."""
    return foreign_files(os.path.expanduser(log_dir), _LOG_FILES)


def hf_export_dir(t: RunConfig) -> str:
    """Where ``trainer.save_hf`` writes the final model (``<default_local_dir>/huggingface`` by default)."""
    return os.path.expanduser(t.hf_export_dir or os.path.join(t.default_local_dir, "huggingface"))


def checkpoint_entry(name: str) -> bool:
    """Whether ``name``, an entry of the checkpoint root, is one the checkpoints write or replace
    (``global_step_N``, its staging and replaced copies, the tracker, the default HF export)."""
    from verl.utils.checkpoint import TRACKER_FILE, step_of_dir_name

    return (
        step_of_dir_name(name.removeprefix(".tmp_").removeprefix("old_")) is not None
        or name in (TRACKER_FILE, "huggingface", LOCK_FILE)
    )


def check_resume_path(t: RunConfig) -> None:
    """With ``trainer.resume_mode=resume_path``: ``trainer.resume_from_path`` is set and is a complete
    checkpoint (``verl.utils.checkpoint.check_checkpoint``). ValueError naming the setting."""
    if t.resume_mode != "resume_path":
        return
    from verl.utils.checkpoint import CheckpointError, check_checkpoint  # imports torch: not at import

    if not t.resume_from_path:
        raise ValueError(
            "trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N folder of an earlier "
            "run); or resume the latest checkpoint with trainer.resume_mode=auto"
        )
    path = os.path.abspath(os.path.expanduser(t.resume_from_path))
    if not os.path.exists(path):
        raise ValueError(
            f"trainer.resume_from_path={t.resume_from_path} does not exist ({path}); give a global_step_N folder "
            "of an earlier run's trainer.default_local_dir, or resume the latest with trainer.resume_mode=auto"
        )
    try:
        check_checkpoint(path)
    except CheckpointError as exc:
        raise ValueError(f"trainer.resume_from_path={t.resume_from_path}: {exc}") from None


def check_run_outputs(t: RunConfig, *, inputs: Mapping[str, str | Sequence[str] | None]) -> None:
    """Fail early (``OutputPathError`` naming the setting) when an output location of the run cannot be used.

    ``inputs`` maps config keys to the run's input paths (models, tokenizers, data files), which
    the Hugging Face export must not replace. The resume checkpoint is checked first
    (:func:`check_resume_path`, a ValueError).
    """
    check_resume_path(t)
    saves = t.save_freq > 0
    logs = any(name in t.logger for name in ("jsonl", "tensorboard", "wandb", "mlflow"))  # all write under log_dir
    if saves:
        check_output_apart(t.default_local_dir, "trainer.default_local_dir", inputs, owns=checkpoint_entry)
    if logs:
        check_output_apart(t.log_dir, "trainer.log_dir", inputs)
    # Before the checks below read the folders: what a live run is writing there is not an earlier run's.
    folders = {"trainer.default_local_dir": t.default_local_dir} if saves or t.resume_mode != "disable" else {}
    if logs:
        folders["trainer.log_dir"] = t.log_dir
    taken = _lock_run_outputs(folders)
    try:
        _check_run_outputs(t, inputs, saves=saves, logs=logs)
    except BaseException:
        for folder in taken:  # a refused run holds nothing
            release_folder(folder)
        raise


def _check_run_outputs(
    t: RunConfig, inputs: Mapping[str, str | Sequence[str] | None], *, saves: bool, logs: bool
) -> None:
    # The run starts at step 0 unless it resumes: auto finds a checkpoint only among global_step_N.
    earlier_steps = _checkpoint_steps(t.default_local_dir)
    fresh = t.resume_mode == "disable" or (t.resume_mode == "auto" and not earlier_steps)
    if saves:
        from verl.utils.checkpoint import TRACKER_FILE

        _refuse_foreign(t.default_local_dir, "trainer.default_local_dir", {TRACKER_FILE: _tracker_file})
        if fresh and earlier_steps:
            shown = ", ".join(f"global_step_{s}" for s in earlier_steps[:3]) + (", ..." if len(earlier_steps) > 3 else "")
            raise OutputPathError(
                f"trainer.default_local_dir={t.default_local_dir} holds the checkpoints of an earlier run ({shown}); "
                f"trainer.resume_mode={t.resume_mode} starts at step 0 and would replace them one by one, leaving the "
                "later ones beside this run's: resume that run (trainer.resume_mode=auto) or choose an empty "
                "trainer.default_local_dir (nothing was changed)"
            )
    if saves or t.resume_mode != "disable":
        probe_writable(t.default_local_dir, key="trainer.default_local_dir")
    if logs:
        _refuse_foreign(t.log_dir, "trainer.log_dir", _LOG_FILES)
        earlier_logs = _earlier_run_logs(t.log_dir) if t.resume_mode != "resume_path" else []
        if fresh and earlier_logs:
            raise OutputPathError(
                f"trainer.log_dir={t.log_dir} holds the logs of an earlier run ({', '.join(earlier_logs)}); this run "
                "starts at step 0 and would delete them as re-done steps: choose another trainer.log_dir (or "
                "trainer.experiment_name), or resume that run (trainer.resume_mode=auto with its checkpoints) "
                "(nothing was changed)"
            )
        probe_writable(t.log_dir, key="trainer.log_dir")
    if t.save_hf:
        export = hf_export_dir(t)
        key = (
            "trainer.hf_export_dir"
            if t.hf_export_dir
            else "trainer.default_local_dir (its huggingface/ export)"
        )
        check_output_dir(
            export,
            key=key,
            inputs=dict(inputs),
            protected={"trainer.default_local_dir": t.default_local_dir, "trainer.log_dir": t.log_dir},
            replace_verl_outputs=True,
        )
        probe_writable(os.path.dirname(os.path.abspath(export)), key=key)


def _lock_run_outputs(folders: Mapping[str, str]) -> list[str]:
    """Global rank 0 takes the lock of each of ``folders`` ({setting: folder}; ``verl.utils.run_lock``);
    every rank raises the same ``FolderInUse`` when another live run holds one. In a started world
    rank 0's verdict is broadcast; before it starts (``main_ppo``, ``main_sft``) the other ranks read
    the lock files, recognising their own rank 0 by its torchrun world. Returns the folders this
    call took (not those this process held already)."""
    import torch.distributed as dist

    from verl.utils.run_lock import FolderInUse

    started = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if started else int(os.environ.get("RANK", "0"))
    if started and dist.get_world_size() > 1:
        verdict: list[str | None] = [None]
        taken: list[str] = []
        if rank == 0:
            try:
                taken = _hold(folders)
            except FolderInUse as exc:
                verdict = [str(exc)]
        dist.broadcast_object_list(verdict, src=0)  # every rank raises, none waits in a collective
        if verdict[0] is not None:
            raise FolderInUse(verdict[0])
        return taken
    if rank == 0:
        return _hold(folders)
    for key, folder in folders.items():
        if (refusal := in_use_by_another_run(os.path.expanduser(folder), key)) is not None:
            raise refusal
    return []


def _hold(folders: Mapping[str, str]) -> list[str]:
    taken: list[str] = []
    try:
        for key, folder in folders.items():
            if hold_folder(os.path.expanduser(folder), key):
                taken.append(os.path.expanduser(folder))
    except BaseException:
        for folder in taken:  # all or none: a refused run holds nothing
            release_folder(folder)
        raise
    return taken


def release_run_outputs(t: RunConfig) -> None:
    """Release this process's locks of the run's checkpoint and log folders (the trainer's ``close``)."""
    for folder in (t.default_local_dir, t.log_dir):
        release_folder(os.path.expanduser(folder))
