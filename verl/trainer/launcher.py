"""The Python half of the launchers in ``launch/`` (files that are valid bash and valid Python).

``torchrun ... launch/X.sh key=value`` hands the file to Python on every rank; ``bash launch/X.sh``
starts that same torchrun itself (``launch/common.sh``). Either way each rank ends here:
:func:`run_recipe` optionally prepares inputs once (global rank 0 runs the launcher's preparation
while the others wait at a barrier: on a shared file system every node then sees them), then runs
``main_ppo`` with the recipe's config, the launcher's overrides and the user's ``key=value``
arguments (last wins). ``--dry-run`` runs in one process, without torchrun.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "cpu_recipe_environment", "launched_world_overrides", "launcher_entry", "recipe_summary", "run_recipe",
    "set_aside_earlier_run", "validation_change",
]

_TORCHRUN_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
})


def cpu_recipe_environment(out: str) -> None:
    """The environment of the CPU recipes (launch/grpo_tiny_cpu.sh, launch/grpo_smollm2_cpu.sh), each
    variable kept when already set: one thread per rank (two ranks on a 2-core machine use both
    cores; more threads per rank on a busy machine are much slower at these sizes), no hub access,
    and vLLM's caches and sockets inside ``out`` with its per-request INFO lines left out."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for key, sub in (("VLLM_CACHE_ROOT", "vllm"), ("VLLM_RPC_BASE_PATH", "vllm-rpc"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        os.environ.setdefault(key, os.path.join(out, "cache", sub))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def validation_change(
    log_dir: str, label: str, key_note: str = "", *, phase: str = "GRPO"
) -> tuple[str | None, list[dict]]:
    """The run's first and last ``val-core/`` metric from ``log_dir/metrics.jsonl`` as one line, e.g.
    ``== validation reward (val-core/...): 0.654 before GRPO (step 0) -> 0.770 after (step 60)``
    (None without validation), and the file's records. ``phase`` names what the run trained
    ("GRPO", "distillation"). The recipes print the line."""
    import json

    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    val = _validation_points(records)
    if not val:
        return None, records
    (s0, key, before), (s1, _, after) = val[0], val[-1]
    first = f"before {phase} (step {s0})" if s0 == 0 else f"at step {s0}"
    return f"== {label} ({key}{key_note}): {before:.3f} {first} -> {after:.3f} after (step {s1})", records


def _validation_points(records: Sequence[dict]) -> list[tuple[int, str, float]]:
    """``(step, key, value)`` of every ``val-core/`` metric of ``records``, in file order."""
    return [(r["step"], k, v) for r in records for k, v in r.items() if k.startswith("val-core/")]


def _written_since(path: str, started: float) -> bool:
    """Whether ``path`` exists and was last written at or after ``started`` (``time.time()``)."""
    # One second of slack for file-system timestamps coarser than time.time(); a previous run's
    # outputs are older than that: a launcher starts torchrun and the world before training.
    return os.path.exists(path) and os.path.getmtime(path) >= started - 1.0


def recipe_summary(
    cfg: Any, started: float, *, label: str, key_note: str = "", step_times: bool = False, phase: str = "GRPO"
) -> list[str]:
    """The closing lines of a recipe run, each read from an output this run wrote.

    ``cfg`` is the run's own config (its overrides applied: ``trainer.log_dir``,
    ``default_local_dir``, ``hf_export_dir``, ``logger``, ``save_freq``, ``save_hf``); ``started``
    the ``time.time()`` before it began. A location the run did not write this time (another
    logger, no checkpoints, no export, a file left by an earlier run) gets no line. Lines: the
    validation change (``label``, ``key_note``, ``phase``: :func:`validation_change`) and every validation
    point, the mean step time (``step_times``), the metrics file, the newest checkpoint, the
    Hugging Face export.
    """
    from verl.trainer.run_checks import hf_export_dir
    from verl.utils.checkpoint import TRACKER_FILE, step_dir_name
    from verl.utils.outputs import MARKER_FILE

    t = cfg.trainer
    lines: list[str] = []
    metrics = os.path.abspath(os.path.join(os.path.expanduser(t.log_dir), "metrics.jsonl"))
    if "jsonl" in t.logger and _written_since(metrics, started):
        line, records = validation_change(os.path.dirname(metrics), label, key_note, phase=phase)
        if line:
            lines.append(line)
            points = ", ".join(f"{v:.3f} (step {s})" for s, _, v in _validation_points(records))
            lines.append(f"== every validation: {points}")
        times = [r["timing_s/step"] for r in records if "timing_s/step" in r]
        if step_times and times:
            lines.append(f"== time per step: {sum(times) / len(times):.1f} s mean over {len(times)} steps "
                         f"(min {min(times):.1f}, max {max(times):.1f})")
        lines.append(f"== metrics:      {metrics}")
    ckpt_root = os.path.abspath(os.path.expanduser(t.default_local_dir))
    tracker = os.path.join(ckpt_root, TRACKER_FILE)
    if t.save_freq > 0 and _written_since(tracker, started):
        with open(tracker, encoding="utf-8") as f:
            newest = os.path.join(ckpt_root, step_dir_name(int(f.read().strip())))
        lines.append(f"== checkpoints:  {ckpt_root} (newest: {newest})")
    export = os.path.abspath(hf_export_dir(t))
    if t.save_hf and _written_since(os.path.join(export, MARKER_FILE), started):
        lines.append(f"== HF export:    {export}")
    return lines


