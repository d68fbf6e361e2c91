"""The run report: one self-contained ``report.html`` (inline SVG plots, no network) in the log directory.

    python -m verl.trainer.report RUN_LOG_DIR [--out FILE]

Built from what a run writes into its log directory (``trainer.log_dir``):

- ``metrics.jsonl``: one JSON object per log call, ``{"step": N, key: value, ...}`` (the trainers'
  metric names: ``critic/score/mean``, ``actor/ppo_kl``, ``timing_s/gen``, ``val-core/...``);
- ``scores.jsonl``: ``{"step": N, "scores": [...]}``, the sequence scores of each step (the reward
  distribution), written with :class:`StepRecords`;
- ``samples.jsonl``: ``{"step": N, "data_source", "prompt", "response", "reward"}``, generations of
  each validation;
- ``config.json``: the resolved config.

Plots (matplotlib, rendered to SVG): reward mean with its distribution per step (violins when
scores were recorded, else the min-max band), KL, entropy, response length, losses, gradient
norm, time per phase stacked per step, each ``verl.DataStream`` operator's share of the step
(``timing_s/op/<name>``), memory peak per phase, throughput, model FLOPs utilisation per phase
(``perf/mfu/<phase>``, ``verl.trainer.perf``) and validation score per data source; then a table
of the last validations' generations and the config. A plot whose metrics the run did not log
says so instead of drawing nothing.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import logging
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.trainer.tracking import rewind_jsonl

logger = logging.getLogger(__name__)

__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "REPORT_FILE",
    "SAMPLES_FILE",
    "SCORES_FILE",
    "RunData",
    "StepRecords",
    "build_report",
    "load_run",
    "main",
]

METRICS_FILE = "metrics.jsonl"
SCORES_FILE = "scores.jsonl"
SAMPLES_FILE = "samples.jsonl"
CONFIG_FILE = "config.json"
REPORT_FILE = "report.html"
OPERATOR_TIMING = "timing_s/op/"
"""Prefix of a ``verl.DataStream`` operator's seconds in a step (``timing_s/op/<operator>``)."""
_SAMPLES_SHOWN = 24  # generations shown per validation
_VALIDATIONS_SHOWN = 3


class StepRecords:
    """A ``{"step": N, ...}`` JSON-lines file that a resumed run rewinds (``scores.jsonl``, ``samples.jsonl``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def append(self, step: int, records: Iterable[Mapping[str, Any]]) -> None:
        """Append records of ``step`` (each gets the step; values must be JSON-serialisable)."""
        lines = [json.dumps({"step": step, **r}, sort_keys=True) + "\n" for r in records]
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(lines)

    def rewind(self, step: int) -> int:
        """Keep the records of steps <= ``step`` (a line cut short by a kill goes too); returns how many went."""
        return rewind_jsonl(self.path, step)


@dataclass
class RunData:
    """What :func:`load_run` read."""

    steps: list[int] = field(default_factory=list)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    """Step -> every metric logged at that step (records of one step merged)."""
    scores: dict[int, list[float]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] | None = None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, finite values only."""
        xs, ys = [], []
        for step in self.steps:
            value = self.metrics[step].get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                xs.append(step)
                ys.append(float(value))
        return xs, ys

    def keys(self) -> list[str]:
        """Every metric name of the run, sorted."""
        return sorted({k for m in self.metrics.values() for k in m})


def _read_jsonl(path: str) -> Iterable[dict[str, Any]]:
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s: line %d is not JSON (cut short by a kill?); skipped", path, number)
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                yield record


def load_run(log_dir: str) -> RunData:
    """Read a run's log directory (see the module docstring); ValueError when it holds no metrics."""
    metrics_path = os.path.join(log_dir, METRICS_FILE)
    if not os.path.isfile(metrics_path):
        raise ValueError(
            f"{log_dir} has no {METRICS_FILE}: give a run's trainer.log_dir (a run logging with trainer.logger "
            "including jsonl)"
        )
    run = RunData()
    for record in _read_jsonl(metrics_path):
        step = record.pop("step")
        run.metrics.setdefault(step, {}).update(
            {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        )
    run.steps = sorted(run.metrics)
    for record in _read_jsonl(os.path.join(log_dir, SCORES_FILE)):
        run.scores.setdefault(record["step"], []).extend(float(s) for s in record.get("scores", []))
    run.samples = list(_read_jsonl(os.path.join(log_dir, SAMPLES_FILE)))
    config_path = os.path.join(log_dir, CONFIG_FILE)
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            run.config = json.load(f)
    return run


# ----------------------------------------------------------------------------------------------
# plots


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})  # same run, same page
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog and doctype: inline SVG in HTML


def _figure():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=100)
    ax.grid(alpha=0.3)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    return fig, ax


def _lines(run: RunData, keys: Sequence[str], ylabel: str, *, log: bool = False, scale: float = 1.0) -> str | None:
    present = [k for k in keys if run.series(k)[0]]
    if not present:
        return None
    fig, ax = _figure()
    for key in present:
        xs, ys = run.series(key)
        ax.plot(xs, [y / scale for y in ys], marker="o" if len(xs) < 30 else None, markersize=3, label=key)
    if log and all(y > 0 for k in present for y in run.series(k)[1]):
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    return _svg(fig)


