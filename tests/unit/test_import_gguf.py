"""``eagle3-pipeline import-gguf`` on bad input, and the directory staging it writes through.

Every refusal is a real run of the command in a subprocess: it exits 2, names the file, the
cause and the fix, and leaves nothing at the output. The real conversion of SmolLM2 (and the
role's step) is in tests/integration/test_import_gguf_smollm2.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from smollm2 import smollm2_gguf
from tiny_target import built_tiny_model

from eagle3_pipeline.atomic_dir import REPLACED, STAGING, abandoned, remove_abandoned, staged_directory
from eagle3_pipeline.models.gguf_import import (
    RECIPE_VERSION,
    RECORD_NAME,
    REQUIREMENTS,
    BadInput,
    GgufImportError,
    _check_logits,
    _check_prompts,
    inspect_gguf,
    plan_import,
    read_gguf_header,
)

ROOT = Path(__file__).resolve().parents[2]


def import_gguf_command(*args, python_prelude: str = "") -> subprocess.CompletedProcess:
    """Run ``eagle3-pipeline import-gguf ARGS`` in a fresh Python (after ``python_prelude``)."""
    script = f"import sys\n{python_prelude}\nfrom eagle3_pipeline.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", script, "import-gguf", *map(str, args)],
                          capture_output=True, text=True, timeout=300, check=False)


def write_gguf(path: Path, architecture: str, name: str) -> Path:
    """A small real GGUF file (written by the gguf package): its metadata and one float32 tensor."""
    gguf = pytest.importorskip("gguf")
    numpy = pytest.importorskip("numpy")
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", numpy.zeros((4, 8), dtype=numpy.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def siblings(path: Path) -> list[str]:
    """Names beside ``path`` that a run may have left (its lock file aside)."""
    return sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock"))


def test_the_header_names_the_architecture_of_a_real_and_of_a_written_gguf(tmp_path):
    header = read_gguf_header(smollm2_gguf())
    assert (header.version, header.architecture, header.tensor_count) == (3, "llama", 272)
    assert "135M" in header.name
    written = read_gguf_header(write_gguf(tmp_path / "odd.gguf", "eagle3-test-arch", "not a model"))
    assert (written.architecture, written.name, written.tensor_count) == ("eagle3-test-arch", "not a model", 1)


def test_a_missing_file_is_refused_by_name(tmp_path):
    result = import_gguf_command("--gguf", tmp_path / "absent.gguf", "--output", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert f"error: --gguf {tmp_path / 'absent.gguf'}: no such file" in result.stderr
    assert siblings(tmp_path / "out") == []


def test_a_file_that_is_not_gguf_is_refused_by_its_first_bytes(tmp_path):
    not_gguf = tmp_path / "model.safetensors"
    not_gguf.write_bytes(b'{"__metadata__": {}}' + bytes(64))
    result = import_gguf_command("--gguf", not_gguf, "--output", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert "not a GGUF file (it starts with b'{\"__'" in result.stderr
    assert siblings(tmp_path / "out") == ["model.safetensors"]


def test_a_truncated_gguf_is_refused_as_damaged(tmp_path):
    truncated = tmp_path / "cut.gguf"
    with open(smollm2_gguf(), "rb") as handle:
        truncated.write_bytes(handle.read(100))  # inside the first metadata keys
    result = import_gguf_command("--gguf", truncated, "--output", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert "the GGUF header ends early (truncated or damaged file)" in result.stderr


def test_an_architecture_transformers_cannot_read_is_named(tmp_path):
    odd = write_gguf(tmp_path / "odd.gguf", "eagle3-test-arch", "not a model")
    result = import_gguf_command("--gguf", odd, "--output", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert re.search(r"transformers [\d.]+ cannot read a causal language model of GGUF architecture "
                     r"'eagle3-test-arch'", result.stderr), result.stderr
    assert siblings(tmp_path / "out") == ["odd.gguf"]  # the staging directory went with the failure


def test_missing_gguf_and_accelerate_name_the_pip_command(tmp_path):
    # The command's own modules are imported first; then no package of the venv can be found,
    # as in a Python where gguf and accelerate were never installed.
    prelude = ("import eagle3_pipeline.cli, eagle3_pipeline.models.gguf_import\n"
               "sys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n")
    result = import_gguf_command("--gguf", smollm2_gguf(), "--output", tmp_path / "out", python_prelude=prelude)
    assert result.returncode == 2, result.stderr
    assert "needs the Python package(s) gguf, accelerate" in result.stderr
    assert f"-m pip install {REQUIREMENTS['gguf']} {REQUIREMENTS['accelerate']}" in result.stderr
    assert siblings(tmp_path / "out") == []


def test_a_directory_that_is_not_a_conversion_is_never_replaced(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    for extra in ([], ["--force"]):
        result = import_gguf_command("--gguf", smollm2_gguf(), "--output", precious, *extra)
        assert result.returncode == 2, result.stderr
        assert f"is not a GGUF conversion (no {RECORD_NAME}); it is never replaced" in result.stderr
    assert (precious / "notes.txt").read_text() == "keep me"
    assert siblings(precious) == ["precious"]


def test_sigterm_stops_a_conversion_and_leaves_nothing_at_the_output(tmp_path):
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "eagle3_pipeline.cli", "import-gguf", "--gguf", str(smollm2_gguf()), "--output",
         str(out)], stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if "loading" in line:  # transformers is reading the GGUF
                assert [p.name for p in tmp_path.iterdir() if ".staging-" in p.name]
                process.send_signal(signal.SIGTERM)
                break
        rest = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
    assert process.returncode == 4, rest
    assert "stopped by signal 15: nothing was written at the output; run it again to convert" in rest
    assert siblings(out) == []


def test_check_mode_says_what_a_run_would_do_and_writes_nothing(tmp_path):
    result = import_gguf_command("--gguf", smollm2_gguf(), "--output", tmp_path / "out", "--check", "--json")
    assert result.returncode == 0, result.stderr
    assert '"action": "convert"' in result.stdout and '"changes": true' in result.stdout
    assert "does not exist" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_plan_over_an_existing_conversion_follows_its_record(tmp_path):
    gguf_file = smollm2_gguf()
    inspected = inspect_gguf(gguf_file)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(bytes(10))

    def plan_over(force=False, dtype="float32", **record_changes):
        record = {"recipe_version": RECIPE_VERSION, "gguf": {"path": str(gguf_file), "sha256": inspected[1]},
                  "settings": {"dtype": "float32"}, "files": {"model.safetensors": {"size": 10}}, **record_changes}
        (out / RECORD_NAME).write_text(json.dumps(record))
        return plan_import(gguf_file, out, dtype=dtype, force=force, inspected=inspected)

    assert (plan_over().action, plan_over().changes) == ("none", False)
    assert plan_over(force=True).reason.startswith("--force: converting again")
    older = plan_over(recipe_version=RECIPE_VERSION - 1)
    assert older.action == "convert" and f"by recipe {RECIPE_VERSION - 1}" in older.reason
    with pytest.raises(BadInput, match="holds a conversion of .* float32.*; this run asks for .* bfloat16"):
        plan_over(dtype="bfloat16")
    other = {"path": "/elsewhere/other.gguf", "sha256": "0" * 64}
    with pytest.raises(BadInput, match="holds a conversion of /elsewhere/other.gguf .*pass --force to replace it"):
        plan_over(gguf=other)
    assert plan_over(gguf=other, force=True).reason.startswith("--force: replacing the conversion of /elsewhere")
    (out / "model.safetensors").write_bytes(bytes(5))  # torn
    damaged = plan_over()
    assert damaged.action == "convert" and "model.safetensors has 5 bytes, 10 recorded" in damaged.reason
    (out / "model.safetensors").write_bytes(bytes(10))
    debris = tmp_path / f".out.{STAGING}-{dead_pid()}-xyz"
    debris.mkdir()
    left = plan_over()
    assert (left.action, left.changes, left.abandoned) == ("none", True, [str(debris)])


def test_the_logit_check_passes_faithful_weights_and_refuses_wrong_ones(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    path = built_tiny_model()
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompts = _check_prompts(tokenizer, reference.config.vocab_size)
    same = _check_logits(reference, copy.deepcopy(reference), prompts, "float32", tmp_path)
    assert (same.max_relative_difference, same.greedy_same) == (0.0, same.positions)

    rounded = copy.deepcopy(reference).to(torch.bfloat16).float()  # what a bfloat16 checkpoint holds
    assert 0 < _check_logits(reference, rounded, prompts, "bfloat16", tmp_path).max_relative_difference <= 5e-2
    with pytest.raises(GgufImportError, match=r"differ from the GGUF-loaded model's by .* \(allowed for float32"):
        _check_logits(reference, rounded, prompts, "float32", tmp_path)

    # llama.cpp stores q/k rows permuted for its rotary embedding; left permuted, the model is wrong.
    permuted = copy.deepcopy(reference)
    weight = permuted.model.layers[0].self_attn.k_proj.weight
    head_dim = reference.config.hidden_size // reference.config.num_attention_heads
    heads = weight.shape[0] // head_dim
    with torch.no_grad():
        weight.copy_(weight.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape))
    with pytest.raises(GgufImportError, match="the conversion is wrong and is not kept"):
        _check_logits(reference, permuted, prompts, "bfloat16", tmp_path)


def test_the_pins_of_the_gguf_extra_are_the_ones_the_command_names():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gguf"]
    assert sorted(extra) == sorted(REQUIREMENTS.values())
    dev = (ROOT / "requirements" / "dev.txt").read_text().splitlines()
    assert set(REQUIREMENTS.values()) <= set(dev)


# -- atomic_dir: the staging the conversion writes through ------------------------------------


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_failed_build_leaves_the_old_directory_whole_and_nothing_beside_it(tmp_path):
    out = tmp_path / "model"
    with staged_directory(out) as staging:
        (staging / "weights").write_text("first")
    with pytest.raises(RuntimeError), staged_directory(out) as staging:
        (staging / "weights").write_text("half of the second")
        raise RuntimeError("crash in the middle")
    assert (out / "weights").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    with staged_directory(out) as staging:
        (staging / "weights").write_text("second")
    assert (out / "weights").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777, (out / "weights").stat().st_mode & 0o777) == (0o777 & ~umask, 0o666 & ~umask)


def test_debris_of_dead_runs_is_removed_and_a_set_aside_directory_restored(tmp_path):
    out = tmp_path / "model"
    gone, alive = dead_pid(), os.getpid()
    (tmp_path / f".model.{STAGING}-{gone}-abc").mkdir()
    (tmp_path / f".model.{STAGING}-{alive}-def").mkdir()  # a run in progress: left alone
    previous = tmp_path / f".model.{REPLACED}-{gone}-ghi" / "previous"
    previous.mkdir(parents=True)
    (previous / "weights").write_text("the only copy")
    assert [path.name for _kind, path in abandoned(out)] == [f".model.{REPLACED}-{gone}-ghi",
                                                               f".model.{STAGING}-{gone}-abc"]
    said = []
    remove_abandoned(out, said.append)
    assert (out / "weights").read_text() == "the only copy"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".model.{STAGING}-{alive}-def", "model"]
    assert any("restored" in line for line in said) and any("removing" in line for line in said)
