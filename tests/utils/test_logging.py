"""Rank-aware logging helpers."""

import logging

from verl.utils.logging import global_rank, log_rank0, warn_once


def test_warn_once_emits_each_message_once(caplog):
    logger = logging.getLogger("verl.test.warn_once")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(3):
            warn_once(logger, "value %d is odd", 7)
        warn_once(logger, "value %d is odd", 9)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["value 7 is odd", "value 9 is odd"]


def test_log_rank0_without_process_group_logs(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert global_rank() == 3  # no process group: RANK from the launcher is the fallback
    logger = logging.getLogger("verl.test.rank0")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_rank0(logger, logging.INFO, "hello %s", "world")
    assert [r.getMessage() for r in caplog.records] == ["hello world"]
