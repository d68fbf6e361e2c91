"""The sandbox server's limits are ceilings, a run whose client left is ended, SIGTERM ends the
server and its runs, and a bad request gets one line (#58).

Every wait is bounded: HTTP calls carry a timeout, servers start within 60 s or the test fails,
and the server's runs have wall limits of seconds. Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from tests.sandbox.conftest import TEST_LIMITS
from verl.config.schema import SandboxConfig, SandboxLimitsConfig
from verl.sandbox import Sandbox
from verl.serving.sandbox import create_app
from verl.serving.server import BackgroundServer

SLEEP = "import time\ntime.sleep(60)\n"
BUSY = "while True:\n    pass\n"


def _post(url: str, body: dict | bytes, timeout: float = 30.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post_and_leave(host: str, port: int, body: dict, after_s: float) -> None:
    """Send a run and close the connection ``after_s`` later, unanswered: a client that left."""
    conn = http.client.HTTPConnection(host, port, timeout=after_s)
    conn.request("POST", "/run_code", json.dumps(body), {"Content-Type": "application/json"})
    try:
        conn.getresponse()
        raise AssertionError("the run was answered before its client left")
    except (TimeoutError, socket.timeout):
        pass
    finally:
        conn.close()


def _server(tmp_path, limits: SandboxLimitsConfig, **app_kwargs) -> BackgroundServer:
    box = Sandbox(SandboxConfig(max_concurrent=2, slots_dir=str(tmp_path / "slots"), limits=limits))
    return BackgroundServer(create_app(box, **app_kwargs))


@pytest.mark.usefixtures("sandbox")  # skips where bubblewrap cannot confine
def test_a_requests_limits_above_the_servers_are_capped_and_slots_come_back(tmp_path):
    """Two busy loops asking run_timeout=1e9 (and 1e9 MB) held both slots for ever; now they end
    at the server's 2 s, and a plain request after them is answered."""
    limits = SandboxLimitsConfig(**{**TEST_LIMITS.__dict__, "wall_time_s": 2.0, "cpu_time_s": 2.0})
    with _server(tmp_path, limits) as srv:
        answers: dict[int, tuple[int, dict]] = {}

        def hog(i: int) -> None:
            answers[i] = _post(srv.url + "/run_code", {"code": BUSY, "run_timeout": 1e9, "memory_limit_MB": 1e9})

        threads = [threading.Thread(target=hog, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        start = time.monotonic()
        status, body = _post(srv.url + "/run_code", {"code": "print(6 * 7)"})
        assert (status, body["status"], body["run_result"]["stdout"]) == (200, "Success", "42\n"), body
        assert time.monotonic() - start < 15.0
        for t in threads:
            t.join(30)
        for status, body in answers.values():
            assert status == 200 and body["run_result"]["status"] == "TimeLimitExceeded", body
            assert "run_timeout 1e+09 s capped at the server's limits.wall_time_s=2" in body["message"]
            assert "memory_limit_MB 1e+09 capped at the server's limits.memory_mb=256" in body["message"]
        # Below the cap the request's own limit holds.
        status, body = _post(srv.url + "/run_code", {"code": BUSY, "run_timeout": 0.5})
        assert body["run_result"]["status"] == "TimeLimitExceeded" and body["run_result"]["execution_time"] < 1.5


@pytest.mark.usefixtures("sandbox", "no_leftovers")
def test_a_run_whose_client_left_is_ended_and_frees_its_slot(tmp_path):
    limits = SandboxLimitsConfig(**{**TEST_LIMITS.__dict__, "wall_time_s": 30.0})
    with _server(tmp_path, limits) as srv:
        leavers = [
            threading.Thread(target=_post_and_leave, args=(srv.host, srv.port, {"code": SLEEP}, 0.5), daemon=True)
            for _ in range(2)
        ]
        for t in leavers:
            t.start()
        for t in leavers:
            t.join(10)
        start = time.monotonic()
        status, body = _post(srv.url + "/run_code", {"code": "print('next')"}, timeout=20)
        assert (status, body["run_result"]["stdout"]) == (200, "next\n"), body
        # The sleepers (30 s wall limit) were ended, not waited out.
        assert time.monotonic() - start < 10.0


@pytest.mark.usefixtures("sandbox")
@pytest.mark.parametrize(
    "body, field",
    [
        ({"code": "print(1)", "files": ["a.txt"]}, "'files' must be an object"),
        ({"code": "print(1)", "files": {"a.txt": 5}}, "files['a.txt'] must be a base64 string"),
        ({"code": "print(1)", "files": {"a.txt": "%%%"}}, "files['a.txt'] is not base64"),
        ({"code": "print(1)", "run_timeout": "ten"}, "'run_timeout' must be a positive number"),
        ({"code": "print(1)", "run_timeout": -1}, "'run_timeout' must be a positive number"),
        ({"code": "print(1)", "memory_limit_MB": 4}, "below the smallest the sandbox runs (16 MB)"),
        ({"code": "print(1)", "timeout": 5}, "unknown field(s) ['timeout']; accepted fields: ['code'"),
        ({"code": 1}, "'code' must be a string"),
        ({"code": "print(1)", "fetch_files": "x"}, "'fetch_files' must be a list"),
        ({"code": "print(1)", "files": {"main.py": "cHJpbnQoMik="}}, "the program's own file"),
        ([1, 2], "must be a JSON object"),
    ],
    ids=["files-list", "file-int", "file-not-b64", "timeout-str", "timeout-neg", "memory-small", "unknown",
         "code-int", "fetch-str", "main.py", "array"],
)
def test_a_bad_request_gets_a_400_in_one_line(tmp_path, body, field):
    with _server(tmp_path, TEST_LIMITS) as srv:
        status, answer = _post(srv.url + "/run_code", body)
    assert status == 400 and answer["status"] == "SandboxError", answer
    assert field in answer["message"] and "\n" not in answer["message"], answer["message"]


@pytest.mark.usefixtures("sandbox")
def test_a_body_over_the_cap_is_refused_before_it_is_read(tmp_path):
    with _server(tmp_path, TEST_LIMITS, max_body_bytes=1 << 20) as srv:
        # Only the head goes out: the 413 must come from the declared length, before any of the
        # body is read. Sending the whole body raced the server's close (urllib's write failed
        # with a broken pipe once the 413 was out and the socket shut).
        big = json.dumps({"code": "print(1)", "files": {"big.bin": base64.b64encode(b"x" * (2 << 20)).decode()}})
        host, port = srv.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.putrequest("POST", "/run_code")
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(big)))
            conn.endheaders()
            response = conn.getresponse()
            status, answer = response.status, json.loads(response.read())
        finally:
            conn.close()
        assert status == 413 and answer["status"] == "SandboxError", answer
        assert "takes at most 1048576" in answer["message"] and "--max-body-mb" in answer["message"]
        status, answer = _post(srv.url + "/run_code", b"{not json")
        assert status == 400 and "not valid JSON" in answer["message"]
        assert _post(srv.url + "/run_code", {"code": "print(1)"})[0] == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.usefixtures("sandbox")
