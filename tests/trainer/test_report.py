"""The run report: built from a run's log directory, opened in a real browser (Debian's chromium, headless).

The run directory is written the way the trainers write it (Tracking's metrics.jsonl with the
reference verl's metric names, StepRecords for scores and samples, config.json); the page must
load with no console errors, hold every plot, the generations table and the config, and a
screenshot is kept under the test's temporary directory.
"""

from __future__ import annotations

import json
import math
import re
import os
import shutil
import subprocess
import sys

import pytest

from verl.trainer.report import SAMPLES_FILE, SCORES_FILE, StepRecords, build_report, load_run
from verl.trainer.tracking import Tracking

STEPS = 8
PLOTS = ["reward", "kl", "entropy", "response-length", "loss", "grad-norm", "timing", "operators", "memory",
         "throughput", "mfu", "validation"]


def _write_run(log_dir: str) -> None:
    with Tracking(backends=["jsonl"], project_name="p", experiment_name="e", log_dir=log_dir, rank=0) as t:
        for step in range(1, STEPS + 1):
            score = 0.1 * step
            t.log({
                "critic/score/mean": score, "critic/score/max": score + 0.3, "critic/score/min": score - 0.3,
                "actor/ppo_kl": 1e-3 * step, "actor/kl_loss": 2e-3 * step, "actor/entropy": 2.0 - 0.1 * step,
                "actor/pg_loss": -0.01 * step, "actor/grad_norm": 1.0 / step,
                "response_length/mean": 20 + step, "response_length/max": 32, "response_length/min": 4,
                "timing_s/gen": 1.0, "timing_s/update_actor": 0.5, "timing_s/update_weights": 0.05,
                "timing_s/step": 1.6, "timing_s/op/RolloutOperator": 1.0, "timing_s/op/PPOUpdateOperator": 0.6,
                "memory/rollout/peak_bytes": 1e9, "memory/train/peak_bytes": 2e9,
                "perf/throughput": 1000.0 + step, "nan/metric": float("nan"),
                "perf/mfu/gen": 0.2, "perf/mfu/update_actor": 0.5 + 0.01 * step, "perf/mfu/step": 0.3,
            }, step)
            if step % 4 == 0:
                t.log({"val-core/arithmetic/reward/mean@1": score, "val-core/countdown/reward/mean@1": score / 2}, step)
    scores, samples = StepRecords(os.path.join(log_dir, SCORES_FILE)), StepRecords(os.path.join(log_dir, SAMPLES_FILE))
    for step in range(1, STEPS + 1):
        scores.append(step, [{"scores": [0.1 * step + 0.05 * i for i in range(-3, 4)]}])
        if step % 4 == 0:
            samples.append(step, [{"data_source": "arithmetic", "prompt": f"What is {i}+{step}? <b>", "response":
                                   f"Answer: {i + step}", "reward": 1.0} for i in range(3)])
    with open(os.path.join(log_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"algorithm": {"adv_estimator": "grpo"}, "trainer": {"total_epochs": 1}}, f)


def test_the_run_is_read_back_merged_by_step(tmp_path):
    _write_run(str(tmp_path))
    run = load_run(str(tmp_path))
    assert run.steps == list(range(1, STEPS + 1))
    assert run.metrics[4]["val-core/arithmetic/reward/mean@1"] == pytest.approx(0.4)  # second record of step 4
    assert run.metrics[4]["critic/score/mean"] == pytest.approx(0.4)
    assert run.series("nan/metric") == ([], [])  # non-finite values are not plotted
    assert len(run.scores[3]) == 7 and len(run.samples) == 6 and run.config["algorithm"]["adv_estimator"] == "grpo"


def test_step_records_rewind_like_the_metrics(tmp_path):
    records = StepRecords(str(tmp_path / SCORES_FILE))
    for step in (1, 2, 3):
        records.append(step, [{"scores": [step]}])
    with open(tmp_path / SCORES_FILE, "a", encoding="utf-8") as f:
        f.write('{"step": 4, "sco')  # killed mid-write
    assert records.rewind(2) == 2
    assert [json.loads(line)["step"] for line in (tmp_path / SCORES_FILE).read_text().splitlines()] == [1, 2]


def test_a_directory_without_metrics_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "verl.trainer.report", str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"python -m verl.trainer.report: error: {tmp_path} has no metrics.jsonl: give a run's trainer.log_dir "
        "(a run logging with trainer.logger including jsonl)"
    ]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="Debian's chromium is not installed (bash tools/setup_env.sh --test installs it)")
def test_report_in_a_real_browser(tmp_path):
    pytest.importorskip("playwright", reason="playwright is part of the test extra")
    from playwright.sync_api import sync_playwright

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    _write_run(str(log_dir))
    out = subprocess.run([sys.executable, "-m", "verl.trainer.report", str(log_dir)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = log_dir / "report.html"
    assert out.stdout.strip() == f"wrote {report}"
    page_text = report.read_text()
    # Self-contained: nothing fetched (SVG namespace URIs are names, not requests), no scripts.
    assert not re.search(r'(src|href)="(https?:)?//', page_text) and "<script" not in page_text
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(report.as_uri())
        for plot in PLOTS:
            figure = page.locator(f"#plot-{plot}")
            assert figure.count() == 1, plot
            assert figure.locator("svg").count() == 1, f"plot {plot} has no SVG"
            box = figure.locator("svg").bounding_box()
            assert box is not None and box["width"] > 200 and box["height"] > 100, (plot, box)
        assert page.locator("#plot-reward svg path").count() > STEPS  # violins + the mean line
        # The last validation's generations, escaped (the prompt's "<b>" is text, not markup).
        assert page.locator("table.samples").count() == 2
        assert page.locator("table.samples").first.locator("tr").count() == 4
        assert "What is 0+8? <b>" in page.locator("#samples").inner_text()
        assert '"adv_estimator": "grpo"' in page.locator("#config").inner_text()
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert errors == []
    assert shot.stat().st_size > 20_000  # a real rendering, not a blank page
    assert not math.isnan(load_run(str(log_dir)).metrics[1]["critic/score/mean"])


def test_a_plot_without_its_metrics_says_so(tmp_path):
    with Tracking(backends=["jsonl"], project_name="p", experiment_name="e", log_dir=str(tmp_path), rank=0) as t:
        t.log({"train/loss": 1.0, "train/grad_norm": 2.0}, 1)  # an SFT run
    page = open(build_report(str(tmp_path)), encoding="utf-8").read()
    assert page.count('<p class="empty">not logged by this run</p>') == len(PLOTS) - 2  # loss and grad-norm drawn
    assert '<figure id="plot-loss"><figcaption>Losses</figcaption><svg' in page