def launched_world_overrides() -> list[str]:
    """``trainer.nnodes``/``n_gpus_per_node`` of the torchrun world this rank is in ([] outside torchrun)."""
    if "WORLD_SIZE" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        return []
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return [f"trainer.nnodes={world // local}", f"trainer.n_gpus_per_node={local}"]


_RUN_OUTPUT_KEYS = ("trainer.default_local_dir", "trainer.log_dir", "trainer.hf_export_dir")


def set_aside_earlier_run(args: Sequence[str]) -> str | None:
    """Move an earlier run's outputs out of the way of a run that starts afresh; returns where.

    A recipe run starts at step 0 (``trainer.resume_mode=disable``, the last value in ``args``) and
    writes its checkpoints, logs and export where ``args`` say (``trainer.default_local_dir``,
    ``log_dir``, ``hf_export_dir``). The trainer refuses to start over an earlier run's outputs (it
    would replace them step by step), so a rerun of the recipe moves every such folder that is not
    empty into ``<default_local_dir's parent>/earlier_runs/<time>/`` (nothing is deleted). Only a
    folder verl wrote moves (:func:`verl_run_folder`), and none that a live run holds: a user's folder
    given as one of them, or a live run's, stays where it is, said in one line (the trainer then
    refuses it if it would replace a file there, or while that run lives). With
    ``trainer.resume_mode`` set to anything else (a resumed run) nothing moves. Returns the folder
    they moved to, or None.
    """
    import shutil
    import time

    from verl.utils.run_lock import LOCK_FILE

    values: dict[str, str] = {}
    for arg in args:
        if "=" in arg and not arg.startswith("-"):
            key, value = arg.split("=", 1)
            values[key.lstrip("+")] = value
    if values.get("trainer.resume_mode") != "disable":
        return None
    present: dict[str, str] = {}  # folder -> the setting naming it (a folder named twice moves once)
    for key in _RUN_OUTPUT_KEYS:
        folder = os.path.expanduser(values.get(key) or "")
        if folder and os.path.isdir(folder) and set(os.listdir(folder)) - {LOCK_FILE}:  # a lock alone is no run's output
            present.setdefault(os.path.abspath(folder), key)
    kept = {
        path: why for path, key in present.items() if (why := _held_by_a_live_run(path, key) or verl_run_folder(path, key))
    }
    if kept:
        from verl.utils.cli import report

        report([f"== {path} stays where it is, not moved to earlier_runs/: {why}" for path, why in kept.items()])
    present = {path: key for path, key in present.items() if path not in kept}
    if not present:
        return None
    anchor = values.get("trainer.default_local_dir") or next(iter(present))
    base = os.path.join(os.path.dirname(os.path.abspath(os.path.expanduser(anchor))), "earlier_runs", time.strftime("%Y%m%d-%H%M%S"))
    target, n = base, 1
    while os.path.exists(target):
        n += 1
        target = f"{base}-{n}"
    os.makedirs(target)
    for path in present:
        name, k = os.path.basename(path), 1
        while os.path.exists(os.path.join(target, name)):
            k += 1
            name = f"{os.path.basename(path)}-{k}"
        shutil.move(path, os.path.join(target, name))
    return target


def _held_by_a_live_run(path: str, key: str) -> str | None:
    """Why ``path`` must not move: a live run holds it (``verl.utils.run_lock``; the trainer then
    refuses this run in one line), else None."""
    from verl.utils.run_lock import in_use_by_another_run

    refusal = in_use_by_another_run(path, key)
    return str(refusal) if refusal is not None else None


