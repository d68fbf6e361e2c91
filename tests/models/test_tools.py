"""tools/hf2megatron.py and tools/megatron2hf.py as a user runs them (subprocesses)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.cli_errors import one_error_line
from tests.models.tiny import make_tiny_model
from verl.utils.outputs import MARKER_FILE

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF2MEG = os.path.join(ROOT, "tools", "hf2megatron.py")
MEG2HF = os.path.join(ROOT, "tools", "megatron2hf.py")


def _run(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _in_process(capsys, tool_path: str, *args: str) -> subprocess.CompletedProcess:
    """The tool's ``main(argv)`` in this process (what its command runs): exit status and output as
    :func:`_run` returns them, without a Python start (torch and Megatron imports) per case. The
    refusal tests run one case as a command and the others this way."""
    from verl.testing.commands import load_script, run_main

    return run_main(load_script(tool_path).main, args, capsys=capsys, name=tool_path)


def test_help_explains_every_flag():
    for tool, flags in (
        (HF2MEG, ["--hf-dir", "--out-dir", "--tp", "--pp", "--dtype", "--head", "--vocab-pad-multiple", "--check",
                  "--tolerance", "--overwrite", "--no-progress"]),
        (MEG2HF, ["--megatron-dir", "--out-dir", "--dtype", "--max-shard-gib", "--merge-lora", "--base-dir", "--overwrite",
                  "--no-progress"]),
    ):
        out = _run(tool, "--help")
        assert out.returncode == 0
        for flag in flags:
            assert flag in out.stdout, (tool, flag)


def test_help_names_every_family_the_builder_takes():
    from verl.models.hf_config import SUPPORTED_MODEL_TYPES

    names = {"llama": "Llama", "qwen2": "Qwen2,", "qwen3": "Qwen3,", "mistral": "Mistral", "qwen3_moe": "Qwen3-MoE",
             "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE"}
    assert set(names) == set(SUPPORTED_MODEL_TYPES)  # a new family: name it in hf2megatron's docstring and here
    out = _run(HF2MEG, "--help")
    assert out.returncode == 0
    for name in names.values():
        assert name in out.stdout, name


def test_missing_and_partial_inputs_are_clear_errors(tmp_path, capsys):
    out = _run(HF2MEG, "--hf-dir", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "o"))
    assert out.returncode == 2 and "no such directory" in out.stderr
    model = make_tiny_model(str(tmp_path / "hf"), "llama_gqa")
    os.remove(os.path.join(model, "model.safetensors"))
    out = _in_process(capsys, HF2MEG, "--hf-dir", model, "--out-dir", str(tmp_path / "o"))
    assert out.returncode == 2 and "no *.safetensors" in out.stderr
    out = _in_process(capsys, MEG2HF, "--megatron-dir", model, "--out-dir", str(tmp_path / "o"))
    assert out.returncode == 2 and "verl_model.json is missing" in out.stderr
    assert not os.path.exists(tmp_path / "o")


def test_layout_that_cannot_split_names_the_field(tmp_path, capsys):
    model = make_tiny_model(str(tmp_path / "hf"), "llama_gqa")  # one key/value head
    out = _in_process(capsys, HF2MEG, "--hf-dir", model, "--out-dir", str(tmp_path / "o"), "--tp", "2")
    assert out.returncode == 2 and "num_key_value_heads=1" in out.stderr


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A Mistral model converted by the CLI at TP2 in bf16 with --check, and the CLI's output."""
    root = tmp_path_factory.mktemp("tools")
    model = make_tiny_model(str(root / "hf"), "mistral", seed=2)
    ckpt = root / "ckpt"
    out = _run(HF2MEG, "--hf-dir", model, "--out-dir", str(ckpt), "--tp", "2", "--dtype", "bf16", "--check", "--no-progress")
    return model, ckpt, out


