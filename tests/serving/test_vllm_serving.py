"""The app on the vLLM engine (the CPU build here; ``engine="auto"`` picks it wherever vLLM is
installed): greedy answers equal the transformers engine's, sampling settings reach vLLM."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("fastapi", reason="fastapi is the serve extra")
from fastapi.testclient import TestClient  # noqa: E402

from verl.serving import ServeLimits, create_app  # noqa: E402

LIMITS = ServeLimits(max_tokens=8, default_completion_tokens=8, max_prompt_tokens=64)
BODY = {"prompts": ["1 + 1 =", "the cat"], "sampling": {"temperature": 0, "max_tokens": 8, "n": 2}}


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the cpu or gpu extra)"
)
def test_vllm_engine_serves_the_same_greedy_answers_as_transformers(tiny_model_dir):
    answers = {}
    for engine in ("vllm", "hf"):
        app = create_app(
            tiny_model_dir,
            engine=engine,
            limits=LIMITS,
            name="tiny",
            device="cpu" if engine == "hf" else None,
        )
        try:
            with TestClient(app) as c:
                assert c.get("/health").json()["engine"] == engine
                r = c.post("/generate", json=BODY)
                assert r.status_code == 200, r.text
                answers[engine] = [[x["token_ids"] for x in o["responses"]] for o in r.json()["outputs"]]
                if engine == "vllm":
                    # A sampled chat answer within the limit, through vLLM's own sampler.
                    chat = c.post(
                        "/v1/chat/completions",
                        json={
                            "model": "tiny",
                            "max_tokens": 5,
                            "temperature": 0.9,
                            "top_k": 20,
                            "messages": [{"role": "user", "content": "hi"}],
                        },
                    )
                    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 5
        finally:
            app.state.model.close()
    # Both engines decode the same float32 weights greedily: the same tokens.
    assert answers["vllm"] == answers["hf"]