def verl_run_folder(path: str, key: str) -> str | None:
    """None when the folder ``path``, given as ``key`` (one of the run's output settings), holds only
    what a verl run writes there; else why it is not (the entries verl did not write)."""
    from verl.trainer.run_checks import checkpoint_entry, log_dir_foreign_files, log_entry
    from verl.utils.outputs import added_since_written, written_by_verl

    names = sorted(os.listdir(path))
    if key == "trainer.hf_export_dir":
        others = names if not written_by_verl(path) else added_since_written(path)
    elif key == "trainer.default_local_dir":
        others = [n for n in names if not checkpoint_entry(n)]
    else:
        others = sorted({n for n in names if not log_entry(n)} | set(log_dir_foreign_files(path)))
    if not others:
        return None
    shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return f"{key} holds {shown}, which verl did not write"


def _prepare_once(command: Sequence[str], device: str, then: Callable[[], None] | None = None) -> None:
    """Global rank 0 runs ``command`` (and then ``then``); every rank waits for it (the world is
    started here for that)."""
    import torch.distributed as dist

    from verl.parallel.bootstrap import init_distributed

    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as run_trainer does, before anything initialises CUDA
    init_distributed(device=device)
    status = [0]
    if dist.get_rank() == 0:
        # The command is no rank of this world: torchrun's variables would make a trainer in it join.
        env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
        status = [subprocess.run(list(command), check=False, env=env).returncode]
        if status[0] == 0 and then is not None:
            then()
    dist.broadcast_object_list(status, src=0)
    if status[0] != 0:
        raise SystemExit(f"launcher: preparing the run failed (exit {status[0]}): {' '.join(command)}")


def run_recipe(
    config: str,
    argv: Sequence[str],
    *,
    overrides: Sequence[str] = (),
    prepare: Sequence[str] | None = None,
    device: str = "auto",
    dry_run_model_config: str | None = None,
    summary: Callable[[Any, float], Sequence[str]] | None = None,
) -> int:
    """Run ``main_ppo --config CONFIG [overrides] [argv]``; returns its exit status.

    ``prepare``: a command run once (global rank 0) before training, not in a dry run; after it,
    an earlier run's outputs are moved aside when this one starts afresh (:func:`set_aside_earlier_run`).
    ``dry_run_model_config``: the ``--model-config`` a dry run uses unless ``argv`` names one (the
    recipe's model is not on a planning machine).
    ``summary``: after a successful training run, global rank 0 prints the lines
    ``summary(config, started)`` returns, from the run's own config (e.g. :func:`recipe_summary`).
    """
    import time

    from verl.trainer import main_ppo

    args = ["--config", config, *overrides, *argv]
    if "--dry-run" in argv or "--help" in argv or "-h" in argv:
        if "--dry-run" in argv and dry_run_model_config and not any(a.split("=", 1)[0] == "--model-config" for a in argv):
            args += ["--model-config", dry_run_model_config]
        return main_ppo.main(args)
    if prepare is not None:
        _prepare_once(prepare, device, then=lambda: _report_set_aside(set_aside_earlier_run([*overrides, *argv])))
    started = time.time()
    resolved: list[Any] = []
    status = main_ppo.main(args, on_config=resolved.append)
    if summary is not None and status == 0 and resolved and os.environ.get("RANK", "0") == "0":
        from verl.utils.cli import report

        report(summary(resolved[0], started))
    return status


def _report_set_aside(where: str | None) -> None:
    if where is not None:
        from verl.utils.cli import report

        report([f"== an earlier run's checkpoints, logs and export moved to {where} (nothing was deleted)"])


def launcher_entry(module_name: str, main: Callable[[], int]) -> None:
    """The last line of every launcher: run ``main`` when the file is the program.

    torchrun runs a launcher file as ``__main__``, so its spawned multiprocessing children (reward
    workers) import it again as ``__mp_main__``: they must not start
    another run, and they die with the trainer. The ranks themselves die with torchrun
    (:func:`verl.utils.process.die_with_launcher`).
    """
    if module_name == "__mp_main__":
        from verl.utils.process import exit_with_parent

        exit_with_parent()
    elif module_name == "__main__":
        from verl.utils.process import die_with_launcher

        die_with_launcher()  # a kill -9 of torchrun (or of the launch script that execs it) takes this rank along
        raise SystemExit(main())
