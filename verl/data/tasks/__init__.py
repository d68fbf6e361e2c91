"""Task-specific conversion and generation into the verl record format.

Each module turns one public dataset schema (or a generator) into records with the fields
``data_source``, ``prompt`` (a chat message list), ``ability``, ``reward_model`` ({style,
ground_truth}) and ``extra_info``; the thin command-line tools in tools/data/ call them.
"""

from verl.data.tasks.common import make_record, user_prompt

__all__ = ["make_record", "user_prompt"]