@pytest.fixture(scope="module")
def back_to_hf(converted, tmp_path_factory):
    """That checkpoint converted back by megatron2hf once for the file (the tests that need a plain
    conversion of it read or copy this one), and the CLI's output."""
    _, ckpt, _ = converted
    back = tmp_path_factory.mktemp("back") / "back"
    return back, _run(MEG2HF, "--megatron-dir", str(ckpt), "--out-dir", str(back), "--no-progress")


def test_convert_with_check(converted):
    model, ckpt, out = converted
    assert out.returncode == 0, out.stderr[-3000:]
    diff = float(out.stdout.split("max_abs_diff=")[1].split()[0])
    assert diff < 1e-4  # float32 compute on bf16-rounded weights on both sides: rounding only
    assert "peak_rss_mib_per_rank=" in out.stdout
    assert os.path.isfile(ckpt / "hf" / "config.json") and os.path.isfile(ckpt / "verl_model.json")
    again = _run(HF2MEG, "--hf-dir", model, "--out-dir", str(ckpt))
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_back_to_hf_loads_in_transformers(converted, back_to_hf):
    from transformers import AutoModelForCausalLM

    model, _, _ = converted
    back, out = back_to_hf
    assert out.returncode == 0, out.stderr[-3000:]
    original = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    reloaded = AutoModelForCausalLM.from_pretrained(str(back))
    assert reloaded.dtype == torch.bfloat16
    expected = {k: v.to(torch.bfloat16) for k, v in original.state_dict().items()}
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_overwrite_replaces_only_what_verl_wrote(converted, back_to_hf, tmp_path, capsys):
    """--overwrite onto a folder verl did not write deleted the user's files in it; without it, a
    folder verl did write was called "not written by verl". Both tools share the rule. The first
    refusal runs as a command, the rest by megatron2hf's main(argv) here (no Python start each)."""
    _, ckpt, _ = converted
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = _run(MEG2HF, "--megatron-dir", str(ckpt), "--out-dir", str(mine), "--overwrite", "--no-progress")
    assert one_error_line(proc, "megatron2hf").endswith(
        f"--out-dir={mine} already exists, is not empty and was not written by verl (it holds notes.txt); "
        "--overwrite replaces only a folder verl wrote: choose another --out-dir (nothing was changed)"
    )
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    back = tmp_path / "back"
    assert back_to_hf[1].returncode == 0, back_to_hf[1].stderr[-3000:]
    shutil.copytree(back_to_hf[0], back)  # a folder megatron2hf wrote (its marker file with it)
    proc = _in_process(capsys, MEG2HF, "--megatron-dir", str(ckpt), "--out-dir", str(back), "--no-progress")
    assert one_error_line(proc, "megatron2hf").endswith(
        f"--out-dir={back} holds an earlier Hugging Face checkpoint (tools/megatron2hf.py) written by verl; pass "
        "--overwrite to replace it (once the new one is complete) or choose another --out-dir (nothing was changed)"
    )
    proc = _in_process(capsys, MEG2HF, "--megatron-dir", str(ckpt), "--out-dir", str(back), "--overwrite", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isfile(back / "config.json") and os.path.isfile(back / MARKER_FILE)


def test_a_training_checkpoint_is_converted_from_its_step_folder(converted, back_to_hf, tmp_path, capsys):
    """--megatron-dir global_step_N finds the actor's model inside; the checkpoint root names the step."""
    _, ckpt, _ = converted
    step = tmp_path / "ckpt" / "global_step_3"
    shutil.copytree(ckpt, step / "actor" / "model")  # where a trainer keeps its actor's model
    out = _run(MEG2HF, "--megatron-dir", str(step), "--out-dir", str(tmp_path / "from_step"), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"reading the model checkpoint {step}/actor/model" in out.stderr
    direct_dir, direct = back_to_hf  # the same checkpoint converted from its own folder
    assert direct.returncode == 0, direct.stderr[-3000:]
    expected = sorted(p.name for p in direct_dir.iterdir())
    assert sorted(p.name for p in (tmp_path / "from_step").iterdir()) == expected
    for name in (n for n in expected if n != MARKER_FILE):  # the marker holds its write time
        assert (tmp_path / "from_step" / name).read_bytes() == (direct_dir / name).read_bytes(), name
    root = _in_process(capsys, MEG2HF, "--megatron-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "o"),
                       "--no-progress")
    assert one_error_line(root, "megatron2hf").endswith(
        f"pass one step, e.g. the newest: --megatron-dir {step} (its actor model, {step}/actor/model)")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("damage", "pattern"),
    [
        ("truncate", r"__0_0\.distcp is truncated: 2000 bytes, the checkpoint's \.metadata needs \d+; copy"),
        ("remove", r"__0_0\.distcp is missing \(the checkpoint's \.metadata refers to it\)"),
        ("metadata", r"\.metadata cannot be read \(UnpicklingError: .*\); a truncated or partial copy"),
    ],
)
def test_a_damaged_distributed_checkpoint_names_the_file(converted, tmp_path, capsys, damage, pattern):
    import re
    import shutil

    _, ckpt, _ = converted
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    if damage == "truncate":
        os.truncate(copy / "__0_0.distcp", 2000)
    elif damage == "remove":
        os.remove(copy / "__0_0.distcp")
    else:
        os.truncate(copy / ".metadata", 100)
    run = _run if damage == "truncate" else lambda *args: _in_process(capsys, *args)  # one case as a command
    out = run(MEG2HF, "--megatron-dir", str(copy), "--out-dir", str(tmp_path / "back"), "--no-progress")
    assert re.search(pattern, one_error_line(out, "megatron2hf")), out.stderr
    assert not os.path.exists(tmp_path / "back") and os.listdir(tmp_path) == ["ckpt"]  # nothing written


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_an_output_over_its_input_is_refused(converted, tmp_path, capsys, where):
    import shutil

    model, _, _ = converted
    hf = tmp_path / "hf"
    shutil.copytree(model, hf)
    before = sorted(os.listdir(hf))
    out = {"same": hf, "inside": hf / "megatron", "around": tmp_path}[where]
    relation = {"same": "is", "inside": "is inside", "around": "contains"}[where]
    run = _run if where == "same" else lambda *args: _in_process(capsys, *args)  # one case as a command
    proc = run(HF2MEG, "--hf-dir", str(hf), "--out-dir", str(out), "--overwrite", "--no-progress")
    assert one_error_line(proc, "hf2megatron").endswith(
        f"--out-dir={out} {relation} the input --hf-dir={hf}; writing there would replace or delete what it is "
        "made from: choose a --out-dir elsewhere"
    )
    assert sorted(os.listdir(hf)) == before


def test_megatron2hf_output_over_its_input_is_refused(converted, tmp_path):
    """The same rule in megatron2hf (its one case here: it ran once per case of the test above, the
    same command each time)."""
    _, ckpt, _ = converted
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    proc = _run(MEG2HF, "--megatron-dir", str(copy), "--out-dir", str(copy), "--overwrite", "--no-progress")
    assert one_error_line(proc, "megatron2hf").endswith(
        f"--out-dir={copy} is the input --megatron-dir={copy}; writing there would replace or delete what it "
        "is made from: choose a --out-dir elsewhere"
    )
    assert os.path.isfile(copy / "verl_model.json")


def test_a_failed_checkpoint_read_is_one_line(monkeypatch, capsys, tmp_path):
    # Damage that the size check cannot see still ends in one line naming the checkpoint.
    import importlib.util

    from torch.distributed.checkpoint.api import CheckpointException

    import verl.models.convert as convert

    def broken(**_):
        raise CheckpointException("load failed", {0: (RuntimeError("PytorchStreamReader failed reading zip archive"), None)})

    monkeypatch.setattr(convert, "megatron_to_hf", broken)
    spec = importlib.util.spec_from_file_location("megatron2hf_tool", MEG2HF)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(SystemExit) as exc:
        tool.main(["--megatron-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "o")])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        f"megatron2hf: error: cannot read the checkpoint in {tmp_path}/ckpt (RuntimeError: PytorchStreamReader failed "
        "reading zip archive); is it complete and unmodified? Copy it again\n"
    )


@pytest.mark.parametrize(
    ("tool", "args", "message"),
    [
        (HF2MEG, ["--tp", "0"], "argument --tp: must be >= 1, got 0"),
        (HF2MEG, ["--pp", "two"], "argument --pp: expected a whole number, got 'two'"),
        (HF2MEG, ["--tolerance", "-1"], "argument --tolerance: must be >= 0, got -1"),
        (MEG2HF, ["--max-shard-gib", "0"], "argument --max-shard-gib: must be > 0, got 0"),
    ],
)
def test_nonsensical_numbers_are_refused_by_the_parser(tmp_path, tool, args, message):
    dirs = ["--hf-dir", str(tmp_path)] if tool == HF2MEG else ["--megatron-dir", str(tmp_path)]
    out = _run(tool, *dirs, "--out-dir", str(tmp_path / "o"), *args)
    assert one_error_line(out, os.path.basename(tool)[: -len(".py")]).endswith(message)


def test_check_detects_a_wrong_checkpoint(converted, tmp_path):
    from verl.models.convert import check_conversion

    _, ckpt, _ = converted
    other = make_tiny_model(str(tmp_path / "other"), "mistral", seed=6)
    assert check_conversion(ckpt_dir=str(ckpt), hf_dir=other, tp=1, pp=1) > 1e-2


def test_killed_conversion_leaves_nothing_under_the_target(tmp_path):
    model = make_tiny_model(str(tmp_path / "hf"), "llama3")
    target = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [sys.executable, HF2MEG, "--hf-dir", model, "--out-dir", str(target), "--tp", "2", "--no-progress"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not glob.glob(str(tmp_path / ".ckpt.partial-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "conversion finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGKILL)  # the tool and the ranks it spawned
    proc.wait()
    assert not target.exists()


def test_uneven_pipeline_and_moe_convert_both_ways(tmp_path):
    """A 3-layer Qwen3-MoE written and checked at --pp 2 (stages of 2 and 1 layers, chosen by the
    converter) and back to Hugging Face bit-exactly."""
    from safetensors.torch import load_file

    model = make_tiny_model(str(tmp_path / "hf"), "qwen3_moe", num_hidden_layers=3)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    out = _run(HF2MEG, "--hf-dir", model, "--out-dir", str(ckpt), "--pp", "2", "--check", "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split("max_abs_diff=")[1].split()[0]) < 1e-5  # float32 both sides: rounding only
    out = _run(MEG2HF, "--megatron-dir", str(ckpt), "--out-dir", str(back), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    expected, actual = load_file(os.path.join(model, "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(actual) == set(expected) and all(torch.equal(actual[k], expected[k]) for k in expected)


def test_lora_flags_on_a_checkpoint_without_adapters_are_one_line(capsys, tmp_path):
    """--merge-lora / --base-dir name a LoRA checkpoint's options: on anything else, one line saying so."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron2hf_tool", MEG2HF)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(SystemExit) as exc:
        tool.main(["--megatron-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "o"), "--merge-lora"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        f"megatron2hf: error: {tmp_path}/ckpt is not a LoRA checkpoint (no model/lora.json); drop --merge-lora/--base-dir\n"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_converts_and_checks_at_tp_2(tmp_path, family):
    """#58: --check of a MoE model at --tp 2 ended in Megatron's traceback ("MoE and tensor parallelism
    ... without also enabling sequence parallelism", a rule for training); the check's pass is inference."""
    model = make_tiny_model(str(tmp_path / "hf"), family)
    out = _run(HF2MEG, "--hf-dir", model, "--out-dir", str(tmp_path / "ckpt"), "--tp", "2", "--check", "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert float(out.stdout.split("max_abs_diff=")[1].split()[0]) < 1e-5  # float32 both sides: rounding only
