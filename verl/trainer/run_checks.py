"""Start-up checks every trainer runs before it builds a model: inputs exist, outputs can be written.

- :func:`missing_inputs`: a model directory without ``config.json``, a data file that is not there;
- :func:`check_run_outputs`: every directory the run will write (checkpoints, logs, the Hugging
  Face export) is created and probed with a test file now, not at the first checkpoint; the
  export may not replace an input, another output of the run, or a non-empty directory verl did
  not write (``verl.utils.outputs``).

Both raise ``ValueError`` (``OutputPathError`` for outputs) naming the setting at fault.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from verl.config.schema import RunConfig
from verl.utils.outputs import check_output_dir, probe_writable
from verl.utils.paths import check_model_dir

__all__ = ["as_file_list", "check_run_outputs", "hf_export_dir", "missing_inputs", "show_files"]


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
            if not os.path.exists(f):
                problems.append(f"{key}: {f} does not exist")
    return problems


def hf_export_dir(t: RunConfig) -> str:
    """Where ``trainer.save_hf`` writes the final model (``<default_local_dir>/huggingface`` by default)."""
    return os.path.expanduser(t.hf_export_dir or os.path.join(t.default_local_dir, "huggingface"))


def check_run_outputs(t: RunConfig, *, inputs: Mapping[str, str | Sequence[str] | None]) -> None:
    """Fail early (``OutputPathError`` naming the setting) when an output location of the run cannot be used.

    ``inputs`` maps config keys to the run's input paths (models, tokenizers, data files), which
    the Hugging Face export must not replace.
    """
    if t.save_freq > 0 or t.resume_mode != "disable":
        probe_writable(t.default_local_dir, key="trainer.default_local_dir")
    if any(name in t.logger for name in ("jsonl", "tensorboard", "wandb", "mlflow")):  # all write under log_dir
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