def test_sigterm_ends_the_server_and_every_run_it_started(tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below; a file, not an undrained pipe
    server = subprocess.Popen(
        [sys.executable, "-m", "verl.serving.sandbox", "--port", str(port), "max_concurrent=4",
         f"slots_dir={tmp_path / 'slots'}", "limits.wall_time_s=60", "limits.cpu_time_s=60"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/ping", timeout=2) as r:
                    assert r.read() == b'"pong"'
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.2)
        answers: list[tuple[int, dict]] = []
        clients = [
            threading.Thread(target=lambda c=c: answers.append(_post(url + "/run_code", {"code": c}, 30)), daemon=True)
            for c in (SLEEP, BUSY)
        ]
        for t in clients:
            t.start()
        runs: list[psutil.Process] = []
        deadline = time.monotonic() + 20
        while len([p for p in runs if p.name() == "bwrap"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            runs = psutil.Process(server.pid).children(recursive=True)
        assert len([p for p in runs if p.name() == "bwrap"]) >= 2, "the runs did not start"
        runs = psutil.Process(server.pid).children(recursive=True)  # with the sandboxes' own processes
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=15)
        assert time.monotonic() - start < 5.0
        gone, alive = psutil.wait_procs(runs, timeout=5)
        alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"left running after SIGTERM: {[(p.pid, p.cmdline()) for p in alive]}"
        for t in clients:
            t.join(10)
        assert [a[0] for a in answers] == [503, 503], answers
        assert all("the server stops" in a[1]["message"] for a in answers)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()


def test_the_keys_the_command_lines_hints_name_are_accepted(monkeypatch, capsys, tmp_path):
    """The runner's hint names a PPO config's key (sandbox.allow_unconfined=true), which the server
    refused as unknown; the bind hint named a Python argument (api_key=) the command line has not."""
    from verl.sandbox import runner
    from verl.serving import sandbox as server_module
    from verl.serving import server as serving_server

    real_which = runner.shutil.which
    monkeypatch.setattr(runner.shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    monkeypatch.setattr(runner, "_backend_cache", {})
    monkeypatch.delenv(server_module.API_KEY_ENV, raising=False)
    slots = f"slots_dir={tmp_path}"
    with pytest.raises(SystemExit) as exit_info:
        server_module.main([slots])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "sandbox.allow_unconfined=true" in err, err
    served: list[dict] = []
    monkeypatch.setattr(serving_server, "run", lambda app, **kw: served.append(kw))
    server_module.main([slots, "sandbox.allow_unconfined=true", "--port", "9"])
    assert served and served[0]["port"] == 9 and callable(served[0]["on_exit"])
    # Waived, it starts and says once that it runs unconfined (its own output, read apart from the next call's).
    assert "running untrusted code UNCONFINED" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        server_module.main(["--host", "0.0.0.0", slots, "allow_unconfined=true"])
    err = capsys.readouterr().err
    assert "VERL_SANDBOX_API_KEY" in err and "api_key=" not in err and len(err.strip().splitlines()) == 1, err
