"""``verl.operator``: the tutorials' import path of ``DataStream`` and its operators; the code
lives in the API package (``verl.api.stream``, ``verl.api.operators``)."""

from verl.api.operators import *  # noqa: F403
from verl.api.operators import __all__ as _operators
from verl.api.stream import DataStream, build_config, build_trainer

__all__ = [*_operators, "DataStream", "build_config", "build_trainer"]