def _reward_plot(run: RunData) -> str | None:
    mean_key = next((k for k in ("critic/score/mean", "critic/rewards/mean") if run.series(k)[0]), None)
    if mean_key is None and not run.scores:
        return None
    fig, ax = _figure()
    steps = [s for s in run.steps if run.scores.get(s)]
    if steps:
        parts = ax.violinplot([run.scores[s] for s in steps], positions=steps, widths=0.8, showextrema=False)
        for body in parts["bodies"]:
            body.set_alpha(0.3)
    elif mean_key is not None:
        xs, lo = run.series(mean_key.replace("/mean", "/min"))
        _, hi = run.series(mean_key.replace("/mean", "/max"))
        if xs and len(lo) == len(hi) == len(xs):
            ax.fill_between(xs, lo, hi, alpha=0.2, label="min-max")
    if mean_key is not None:
        xs, ys = run.series(mean_key)
        ax.plot(xs, ys, marker="o", markersize=3, label=mean_key)
    ax.set_ylabel("reward (sequence score)")
    ax.legend(fontsize=7)
    return _svg(fig)


def _timing_plot(run: RunData) -> str | None:
    # A DataStream step's operator times (timing_s/op/...) overlap the trainer's phases: their own plot.
    phases = [
        k for k in run.keys()
        if k.startswith("timing_s/") and k not in ("timing_s/step", "timing_s/stream_step")
        and not k.startswith(OPERATOR_TIMING)
    ]
    if not phases:
        return None
    fig, ax = _figure()
    bottom = [0.0] * len(run.steps)
    for key in phases:
        values = [run.metrics[s].get(key, 0.0) for s in run.steps]
        values = [v if math.isfinite(v) else 0.0 for v in values]
        ax.bar(run.steps, values, bottom=bottom, label=key.removeprefix("timing_s/"), width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds")
    ax.legend(fontsize=6, ncol=3)
    return _svg(fig)


def _operator_plot(run: RunData) -> str | None:
    """Each ``verl.DataStream`` operator's share (%) of the step's operator time, stacked per step."""
    ops = [k for k in run.keys() if k.startswith(OPERATOR_TIMING)]
    if not ops:
        return None
    fig, ax = _figure()
    totals = [sum(_finite(run.metrics[s].get(k, 0.0)) for k in ops) for s in run.steps]
    bottom = [0.0] * len(run.steps)
    for key in ops:
        shares = [
            100.0 * _finite(run.metrics[s].get(key, 0.0)) / t if t > 0 else 0.0 for s, t in zip(run.steps, totals)
        ]
        ax.bar(run.steps, shares, bottom=bottom, label=key.removeprefix(OPERATOR_TIMING), width=0.8)
        bottom = [b + v for b, v in zip(bottom, shares)]
    ax.set_ylabel("% of the step's operator time")
    ax.legend(fontsize=6, ncol=3)
    return _svg(fig)


def _finite(value: float) -> float:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _memory_plot(run: RunData) -> str | None:
    per_phase = [k for k in run.keys() if k.startswith("memory/") and k.endswith("peak_bytes")]
    if per_phase:
        return _lines(run, per_phase, "GiB", scale=2**30)
    return _lines(run, ["perf/max_memory_allocated_gb", "perf/cpu_memory_used_gb"], "GB")


def _validation_plot(run: RunData) -> str | None:
    keys = [k for k in run.keys() if k.startswith("val-core/")] or [k for k in run.keys() if k.startswith("val/")]
    return _lines(run, keys, "validation")


_PLOTS = (  # (id, title, builder)
    ("reward", "Reward per step (mean, distribution)", _reward_plot),
    ("kl", "KL", lambda r: _lines(r, ["actor/ppo_kl", "actor/kl_loss", "critic/kl", "actor/kl"], "KL")),
    ("entropy", "Entropy", lambda r: _lines(r, ["actor/entropy"], "nats")),
    ("response-length", "Response length", lambda r: _lines(
        r, ["response_length/mean", "response_length/max", "response_length/min"], "tokens")),
    ("loss", "Losses", lambda r: _lines(r, ["actor/pg_loss", "critic/vf_loss", "train/loss", "val/loss"], "loss")),
    ("grad-norm", "Gradient norm", lambda r: _lines(
        r, ["actor/grad_norm", "critic/grad_norm", "train/grad_norm"], "L2 norm", log=True)),
    ("timing", "Time per phase", _timing_plot),
    ("operators", "Time share per operator (verl.DataStream)", _operator_plot),
    ("memory", "Memory peak per phase", _memory_plot),
    ("throughput", "Throughput", lambda r: _lines(
        r, ["perf/throughput", "perf/tokens_per_s", "rollout/tokens_per_s"], "tokens / s")),
    ("mfu", "Model FLOPs utilisation per phase", lambda r: _lines(
        r, sorted(k for k in r.keys() if k.startswith("perf/mfu/")), "% of the device's peak", scale=0.01)),
    ("validation", "Validation score per data source", _validation_plot),
)


# ----------------------------------------------------------------------------------------------
# page


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 16px; }
figure { margin: 0; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
figcaption { font-weight: 600; margin-bottom: 4px; } figure svg { width: 100%; height: auto; }
.empty { color: #888; font-style: italic; }
table { border-collapse: collapse; width: 100%; font-size: 0.85em; }
td, th { border: 1px solid #ddd; padding: 4px 6px; vertical-align: top; text-align: left; }
td.text { white-space: pre-wrap; font-family: ui-monospace, monospace; max-width: 40em; }
pre { background: #f6f6f6; padding: 8px; overflow: auto; font-size: 0.8em; }
.turn { padding: 2px 4px; margin: 2px 0; border-left: 3px solid #4a7; }
.turn.tool { background: #f1f1f8; border-left-color: #88a; }
.turn.user { background: #f8f4ea; border-left-color: #c96; }
.turn .role { display: block; font-size: 0.75em; color: #666; font-family: sans-serif; }
"""


def _response_html(sample: dict[str, Any]) -> str:
    """The response cell: plain text, or a multi-turn sample's turns one under another, the model's
    and the tools' (and an interaction's user turns) told apart by a label and a shade (``turns`` of
    the agent loop)."""
    turns = sample.get("turns")
    if not isinstance(turns, list) or not turns:
        return html.escape(str(sample.get("response", "")))
    return "".join(
        '<div class="turn {0}"><span class="role">{0}</span>{1}</div>'.format(
            t.get("role") if t.get("role") in ("tool", "user") else "assistant", html.escape(str(t.get("text", "")))
        )
        for t in turns
        if isinstance(t, dict)
    )


def _samples_html(run: RunData) -> str:
    if not run.samples:
        return '<p class="empty">No validation generations were recorded.</p>'
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for sample in run.samples:
        by_step[sample["step"]].append(sample)
    parts = []
    for step in sorted(by_step)[-_VALIDATIONS_SHOWN:]:
        rows = by_step[step][:_SAMPLES_SHOWN]
        body = "".join(
            "<tr><td>{}</td><td class=text>{}</td><td class=text>{}</td><td>{}</td></tr>".format(
                html.escape(str(r.get("data_source", ""))),
                html.escape(str(r.get("prompt", ""))),
                _response_html(r),
                html.escape(f"{r['reward']:.4g}" if isinstance(r.get("reward"), (int, float)) else str(r.get("reward"))),
            )
            for r in rows
        )
        parts.append(
            f'<h3>Step {step}</h3><table class="samples" data-step="{step}"><tr><th>data source</th>'
            f"<th>prompt</th><th>response</th><th>reward</th></tr>{body}</table>"
        )
    return "".join(parts)


def render(run: RunData, *, title: str) -> str:
    """The report page for ``run``."""
    figures = []
    for plot_id, caption, build in _PLOTS:
        svg = build(run)
        content = svg if svg is not None else '<p class="empty">not logged by this run</p>'
        figures.append(f'<figure id="plot-{plot_id}"><figcaption>{html.escape(caption)}</figcaption>{content}</figure>')
    last = run.metrics[run.steps[-1]] if run.steps else {}
    headline = ", ".join(
        f"{k} {v:.4g}" for k, v in sorted(last.items()) if k.startswith(("val-core/", "critic/score/mean", "train/loss"))
    )
    config = html.escape(json.dumps(run.config, indent=2, sort_keys=True)) if run.config else "not recorded"
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f'<p id="summary">{len(run.steps)} steps logged (last: {run.steps[-1] if run.steps else "-"}). '
        f"{html.escape(headline)}</p>"
        f'<div class="grid">{"".join(figures)}</div>'
        f'<h2>Generations at the last validations</h2><div id="samples">{_samples_html(run)}</div>'
        f'<h2>Config</h2><pre id="config">{config}</pre></body></html>'
    )


def build_report(log_dir: str, *, out: str | None = None, title: str | None = None) -> str:
    """Write the report of the run in ``log_dir`` (to ``log_dir/report.html`` by default, atomically);
    returns its path."""
    run = load_run(log_dir)
    target = out or os.path.join(log_dir, REPORT_FILE)
    page = render(run, title=title or f"verl run report: {os.path.abspath(log_dir)}")
    tmp = f"{target}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, target)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m verl.trainer.report RUN_LOG_DIR``: (re)build the run's report."""
    parser = argparse.ArgumentParser(
        prog="python -m verl.trainer.report",
        description="Rebuild a run's report.html from its log directory (metrics.jsonl, scores.jsonl, "
        "samples.jsonl, config.json); self-contained, open it in any browser.",
    )
    parser.add_argument("log_dir", help="the run's trainer.log_dir")
    parser.add_argument("--out", default=None, help="where to write the page (default LOG_DIR/report.html)")
    parser.add_argument("--title", default=None, help="page title (default: the log directory)")
    args = parser.parse_args(argv)
    from verl.utils.cli import user_errors

    with user_errors(parser.prog):
        path = build_report(args.log_dir, out=args.out, title=args.title)
    sys.stdout.write(f"wrote {os.path.abspath(path)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
