"""``main_ppo`` with a fault injected, for the reliability tests (test code, not the product).

    VERL_TEST_FAULTS='[{"kind": "kill", "phase": "update_actor", "after_step": 2}]' \\
        python tests/trainer/faults.py key=value ...          # or under torchrun

Each fault is a JSON object; ``rank`` (default: every rank) limits it to one global rank.

- ``kill`` / ``term`` / ``hang``: on entering ``phase`` (a ``timing_s/`` phase of the step: ``gen``,
  ``reward``, ``old_log_prob``, ``adv``, ``update_actor`` ..., or ``save_checkpoint``,
  ``end_of_step``) once ``after_step`` steps are done, SIGKILL this process / send it SIGTERM
  (``count`` times, default 1) / sleep for an hour. ``gen`` of step k+1 runs with k steps done;
  the reward and the update phases of step k with k (the counter moves once the step's batch is drawn).
- ``kill_in_checkpoint``: SIGKILL right after the actor's part of the checkpoint of step ``step``
  is written (its staging directory exists, the manifest does not).
- ``nan_loss``: the actor's loss is NaN (so are its gradients) at each step in ``steps``.
- ``oom``: ``torch.OutOfMemoryError`` from the engine's ``train_step`` (``where="update"``) or
  ``forward`` (``where="forward"``) whenever it is called with a micro-batch larger than ``above``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__mp_main__":
    # This file is the entry module here, so its multiprocessing children (the checkpoint
    # writer, reward workers) import it: they must die with a killed trainer, as main_ppo's do.
    sys.path.insert(0, ROOT)
    from verl.utils.process import exit_with_parent

    exit_with_parent()


def _mine(fault: dict) -> bool:
    return fault.get("rank") is None or int(os.environ.get("RANK", "0")) == fault["rank"]


def install(faults: list[dict]) -> None:
    faults = [f for f in faults if _mine(f)]
    if not faults:  # nothing to inject on this rank: import nothing (a run refused at its start builds nothing)
        return
    import torch

    from verl.engine import LossShare, MegatronEngine
    from verl.roles import actor as actor_module
    from verl.roles.engine_role import RoleEngine
    from verl.trainer.ppo_trainer import PPOTrainer
    from verl.trainer.step.pieces import StepPieces

    phase_faults = [f for f in faults if f["kind"] in ("kill", "term", "hang")]
    if phase_faults:
        enter = StepPieces.post_phase  # every phase a rank enters is posted there (PPOTrainer.post_phase too)

        def _enter(self, phase: str) -> None:
            enter(self, phase)
            for f in phase_faults:
                if f["phase"] == phase and self.global_step == f["after_step"] and f.get("left", f.get("count", 1)) > 0:
                    f["left"] = f.get("left", f.get("count", 1)) - 1
                    if f["kind"] == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    elif f["kind"] == "term":
                        os.kill(os.getpid(), signal.SIGTERM)
                    else:
                        time.sleep(3600)

        StepPieces.post_phase = _enter

    for f in faults:
        if f["kind"] == "kill_in_checkpoint":
            save = RoleEngine.save
            step = f["step"]

            def _save(self, ckpt_dir: str, _save=save, _step=step) -> None:
                _save(self, ckpt_dir)
                if self.name == "actor" and os.path.basename(os.path.dirname(ckpt_dir)).endswith(f"global_step_{_step}"):
                    os.kill(os.getpid(), signal.SIGKILL)

            RoleEngine.save = _save
        elif f["kind"] == "nan_loss":
            builder = actor_module.Actor._loss_builder
            steps = set(f["steps"])

            def _loss_builder(self, response_length: int, _builder=builder, _steps=steps):
                make_loss = _builder(self, response_length)

                def make(info, num_micro):
                    loss_fn = make_loss(info, num_micro)

                    def poisoned(outputs, micro):
                        share = loss_fn(outputs, micro)
                        if _TRAINER[0].global_step in _steps:
                            return LossShare(share.loss * float("nan"), share.metrics)
                        return share

                    return poisoned

                return make

            actor_module.Actor._loss_builder = _loss_builder
        elif f["kind"] == "oom":
            name = "train_step" if f.get("where", "update") == "update" else "forward"
            original = getattr(MegatronEngine, name)

            def _raising(self, *args, _original=original, _above=f["above"], **kwargs):
                if kwargs["micro_batch_size"] > _above:
                    raise torch.OutOfMemoryError(f"injected: micro-batch {kwargs['micro_batch_size']} > {_above}")
                return _original(self, *args, **kwargs)

            setattr(MegatronEngine, name, _raising)

    init = PPOTrainer.__init__

    def _init(self, *args, **kwargs):
        _TRAINER[0] = self
        init(self, *args, **kwargs)

    PPOTrainer.__init__ = _init


_TRAINER: list = [None]


def main() -> int:
    sys.path.insert(0, ROOT)
    install(json.loads(os.environ.get("VERL_TEST_FAULTS", "[]")))
    from verl.trainer.main_ppo import main as main_ppo

    return main_ppo(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
