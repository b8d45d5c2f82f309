"""``eagle3-pipeline train`` as a user runs it: real subprocesses, signals, torchrun with gloo.

The target is the tiny random Llama of ``train_fixtures`` and its stored hidden states.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from train_fixtures import HIDDEN, VOCAB, build_data, build_target

from eagle3_pipeline.train import trainer as tr
from eagle3_pipeline.train.command import EXIT_BAD_INPUT, EXIT_STOPPED

pytest.importorskip("transformers")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target_dir):
    return build_data(tmp_path_factory.mktemp("extracted"), *target_dir)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def args(data_dir, out, *extra) -> list[str]:
    return [sys.executable, "-m", "eagle3_pipeline.cli", "train", "--data-dir", str(data_dir), "--output-dir",
            str(out), "--draft-vocab-size", "48", "--ttt-length", "3", "--lr", "3e-3", "--warmup-steps", "2",
            "--batch-tokens", "64", "--eval-ratio", "0.2", "--no-tensorboard", "--no-charts", *extra]


def run(cmd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout, check=False)


def train_losses(out: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (out / tr.METRICS_FILE).read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def test_check_train_and_the_rerun_that_does_nothing(data_dir, tmp_path):
    out = tmp_path / "run"
    check = run(args(data_dir, out, "--epochs", "4", "--max-steps", "6", "--check"))
    assert check.returncode == 0, check.stderr
    status = json.loads(check.stdout)
    assert status["complete"] is False and status["resume_step"] is None
    assert status["draft_vocab_size"] == 48 and status["vocab_size"] == VOCAB and status["limit_steps"] == 6
    assert not out.exists(), "--check must write nothing"

    first = run(args(data_dir, out, "--epochs", "4", "--max-steps", "6"))
    assert first.returncode == 0, first.stderr
    assert "acc per position" in first.stderr and str(out / "drafter") in first.stderr
    record = json.loads((out / tr.TRAINING_FILE).read_text())
    rounds = record["eval"]["opening"]["rounds"]
    taus = ", ".join(f"{rounds[chain]['tau']:.2f} at {chain}" for chain in ("1", "2", "3"))
    assert f"walked round by round as serving drafts them: tau {taus} drafts per verify" in first.stderr
    record = json.loads((out / tr.TRAINING_FILE).read_text())
    assert record["steps"] == 6 and record["eval"]["samples"] > 0
    assert json.loads((out / tr.PROGRESS_FILE).read_text())["state"] == "done"
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 48
    assert (out / tr.SPECULATORS_DIR / "model.safetensors").is_file()

    status = json.loads(run(args(data_dir, out, "--epochs", "4", "--max-steps", "6", "--check")).stdout)
    assert status["complete"] is True
    before = mtimes(out)
    again = run(args(data_dir, out, "--epochs", "4", "--max-steps", "6"))
    assert again.returncode == 0 and "already done" in again.stderr
    assert mtimes(out) == before, "a rerun for the same data and settings must touch nothing"

    # Other settings: not complete; a longer run continues from the last checkpoint.
    longer = run(args(data_dir, out, "--epochs", "4", "--max-steps", "8"))
    assert longer.returncode == 0, longer.stderr
    assert [s for s, _ in train_losses(out)] == list(range(1, 9))


def test_bad_inputs_exit_2_with_the_cause(data_dir, tmp_path, target_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run(args(empty, tmp_path / "a", "--check"))
    assert result.returncode == EXIT_BAD_INPUT and "data_config.json" in result.stderr
    assert "Traceback" not in result.stderr
    result = run(args(data_dir, tmp_path / "b", "--check") + ["--draft-vocab-size", str(VOCAB + 1)])
    assert result.returncode == EXIT_BAD_INPUT and "larger than the target's vocabulary" in result.stderr
    # A target other than the one the data came from (another hidden size).
    import transformers  # noqa: PLC0415

    other = tmp_path / "other"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN * 2, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(other)
    result = run(args(data_dir, tmp_path / "c", "--target-model-path", str(other)))
    assert result.returncode == EXIT_BAD_INPUT and "extracted from another model" in result.stderr
    progress = json.loads((tmp_path / "c" / tr.PROGRESS_FILE).read_text())
    assert progress["state"] == "failed" and progress["exit_code"] == EXIT_BAD_INPUT
    result = run(args(data_dir, tmp_path / "d", "--device", "cuda:0" if not torch.cuda.is_available() else "nope"))
    assert result.returncode == EXIT_BAD_INPUT and "device" in result.stderr


def test_sigterm_checkpoints_and_kill_9_loses_nothing(data_dir, tmp_path):
    """SIGTERM: exit 4 with a checkpoint at the step reached; kill -9: a rerun resumes from the
    last checkpoint; both resumed curves equal the uninterrupted run's, step for step."""
    # The interrupted runs may go on to the schedule's end (200 steps), so that a signal that a busy machine
    # sends late still lands mid-run; the reruns and the uninterrupted run then stop at the same step: 60, or
    # where the interruptions left the runs when later (max_steps ends a run without changing its schedule).
    schedule = ["--epochs", "40", "--checkpoint-every", "10"]
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(args(data_dir, stopped, *schedule), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (stopped / tr.METRICS_FILE).is_file() and len(train_losses(stopped)) >= 3, "3 steps", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, f"exit {proc.returncode} (the run ended before the SIGTERM?): {err}"
    progress = json.loads((stopped / tr.PROGRESS_FILE).read_text())
    assert progress["state"] == "stopped" and "rerun to continue" in progress["message"]
    at = progress["step"]
    assert at >= 3 and (stopped / "checkpoints" / f"step-{at}").is_dir()

    killed = tmp_path / "killed"
    proc = subprocess.Popen(args(data_dir, killed, *schedule), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    # Any checkpoint: the trainer keeps only the newest two, so a given one may be gone when a busy poller looks.
    wait_for(lambda: any((killed / "checkpoints").glob("step-*")), "a checkpoint", proc)
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}: the run ended before the kill"
    assert not (killed / tr.TRAINING_FILE).exists()
    resumes_at = max(int(path.name.removeprefix("step-")) for path in (killed / "checkpoints").glob("step-*"))

    limit = max(60, at, resumes_at)
    steps = [*schedule, "--max-steps", str(limit)]
    whole = tmp_path / "whole"
    assert run(args(data_dir, whole, *steps)).returncode == 0
    for out in (stopped, killed):
        rerun = run(args(data_dir, out, *steps))
        assert rerun.returncode == 0, rerun.stderr
        assert train_losses(out) == train_losses(whole)
        assert [s for s, _ in train_losses(out)] == list(range(1, limit + 1))


def test_two_processes_under_torchrun(data_dir, tmp_path):
    out = tmp_path / "ddp"
    result = run(args(data_dir, out, "--epochs", "4", "--max-steps", "4", "--nproc-per-node", "2", "--master-port",
                      str(free_port())), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((out / tr.TRAINING_FILE).read_text())
    assert record["world"] == 2 and record["steps"] == 4 and record["eval"]["samples"] > 0
    # The held-out first answers walked on both processes, summed: each held-out sample once.
    walked = record["eval"]["opening"]["rounds"]
    assert walked and all(figures["requests"] == record["eval"]["samples"] for figures in walked.values())
    assert (out / "drafter" / "model.safetensors").is_file()
    lines = [json.loads(line) for line in (out / tr.METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == [1, 2, 3, 4]
    # Each step's tokens are both processes' batches together.
    assert all(r["tokens"] > 64 for r in lines if r["kind"] == "train")


def test_a_reshaped_drafter_trains_its_own_embeddings(data_dir, tmp_path):
    from eagle3_pipeline.train import export as ex  # noqa: PLC0415

    out = tmp_path / "wide"
    result = run(args(data_dir, out, "--epochs", "2", "--hidden-size", "48", "--num-attention-heads", "4",
                      "--num-key-value-heads", "2", "--intermediate-size", "96", "--checkpoint-every", "3"))
    assert result.returncode == 0, result.stderr
    assert "embed_tokens is trained and exported" in result.stdout
    state, config = ex.load_export(out / "drafter")
    assert config["hidden_size"] == 48 and config["target_hidden_size"] == HIDDEN
    assert config["intermediate_size"] == 96 and config["num_attention_heads"] == 4
    assert tuple(state["embed_tokens.weight"].shape) == (VOCAB, 48)
    assert tuple(state["fc.weight"].shape) == (48, 3 * HIDDEN)


def test_fsdp_follows_ddp_and_resumes(data_dir, tmp_path):
    """FSDP (sharded weights and optimizer state) steps as DDP does, and resumes from its checkpoint."""
    common = ["--epochs", "4", "--nproc-per-node", "2"]
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    result = run(args(data_dir, ddp, *common, "--max-steps", "6", "--master-port", str(free_port())), timeout=600)
    assert result.returncode == 0, result.stderr
    result = run(args(data_dir, fsdp, *common, "--max-steps", "4", "--parallel", "fsdp", "--master-port",
                      str(free_port())), timeout=600)
    assert result.returncode == 0, result.stderr
    result = run(args(data_dir, fsdp, *common, "--max-steps", "6", "--parallel", "fsdp", "--master-port",
                      str(free_port())), timeout=600)
    assert result.returncode == 0, result.stderr
    assert json.loads((fsdp / tr.TRAINING_FILE).read_text())["resumed_from"].endswith("step-4")
    got, want = train_losses(fsdp), train_losses(ddp)
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, 7))
    for (_, a), (_, b) in zip(got, want):
        assert abs(a - b) <= 1e-4 * abs(b), (got, want)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_global_batch_trains_the_same_steps_on_one_process_as_on_two(data_dir, tmp_path, parallel):
    # 256 tokens a step: one process accumulating 4 batches of 64, or two processes accumulating 2 each.
    common = ["--epochs", "4", "--max-steps", "4", "--global-batch-tokens", "256"]
    one, two = tmp_path / "one", tmp_path / "two"
    result = run(args(data_dir, one, *common), timeout=600)
    assert result.returncode == 0, result.stderr
    result = run(args(data_dir, two, *common, "--nproc-per-node", "2", "--parallel", parallel, "--master-port",
                      str(free_port())), timeout=600)
    assert result.returncode == 0, result.stderr
    got, want = train_losses(two), train_losses(one)
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(got, want):
        assert abs(a - b) <= 1e-4 * abs(b), (got, want)
    tokens = [[json.loads(line)["tokens"] for line in (out / tr.METRICS_FILE).read_text().splitlines()
               if json.loads(line)["kind"] == "train"] for out in (one, two)]
    assert tokens[0] == tokens[1]  # the same packed batches in every step
    records = [json.loads((out / tr.TRAINING_FILE).read_text()) for out in (one, two)]
    assert (records[0]["world"], records[1]["world"]) == (1, 2)


def _command_in_a_group(rank: int, port: int, argv: list[str]) -> None:
    """One of two processes of a gloo group, set up as torchrun sets it up, running the command in-process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    from eagle3_pipeline import cli  # noqa: PLC0415

    assert cli.main(argv) == 0
    # The training's modules (the DDP / FSDP wrapper holds the group) outlive it in reference cycles. Freed by
    # the command, while the interpreter runs: at its shutdown, the group's gloo threads can abort the process
    # after a good run (seen in CI).
    alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    assert not alive, f"modules left for the interpreter's shutdown: {alive}"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_process_leaves_nothing_of_its_training_to_the_interpreters_shutdown(data_dir, tmp_path, parallel):
    argv = args(data_dir, tmp_path / parallel, "--epochs", "4", "--max-steps", "2", "--parallel", parallel)[3:]
    mp.spawn(_command_in_a_group, args=(free_port(), argv), nprocs=2, join=True)
    assert json.loads((tmp_path / parallel / tr.TRAINING_FILE).read_text())["world"] == 2


def test_check_counts_every_process_and_refuses_an_incompatible_resume(data_dir, tmp_path):
    out = tmp_path / "run"
    one = json.loads(run(args(data_dir, out, "--epochs", "4", "--check")).stdout)
    two = json.loads(run(args(data_dir, out, "--epochs", "4", "--nnodes", "2", "--check")).stdout)
    # 5 packed batches per epoch: one process steps 5 times, each of two processes 2 times (the odd one waits).
    assert (one["world"], one["total_steps"]) == (1, 20) and (two["world"], two["total_steps"]) == (2, 8)
    assert run(args(data_dir, out, "--epochs", "4", "--max-steps", "2", "--checkpoint-every", "1")).returncode == 0
    again = run(args(data_dir, out, "--epochs", "4", "--max-steps", "3", "--check"))
    assert again.returncode == 0 and json.loads(again.stdout)["resume_step"] == 2
    other = run(args(data_dir, out, "--epochs", "4", "--max-steps", "3", "--seed", "1", "--check"))
    assert other.returncode == EXIT_BAD_INPUT and "seed 0 -> 1" in other.stderr and "resume: false" in other.stderr
    fresh = run(args(data_dir, out, "--epochs", "4", "--max-steps", "3", "--seed", "1", "--no-resume", "--check"))
    assert fresh.returncode == 0 and json.loads(fresh.stdout)["resume_step"] is None


def test_torchrun_workers_get_the_launchers_settings_flags_included():
    import argparse

    from eagle3_pipeline.train.command import _worker_argv, configure_parser

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    argv = ["--data-dir", "d", "--output-dir", "o", "--variant", "eagle3.1", "--norm-before-fc", "--no-charts",
            "--nproc-per-node", "2"]
    worker = _worker_argv(parser.parse_args(argv), parser._actions)  # noqa: SLF001
    assert worker[worker.index("--variant") + 1] == "eagle3.1"
    assert worker.count("--norm-before-fc") == 1 and worker.count("--no-charts") == 1
    assert "--nproc-per-node" not in worker and "True" not in worker and "False" not in worker
    assert parser.parse_args(worker).norm_before_fc is True  # a worker parses back to the same settings
    plain = _worker_argv(parser.parse_args(argv[:4]), parser._actions)  # noqa: SLF001
    assert "--norm-before-fc" not in plain and "--no-charts" not in plain
