"""The first exception ``verl._C`` raises in a fresh interpreter reaches Python as a ValueError with the
check's message, and the process exits cleanly (no ``terminate called ...``, no abort).

The exception crosses the C++ -> pybind11 boundary with the GIL released (the bindings' call guard),
and the first one thrown in a process is the one that sets up the unwinder's state for the module
(type info lookup, the exception translators): a build whose unwinding is broken aborts there, which an
in-process test (the suite's interpreter has thrown many before) would not see. Each case runs alone in a
fresh interpreter: on the main thread before any copy, and on a thread of its own after a good copy has
started the OpenMP pool (two threads); on every device present (the one GPU run's crash came from a refusal
in a fresh process of a CUDA build, so the CUDA case is the one that matters there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.csrc.tensors import DEVICES

SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    import torch
    torch.set_num_threads(2)
    import verl._C as C

    case, warm, device = sys.argv[1], sys.argv[2] == "warm", sys.argv[3]
    if warm:  # start the OpenMP pool (the kernel, on a GPU) with a copy large enough to spread over two threads
        big = torch.arange(2**20, dtype=torch.float32, device=device)
        out = torch.empty_like(big)
        C.copy_shards_(out, big, torch.tensor([[0, 0, 2**20]]))
        assert torch.equal(out, big)
    src, dst = torch.arange(6.0, device=device), torch.zeros(6, device=device)
    result = {}

    def refuse():
        try:
            if case.startswith("shards"):
                C.copy_shards_(dst, src, torch.tensor([[4, 0, 3]]))  # src[4:7] of 6 elements
            else:
                C.copy_ranges_([dst], [src], torch.tensor([[0, 0, 1, 0, 2]]))  # dsts[1] of one tensor
        except ValueError as exc:
            result["error"] = str(exc)

    if case.endswith("thread"):
        worker = threading.Thread(target=refuse)
        worker.start()
        worker.join()
    else:
        refuse()
    result["untouched"] = dst.tolist() == [0.0] * 6
    print(json.dumps(result))
    """
)

EXPECTED = {
    "shards": "copy_shards_: range 0 (src_offset=4, dst_offset=0, length=3) reads outside src (numel 6); "
    "need 0 <= src_offset and src_offset + length <= src.numel()",
    "ranges": "copy_ranges_: range 0 (src_index=0, src_offset=0, dst_index=1, dst_offset=0, length=2) has "
    "dst_index out of range; need 0 <= dst_index < len(dsts) = 1",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("case", "warm"), [("shards-main", "cold"), ("ranges-thread", "warm")])
def test_first_refusal_in_a_fresh_interpreter_is_a_value_error(case, warm, device):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, case, warm, device], capture_output=True, text=True,
                          timeout=100)
    # A C++ exception that escapes unwinding ends in std::terminate: SIGABRT (-6) and "terminate called".
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"error": EXPECTED[case.split("-")[0]], "untouched": True}, result
