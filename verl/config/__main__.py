"""``python -m verl.config [--config FILE] [key=value ...]``: print the resolved PPO config as YAML.

Exit status 0 with the YAML on stdout, or 2 with the error on stderr; ``--help`` lists every option.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from verl.config.cli import parse_cli
from verl.config.loader import CONFIG_DIR, to_yaml
from verl.config.schema import PPOConfig


def main(argv: Sequence[str] | None = None) -> int:
    """Print the PPO config built from ``configs/ppo_trainer.yaml`` (or ``--config``) and ``argv``."""
    cfg = parse_cli(
        PPOConfig,
        sys.argv[1:] if argv is None else argv,
        prog="python -m verl.config",
        default_config_file=str(CONFIG_DIR / "ppo_trainer.yaml"),
    )
    sys.stdout.write(to_yaml(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
