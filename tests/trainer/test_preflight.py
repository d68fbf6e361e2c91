"""``verl.trainer.ppo_checks.preflight``: every config and input check of a start, once, before any
model is built (``main_ppo`` checks before the world starts; the trainer finds the config checked)."""

from __future__ import annotations

import pytest

import verl.trainer.ppo_checks as ppo_checks
from verl.config import PPOConfig, load_config


def _cfg(tiny_model_dir, files, *extra: str) -> PPOConfig:
    return load_config(
        PPOConfig,
        config_file="grpo_tiny_cpu",
        overrides=[f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={files['train']}",
                   f"data.val_files={files['val']}", "trainer.n_gpus_per_node=1", *extra],
        world_size=1,
    )


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = ppo_checks.check_ppo_inputs
    monkeypatch.setattr(ppo_checks, "check_ppo_inputs", lambda cfg, **kw: (calls.append(cfg), real(cfg, **kw))[1])
    return calls


def test_preflight_checks_a_config_once_per_world_size(tiny_model_dir, arithmetic_files, tmp_path, counted):
    cfg = _cfg(tiny_model_dir, arithmetic_files, f"trainer.default_local_dir={tmp_path}/c", f"trainer.log_dir={tmp_path}/l")
    ppo_checks.preflight(cfg, 1)
    ppo_checks.preflight(cfg, 1)
    assert len(counted) == 1
    # Another launched world is another question: the layouts are checked against it.
    with pytest.raises(ValueError, match="the launched world size 2 differs"):
        ppo_checks.preflight(cfg, 2)


def test_a_config_that_fails_is_checked_again(tiny_model_dir, arithmetic_files, tmp_path, counted):
    cfg = _cfg(tiny_model_dir, arithmetic_files, f"trainer.default_local_dir={tmp_path}/c", f"trainer.log_dir={tmp_path}/l")
    cfg.data.train_files = str(tmp_path / "missing.parquet")
    for _ in range(2):
        with pytest.raises(ValueError, match="missing.parquet"):
            ppo_checks.preflight(cfg, 1)
    assert len(counted) == 2


def test_main_ppo_checks_its_inputs_once(tiny_model_dir, arithmetic_files, tmp_path, counted, monkeypatch, capsys):
    """Before the redesign a start ran ``check_ppo_inputs`` (and scanned the data files) twice: in
    main_ppo and again in the trainer. The trainer's build is stopped right after its checks."""
    import verl.trainer.ppo_trainer as ppo_trainer
    from verl.trainer.main_ppo import main

    def stop(cfg):
        raise ValueError("stopped after the checks")

    monkeypatch.setattr(ppo_trainer, "RLData", stop)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--config", "grpo_tiny_cpu", f"actor_rollout_ref.model.path={tiny_model_dir}",
              f"data.train_files={arithmetic_files['train']}", f"data.val_files={arithmetic_files['val']}",
              "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={tmp_path}/c", f"trainer.log_dir={tmp_path}/l"])
    assert exc.value.code == 2
    assert "stopped after the checks" in capsys.readouterr().err
    assert len(counted) == 1


def test_a_wrong_pipeline_layout_is_one_preflight_message(tiny_model_dir, arithmetic_files, tmp_path):
    """Megatron's explicit ``pipeline_model_parallel_layout`` in ``override_transformer_config``: a layout
    that leaves a stage without a decoder layer is refused before any model, naming the role and the key;
    a right one for the 2-layer model on PP 2 passes."""
    def cfg(layout: str) -> PPOConfig:
        return load_config(
            PPOConfig, config_file="grpo_tiny_cpu", world_size=2,
            overrides=[f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={arithmetic_files['train']}",
                       f"data.val_files={arithmetic_files['val']}", "trainer.n_gpus_per_node=2",
                       f"trainer.default_local_dir={tmp_path}/c", f"trainer.log_dir={tmp_path}/l",
                       "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                       "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
                       f"+actor_rollout_ref.actor.megatron.override_transformer_config.pipeline_model_parallel_layout={layout}"],
        )

    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.megatron.*pipeline_model_parallel_layout='Ett\|L': "
                                         "chunk 1 holds no decoder layer"):
        ppo_checks.preflight(cfg("Ett|L"), 2)
    ppo_checks.preflight(cfg("Et|tL"), 2)
