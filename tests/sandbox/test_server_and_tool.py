"""The SandboxFusion-compatible server over loopback, and the stateful Python tool."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest

from tests.sandbox.conftest import ROOMY_LIMITS, TEST_LIMITS
from verl.sandbox import PythonInterpreter
from verl.serving.sandbox import create_app, main


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def server(sandbox):
    """The server over the test sandbox with a roomy wall limit: its configured limits are ceilings
    (a request's run_timeout above them is clipped), and on a loaded machine bwrap and Python alone
    can take seconds to start, so the requests' own 20-60 s must not be cut to the 2 s of TEST_LIMITS."""
    import dataclasses

    from verl.sandbox import Sandbox
    from verl.serving.server import BackgroundServer

    roomy = Sandbox(dataclasses.replace(sandbox.config, limits=ROOMY_LIMITS))
    with BackgroundServer(create_app(roomy, api_key="s3cret")) as srv:
        yield srv


def test_run_code_answers_as_sandbox_fusion(server):
    key = {"Authorization": "Bearer s3cret"}
    ok_body = {
        "code": "import sys\nprint(open('data.txt').read(), sum(map(int, sys.stdin.read().split())))",
        "language": "python",
        "stdin": "2 3",
        "run_timeout": 20,
        "compile_timeout": 10,
        "memory_limit_MB": 256,
        "files": {"data.txt": base64.b64encode(b"hi").decode()},
        "fetch_files": [],
    }
    status, body = _post(server.url + "/run_code", ok_body, key)
    assert status == 200 and body["status"] == "Success", body
    assert body["run_result"]["status"] == "Finished" and body["run_result"]["return_code"] == 0
    assert body["run_result"]["stdout"] == "hi 5\n"

    # 60 s: the default limit was too short for bwrap and Python to start at load 17 (suite23)
    status, body = _post(server.url + "/run_code", {"code": "1/0", "language": "python", "run_timeout": 60}, key)
    assert body["status"] == "Failed" and body["run_result"]["status"] == "Finished"
    assert body["run_result"]["return_code"] == 1 and "ZeroDivisionError" in body["run_result"]["stderr"]

    # The reference's client sends no header: the key rides on the URL.
    status, body = _post(server.url + "/run_code?key=s3cret", {"code": "while True: pass", "run_timeout": 1})
    assert body["status"] == "Failed" and body["run_result"]["status"] == "TimeLimitExceeded"


def test_run_code_refuses_without_the_key_and_bad_requests(server):
    status, _ = _post(server.url + "/run_code", {"code": "print(1)"})
    assert status == 401
    status, _ = _post(server.url + "/run_code?key=wrong", {"code": "print(1)"})
    assert status == 401
    key = {"Authorization": "Bearer s3cret"}
    status, body = _post(server.url + "/run_code", {"code": "print(1)", "language": "cpp"}, key)
    assert status == 400 and "cpp" in body["message"]
    status, body = _post(server.url + "/run_code", {"code": "print(1)", "files": {"../x": "aGk="}}, key)
    assert status == 400 and "relative path" in body["message"]


def test_the_server_refuses_an_exposed_bind_without_a_key(monkeypatch, capsys):
    monkeypatch.delenv("VERL_SANDBOX_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--host", "0.0.0.0"])
    assert exit_info.value.code == 2
    assert "VERL_SANDBOX_API_KEY" in capsys.readouterr().err


def test_interpreter_keeps_definitions_across_calls(sandbox):
    tool = PythonInterpreter(sandbox, limits=ROOMY_LIMITS)
    first = tool.execute("import math\ndef area(r):\n    return math.pi * r * r\nx = 2")
    assert first.ok and first.text == ""
    second = tool.execute("print('area', round(area(x), 3))\nx * 10")
    assert second.ok and second.text == "area 12.566\n20\n"
    # A failing cell reports its own traceback and is not kept.
    broken = tool.execute("y = 1\nundefined_name")
    assert not broken.ok and broken.text.startswith("Traceback") and "NameError" in broken.text
    assert 'File "<cell 2>"' in broken.text and "runpy" not in broken.text
    assert tool.execute("y").text.endswith("NameError: name 'y' is not defined\n")
    tool.reset()
    assert "NameError" in tool.execute("area(1)").text


def test_interpreter_reports_a_limit(sandbox):
    tool = PythonInterpreter(sandbox, limits=TEST_LIMITS, max_chars=200)
    out = tool.execute("while True:\n    pass")
    assert not out.ok and "[stopped: timeout" in out.text
    long = PythonInterpreter(sandbox, limits=ROOMY_LIMITS, max_chars=200).execute("print('x' * 5000)")
    assert long.ok and "characters cut" in long.text and len(long.text) < 300
    assert tool.schema["function"]["name"] == "python"
