"""``python -m verl.trainer.main_fastrl``: the tutorials' name for the RL trainer, an alias of
:mod:`verl.trainer.main_ppo`.

The tutorials run ``python3 -m verl.trainer.main_fastrl data.train_files=... data.val_files=...``:
the same ``key=value`` settings (and ``--config``/``--config-path``, ``--help``, ``--dry-run``) as
``main_ppo``, so this entry runs ``main_ppo`` with them unchanged, after one line naming the real
entry point. An error would only make a user retype the module name for the run they asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger("verl.trainer.main_fastrl")  # not __name__: "__main__" under python -m

if __name__ == "__mp_main__":
    # This module is the parent's __main__, imported by one of its spawned multiprocessing children
    # (the reward pool's workers): that child dies with the trainer and starts no run.
    from verl.utils.process import exit_with_parent

    exit_with_parent()


def main(argv: Sequence[str] | None = None) -> int:
    """Log that this is ``main_ppo`` under another name, then run ``main_ppo.main(argv)``."""
    from verl.trainer import main_ppo
    from verl.utils.logging import global_rank, setup_logging

    setup_logging(logging.INFO)
    if global_rank() == 0:
        logger.info("python -m verl.trainer.main_fastrl is an alias of %s: running it with the same arguments",
                    main_ppo.PROG)
    return main_ppo.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
