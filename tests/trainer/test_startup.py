"""What a user sees from ``main_ppo``: outputs listed absolute before the model is built and as the
last lines, no ``\\r`` in a log file, and no import of a logger package the config does not ask for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TQDM_DISABLE",
                "VERL_LOGGING_LEVEL", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_main_ppo_lists_every_output_at_the_start_and_at_the_end(tiny_model_dir, arithmetic_files, tmp_path):
    from tests.trainer.test_rl_algorithms import FAST

    argv = [
        sys.executable, "-m", "verl.trainer.main_ppo", "--config", "grpo_tiny_cpu", *FAST,
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_files['train']}",
        # Relative paths: resolved against the working directory, and printed absolute.
        "trainer.default_local_dir=run/ckpt",
        "trainer.log_dir=run/logs",
        "trainer.logger=[console,jsonl,tensorboard]",
        "trainer.save_freq=1",
        "trainer.save_hf=true",
    ]
    log = tmp_path / "train.log"
    with open(log, "w", encoding="utf-8") as out:  # what nohup or a cluster job gets: a file
        proc = subprocess.run(argv, env=_env(), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=560)
    with open(log, encoding="utf-8", newline="") as f:  # newline="": keep any \r as it was written
        text = f.read()
    assert proc.returncode == 0, text[-4000:]
    assert "\r" not in text, [line for line in text.split("\n") if "\r" in line][:3]
    lines = text.splitlines()
    messages = [line.split(": ", 1)[1] if ": " in line else line for line in lines]
    starts = [i for i, m in enumerate(messages) if m == "outputs of this run:"]
    assert len(starts) == 2, text[-4000:]
    run = tmp_path / "run"
    tb = run / "logs" / "tensorboard"
    labels = ["checkpoints", "Hugging Face actor", "report", "metrics (jsonl)", "TensorBoard"]
    paths = [f"{run}/ckpt", f"{run}/ckpt/huggingface", f"{run}/logs/report.html", f"{run}/logs/metrics.jsonl", str(tb)]
    expected = [f"  {label.ljust(18)}  {path}" for label, path in zip(labels, paths)]
    expected[4] += f"  (tensorboard --logdir {tb})"
    first = messages[starts[0] + 1 : starts[0] + 6]
    assert [m.split("  (")[0] for m in first] == [e.split("  (")[0] for e in expected]
    assert first[0].endswith("(every 1 steps and at the end)") and first[1].endswith("(at the end)")
    assert first[2].endswith("(every 10 steps and at the end)")  # trainer.report_freq's default
    # Listed (loggers started) before any model is built.
    built = next(i for i, m in enumerate(messages) if m.startswith("engine ready"))
    assert starts[0] < built
    # The end: the list once more, every output written, as the run's last lines.
    assert messages[starts[1] + 1 :] == expected
    assert any(m.startswith("done: step 1") for m in messages[: starts[1]])
    # Progress in a log file: the periodic line, with the step's reward.
    step = next(i for i, m in enumerate(messages) if m.startswith("rl: step 1/1 (100%)"))
    assert "reward=" in messages[step]
    # A quiet start: a screenful before the first step, the absent accelerators said once, no
    # dependency config dumps (with a clip_grad=0.0 that verl does not use).
    assert step <= 30, "\n".join(lines[:step])
    assert sum(m.startswith("optional accelerators absent: ") for m in messages) == 1
    assert not [m for m in messages if "Setting up optimizer with config" in m or "Falling back to" in m]
    # MFU in the metrics and the report (verl.trainer.perf): the CPU's matmul rate measured (or read from
    # the session's cache), said once; every timed phase of the tiny default's step has its rate.
    assert sum(m.startswith("MFU: peak of one device") for m in messages) == 1, text[-4000:]
    with open(run / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        record = next(r for r in map(json.loads, f) if "timing_s/step" in r)
    for phase in ("gen", "update_actor", "step"):
        assert 0 < record[f"perf/mfu/{phase}"] < 1.5 and record[f"perf/tflops/{phase}"] > 0, (phase, record)
    assert "perf/mfu/step" in text  # the console's metrics line
    assert '<figure id="plot-mfu"><figcaption>Model FLOPs utilisation per phase</figcaption><svg' in (
        run / "logs" / "report.html").read_text()


_IMPORTS = """
import sys
from verl.trainer.{main} import main
sys.argv = ["x"]
from verl.config import CONFIG_DIR, {cls}, parse_cli
from verl.trainer.startup import prepare_run
cfg = parse_cli({cls}, {argv!r}, prog="x", default_config_file=str(CONFIG_DIR / "{yaml}"), world_size=1)
prepare_run(cfg.trainer)
import verl.trainer.{trainer}
from verl.utils.imports import is_deferred
import megatron.core  # imported by the trainer: it probes for W&B
print("wandb", "wandb" not in sys.modules or is_deferred("wandb"), "mlflow", "mlflow" not in sys.modules)
"""


@pytest.mark.parametrize(
    "main, cls, yaml, trainer",
    [("main_ppo", "PPOConfig", "ppo_trainer.yaml", "ppo_trainer"), ("main_sft", "SFTConfig", "sft_trainer.yaml", "sft_trainer")],
)
def test_the_start_up_path_imports_no_logger_package_it_was_not_asked_for(main, cls, yaml, trainer):
    pytest.importorskip("wandb", reason="W&B is not installed: nothing could import it")
    code = _IMPORTS.format(main=main, cls=cls, yaml=yaml, trainer=trainer, argv=["trainer.logger=[console,jsonl]"])
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "wandb True mlflow True"
