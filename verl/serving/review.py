"""The human-review queue (SQLite) and its web page, for :class:`verl.operator.HumanReviewOperator`.

:class:`ReviewStore` keeps every queued sample and every review in one SQLite file (the run
directory's ``human_review.sqlite`` by default): a restart of the run or of the page loses
neither. An item is ``pending`` until a reviewer decides, then ``reviewed``; one the operator
stopped waiting for is ``expired`` (it kept its model score). A resumed run that queues the same
sample of the same step again (same prompt and response) gets the stored item back, review included.

:func:`create_review_app` is the page and its JSON API:

| route | does |
| --- | --- |
| ``GET /`` | the page: the pending samples (prompt, response, model reward), Approve / Reject / Set score |
| ``GET /api/pending`` | ``{"items": [...], "score_range": [lo, hi]}`` |
| ``GET /api/items/{id}`` | one item |
| ``POST /api/items/{id}/review`` | ``{"decision": "approve" | "reject" | "score", "score": x}`` (``score`` only with ``"score"``) |
| ``GET /health`` | ``{"status": "ok", "pending": n}`` |

A decision on an item that is not pending is a 409; an unknown id a 404; an id outside SQLite's
1 .. 2**63 - 1, a score outside the range or a decision other than the three a 400 naming the
field; a body above :data:`MAX_BODY_BYTES` a 413 (chunked bodies included).
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["DECISIONS", "ReviewStore", "create_review_app"]

DECISIONS = ("approve", "reject", "score")
"""What a reviewer may decide: keep the model's score, score 0, or a score of their own."""

MAX_BODY_BYTES = 64 << 10
"""The review API's request-body limit (a decision and a score are a few dozen bytes)."""
_MAX_ID = 2**63 - 1  # SQLite's largest integer: a longer id cannot be bound into a query

_SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    step INTEGER NOT NULL,
    sample_index INTEGER NOT NULL,
    prompt TEXT NOT NULL,
    response TEXT NOT NULL,
    model_score REAL NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'reviewed', 'expired')),
    decision TEXT CHECK (decision IN ('approve', 'reject', 'score')),
    human_score REAL,
    created_at REAL NOT NULL,
    reviewed_at REAL,
    UNIQUE (step, sample_index, prompt, response)
);
CREATE INDEX IF NOT EXISTS items_status ON items (status);
"""
_COLUMNS = (
    "id",
    "step",
    "sample_index",
    "prompt",
    "response",
    "model_score",
    "status",
    "decision",
    "human_score",
    "created_at",
    "reviewed_at",
)


class ReviewConflict(ValueError):
    """A decision on an item that is no longer pending."""


class ReviewStore:
    """The review queue in the SQLite file ``path`` (created if missing); safe across threads."""

    def __init__(self, path: str) -> None:
        import os

        self.path = os.path.abspath(os.fspath(path))
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            raise ValueError(
                f"the review database's directory {parent} does not exist; create it or choose another db_path"
            )
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")  # a reader (the page) never blocks the writer
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        self.changed = threading.Event()
        """Set whenever a review is recorded in this process (waiters clear it)."""

    def _rows(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        with self._lock:
            cur = self._db.execute(sql, args)
            return [dict(zip(_COLUMNS, row)) for row in cur.fetchall()]

    def add(self, step: int, samples: list[tuple[int, str, str, float]]) -> list[int]:
        """Queue ``(sample_index, prompt, response, model_score)`` samples of ``step``; their ids.

        A sample already stored (a resumed run's same step) keeps its row and review; one that had
        expired is pending again."""
        now = time.time()
        ids = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for index, prompt, response, score in samples:
                    self._db.execute(
                        "INSERT OR IGNORE INTO items (step, sample_index, prompt, response, model_score, created_at) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (int(step), int(index), prompt, response, float(score), now),
                    )
                    (item_id, status) = self._db.execute(
                        "SELECT id, status FROM items WHERE step=? AND sample_index=? AND prompt=? AND response=?",
                        (int(step), int(index), prompt, response),
                    ).fetchone()
                    if status == "expired":
                        self._db.execute("UPDATE items SET status='pending' WHERE id=?", (item_id,))
                    ids.append(int(item_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return ids

    def pending(self) -> list[dict[str, Any]]:
        """Every pending item, oldest first."""
        return self._rows(f"SELECT {', '.join(_COLUMNS)} FROM items WHERE status='pending' ORDER BY id")

    def get(self, ids: list[int]) -> dict[int, dict[str, Any]]:
        """The items ``ids`` by id (missing ids are left out)."""
        ids = [i for i in ids if 1 <= int(i) <= _MAX_ID]  # no row has another id (and SQLite cannot bind it)
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self._rows(
            f"SELECT {', '.join(_COLUMNS)} FROM items WHERE id IN ({marks})", tuple(int(i) for i in ids)
        )
        return {row["id"]: row for row in rows}

    def review(self, item_id: int, decision: str, score: float | None = None) -> dict[str, Any]:
        """Record a decision on a pending item; KeyError for an unknown id, ReviewConflict when it
        is not pending, ValueError for a bad decision/score pair."""
        if decision not in DECISIONS:
            raise ValueError(f"decision {decision!r} is not one of {DECISIONS}")
        if (decision == "score") != (score is not None):
            raise ValueError(
                "a score goes with decision 'score' only"
                if score is not None
                else "decision 'score' needs a score"
            )
        if score is not None and not math.isfinite(score):
            raise ValueError(f"score {score} is not a finite number")
        if not 1 <= int(item_id) <= _MAX_ID:
            raise KeyError(item_id)
        with self._lock:
            row = self._db.execute("SELECT status FROM items WHERE id=?", (int(item_id),)).fetchone()
            if row is None:
                raise KeyError(item_id)
            if row[0] != "pending":
                raise ReviewConflict(f"item {item_id} is {row[0]}, not pending; it cannot be reviewed again")
            self._db.execute(
                "UPDATE items SET status='reviewed', decision=?, human_score=?, reviewed_at=? WHERE id=?",
                (decision, score, time.time(), int(item_id)),
            )
        self.changed.set()
        return self.get([item_id])[item_id]

    def expire(self, ids: list[int]) -> int:
        """Mark the still-pending items among ``ids`` expired; how many were."""
        if not ids:
            return 0
        marks = ",".join("?" * len(ids))
        with self._lock:
            cur = self._db.execute(
                f"UPDATE items SET status='expired' WHERE status='pending' AND id IN ({marks})", tuple(ids)
            )
            return cur.rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Review(BaseModel):
    model_config = ConfigDict(extra="forbid")

    decision: Literal["approve", "reject", "score"]
    score: float | None = None


def create_review_app(
    store: ReviewStore,
    *,
    score_range: tuple[float, float] = (0.0, 1.0),
    api_key: str | None = None,
    title: str = "verl human review",
) -> Any:
    """The review page and its API on ``store`` (see the module docstring). With ``api_key``, the
    page is opened as ``/?key=<api_key>`` and sends it on as ``Authorization: Bearer``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse

    from verl.serving.app import BodyLimit, _validation_message, require_api_key
    from verl.serving.errors import RequestError, openai_error_body

    lo, hi = float(score_range[0]), float(score_range[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"score_range={score_range}: it must be two finite numbers, low < high")
    app = FastAPI(title=title)
    app.state.store = store
    app.state.api_key = api_key

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(openai_error_body(exc.message, exc.param, exc.kind), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        param, message = _validation_message(exc.errors()[0], request.url.path)
        return JSONResponse(openai_error_body(message, param, "invalid_request_error"), status_code=400)

    require_api_key(app, api_key, open_paths=("/health",), query_param="key")
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)

    def check_id(item_id: int) -> None:
        if not 1 <= item_id <= _MAX_ID:
            raise RequestError(400, f"item_id={item_id} is not a review item id (ids are 1 .. {_MAX_ID})", param="item_id")

    def public(row: dict[str, Any]) -> dict[str, Any]:
        return {k: row[k] for k in _COLUMNS if k not in ("created_at", "reviewed_at")}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "pending": len(store.pending())}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return _PAGE.replace("__TITLE__", title)

    @app.get("/api/pending")
    async def pending() -> dict[str, Any]:
        return {"items": [public(r) for r in store.pending()], "score_range": [lo, hi]}

    @app.get("/api/items/{item_id}")
    async def item(item_id: int) -> dict[str, Any]:
        check_id(item_id)
        rows = store.get([item_id])
        if item_id not in rows:
            raise RequestError(404, f"no review item {item_id}", param="item_id", kind="not_found_error")
        return public(rows[item_id])

    @app.post("/api/items/{item_id}/review")
    async def review(item_id: int, body: _Review) -> dict[str, Any]:
        check_id(item_id)
        if body.score is not None and not (lo <= body.score <= hi):
            raise RequestError(
                400, f"score {body.score} is outside the allowed range [{lo}, {hi}]", param="score"
            )
        try:
            return public(store.review(item_id, body.decision, body.score))
        except KeyError:
            raise RequestError(
                404, f"no review item {item_id}", param="item_id", kind="not_found_error"
            ) from None
        except ReviewConflict as exc:
            raise RequestError(409, str(exc), param="item_id", kind="conflict_error") from None
        except ValueError as exc:
            raise RequestError(400, str(exc), param="score") from None

    return app


# The page: plain HTML and script, no outside resources. Texts go in with textContent (never as HTML).
_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ccc; padding: 6px; vertical-align: top; text-align: left; }
pre { white-space: pre-wrap; margin: 0; max-width: 40em; }
button { margin: 2px; } input[type=number] { width: 6em; }
#status { margin: .8em 0; color: #555; }
</style></head>
<body>
<h1>__TITLE__</h1>
<p>Approve keeps the model's reward, Reject sets it to 0, Set score replaces it with yours.
A sample nobody reviews before the step's timeout keeps the model's reward.</p>
<div id="status">loading...</div>
<table><thead><tr><th>#</th><th>step</th><th>prompt</th><th>response</th><th>model reward</th><th>review</th></tr></thead>
<tbody id="items"></tbody></table>
<script>
const key = new URLSearchParams(location.search).get("key");
const headers = {"Content-Type": "application/json"};
if (key) headers["Authorization"] = "Bearer " + key;
let range = [0, 1];
function cell(row, text, pre) {
  const td = document.createElement("td");
  const el = document.createElement(pre ? "pre" : "span");
  el.textContent = text; td.appendChild(el); row.appendChild(td); return td;
}
async function decide(id, decision, score) {
  const body = {decision: decision};
  if (score !== undefined) body.score = score;
  const r = await fetch("api/items/" + id + "/review", {method: "POST", headers: headers, body: JSON.stringify(body)});
  const out = await r.json();
  const status = document.getElementById("status");
  if (r.ok) { status.textContent = "#" + id + ": " + decision + (score !== undefined ? " " + score : ""); }
  else { status.textContent = "#" + id + ": " + out.error.message; }
  await refresh();
}
async function refresh() {
  const r = await fetch("api/pending", {headers: headers});
  const status = document.getElementById("status");
  if (!r.ok) { status.textContent = "cannot load the queue (" + r.status + ")"; return; }
  const data = await r.json();
  range = data.score_range;
  const tbody = document.getElementById("items");
  const seen = new Set();
  for (const item of data.items) {
    seen.add(String(item.id));
    if (document.getElementById("item-" + item.id)) continue;
    const row = document.createElement("tr");
    row.id = "item-" + item.id; row.dataset.id = item.id;
    cell(row, String(item.id)); cell(row, String(item.step));
    cell(row, item.prompt, true); cell(row, item.response, true);
    cell(row, item.model_score.toFixed(3));
    const td = document.createElement("td");
    const approve = document.createElement("button");
    approve.textContent = "Approve"; approve.id = "approve-" + item.id;
    approve.onclick = () => decide(item.id, "approve");
    const reject = document.createElement("button");
    reject.textContent = "Reject"; reject.id = "reject-" + item.id;
    reject.onclick = () => decide(item.id, "reject");
    const input = document.createElement("input");
    input.type = "number"; input.step = "any"; input.min = range[0]; input.max = range[1];
    input.id = "score-input-" + item.id; input.placeholder = range[0] + ".." + range[1];
    const set = document.createElement("button");
    set.textContent = "Set score"; set.id = "score-" + item.id;
    set.onclick = () => { const v = parseFloat(input.value);
      if (isNaN(v)) { document.getElementById("status").textContent = "#" + item.id + ": type a score first"; return; }
      decide(item.id, "score", v); };
    td.append(approve, reject, input, set); row.appendChild(td);
    tbody.appendChild(row);
  }
  for (const row of Array.from(tbody.children)) { if (!seen.has(row.dataset.id)) row.remove(); }
  if (status.textContent === "loading...") status.textContent = "";
  document.getElementById("items").dataset.count = data.items.length;
  document.title = "(" + data.items.length + ") __TITLE__";
}
refresh();
setInterval(refresh, 2000);
</script>
</body></html>
"""
