"""``eagle3-pipeline train``: train the EAGLE-3 drafter, in this process or under torchrun.

One process (the default, and the CPU): the training runs here. ``--nproc-per-node N`` or
``--nnodes M``: this command starts torchrun (``python -m torch.distributed.run``) with the
rendezvous settings and the same training options, one process per GPU; every process runs
``train`` under DDP (or FSDP with ``--parallel fsdp``). On several nodes, run the command on
each with the same options, ``--node-rank`` 0..M-1 and the first node's address as
``--master-addr`` (the eagle_training role does that from the inventory).

Stopping: SIGTERM or SIGINT makes every process finish its step, write a checkpoint and exit 4;
the same command continues from there. Under torchrun the launcher turns the signal into a stop
file (``<out>/STOP``) that the workers read between steps, so that torchrun's own shutdown
timer never kills a checkpoint half-written.

Exit codes: 0 trained and exported (or already done for these data and settings), 1 crash,
2 bad input or settings (the message names it), 4 stopped on request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

from eagle3_pipeline.cli_args import options_argv, path_str, positive_int
from eagle3_pipeline.train.recipe import (
    DEFAULT_HEAD_INIT,
    DEFAULT_STEP_DECAY,
    DEFAULT_TEACHER_TEMPERATURE,
    HEAD_INITS,
)
from eagle3_pipeline.train.variants import DEFAULT_VARIANT, VARIANTS

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 4
STOP_FILE = "STOP"
STOP_FILE_ENV = "EAGLE3_TRAIN_STOP_FILE"  # the workers stop when this file exists
# Options of the launcher only; everything else is passed to every worker unchanged.
LAUNCH_OPTIONS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The command's options; each is the role's ``eagle_training_<name>`` variable."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    add = parser.add_argument
    add("--data-dir", type=path_str, required=True, help="the extraction's output (data_config.json)")
    add("--output-dir", type=path_str, required=True, help="checkpoints, metrics, charts and the exported drafter")
    add("--drafter-dir", type=path_str,
        help="where the SGLang export goes (default: OUTPUT_DIR/drafter); the speculators "
        "form goes beside it (<name>-speculators)")
    add("--target-model-path", type=path_str,
        help="the target model directory (default: the one named in data_config.json)")
    add("--draft-vocab-size", type=positive_int, help="draft vocabulary (default: min(32000, target vocab))")
    add("--ttt-length", type=positive_int, default=7, help="training-time-test steps")
    add("--variant", choices=tuple(VARIANTS), default=DEFAULT_VARIANT,
        help="the drafter: eagle3, or eagle3.1 (an RMSNorm per aux state before fc, and the next draft step reading "
        "the normed state; SGLang's fc_norm and norm_output)")
    add("--norm-before-fc", action="store_true", help="one RMSNorm over the concatenated aux states before fc")
    add("--head-init", choices=HEAD_INITS, default=DEFAULT_HEAD_INIT,
        help="how the drafter's lm_head and final norm start: the target's own (its lm_head rows of the draft "
        "vocabulary and its final norm; a drafter as wide as its target), or random")
    add("--layout", choices=("auto", "llama", "mla"), default="auto",
        help="the drafter's attention: auto (multi-latent attention for an MLA target such as Kimi-K2.x or "
        "DeepSeek-V3, served as SGLang's Eagle3DeepseekV2ForCausalLM; else Llama's), llama or mla")
    add("--epochs", type=positive_int, default=1)
    add("--max-steps", type=positive_int, help="stop after this many optimizer steps (the schedule is unchanged)")
    add("--lr", type=float, default=1e-4, help="peak learning rate")
    add("--warmup-steps", type=int, default=0)
    add("--teacher-temperature", type=float, default=DEFAULT_TEACHER_TEMPERATURE,
        help="the target's logits are divided by this before their softmax makes the soft targets; below 1 they "
        "lean toward the target's top-1, the token a greedy verify accepts")
    add("--step-decay", type=float, default=DEFAULT_STEP_DECAY,
        help="the loss weighs the k-th training-time-test step by this to the power k (EAGLE-3's 0.8); lower puts "
        "the weight on the first drafts, which every accepted chain needs")
    add("--weight-decay", type=float, default=0.0)
    add("--grad-clip", type=float, default=0.5, help="gradient norm clip (0: none)")
    add("--batch-tokens", type=positive_int, help="tokens per packed batch per process (default: by the drafter's "
        "width: 2048 at 4096 and wider, 8192 at 2048, 32768 at 1024 and narrower, where small steps waste the GPU)")
    add("--global-batch-tokens", type=positive_int,
        help="tokens per optimizer step over all processes, a multiple of --batch-tokens x processes: each process "
        "accumulates that many of its batches per step, so the steps are the same on any number of GPUs (default: "
        "one batch per process per step)")
    add("--max-train-samples", type=positive_int,
        help="train on the first N samples of the training split only (dataset order): what a smaller extraction "
        "would give; the held-out split is unchanged and the draft vocabulary is counted over those N (default: all)")
    add("--eval-ratio", type=float, default=0.0, help="share of samples held out for evaluation")
    add("--eval-opening-tokens", type=int, default=128,
        help="also score the held-out split over the tokens serving a first answer of this many tokens drafts "
        "(answer tokens 2..N of each sample's first assistant turn): what the evaluation at max_new_tokens N "
        "should measure (0: not computed)")
    add("--seed", type=int, default=0)
    add("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
        help="auto: bfloat16 (fp32 master weights) on a GPU, float32 on the CPU")
    add("--parallel", default="ddp", choices=("ddp", "fsdp"), help="how several processes share the drafter")
    for name in ("hidden-size", "num-attention-heads", "num-key-value-heads", "intermediate-size"):
        add(f"--{name}", type=positive_int, help="drafter shape override (default: the target's)")
    add("--no-resume", dest="resume", action="store_false", help="discard the output dir's checkpoints, start over")
    add("--no-tensorboard", dest="tensorboard", action="store_false", help="no TensorBoard event files")
    add("--no-charts", dest="charts", action="store_false", help="no PNG charts")
    add("--check", action="store_true",
        help="check the data, the target and the settings, print a JSON status line, train nothing")
    launch = parser.add_argument_group("processes (torchrun)")
    launch.add_argument("--nproc-per-node", type=positive_int, default=1, help="processes (GPUs) on this node")
    launch.add_argument("--nnodes", type=positive_int, default=1, help="nodes in the job")
    launch.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 on the first")
    launch.add_argument("--master-addr", default="127.0.0.1", help="the first node's address (rendezvous)")
    launch.add_argument("--master-port", type=int, default=29500, help="rendezvous port on the first node")


def train_config(args: argparse.Namespace):
    """The ``TrainConfig`` of parsed arguments."""
    from eagle3_pipeline.train.trainer import TrainConfig  # noqa: PLC0415

    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})


def _say(message: str) -> None:
    print(f"eagle3 train: {message}", file=sys.stderr, flush=True)


def _worker_argv(args: argparse.Namespace, parser_actions: list[argparse.Action]) -> list[str]:
    """The command line every torchrun worker gets: this one without the launcher's options."""
    return options_argv(args, parser_actions, (*LAUNCH_OPTIONS, "check"))


def _note_exit(out_dir: Path, state: str, message: str, code: int) -> None:
    """Record how the run ended in progress.json (merged into what the trainer wrote)."""
    from eagle3_pipeline.atomic import atomic_write_text  # noqa: PLC0415

    path = out_dir / "progress.json"
    try:
        document = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        document = {}
    if document.get("state") in ("done", "stopped") and state == "failed":
        return
    document.update(state=state, message=message, exit_code=code, pid=os.getpid(), updated=time.time())
    with contextlib.suppress(OSError):
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(document) + "\n")


def _set_parent_death_signal() -> None:
    """Linux: torchrun gets SIGTERM if this launcher dies (it runs in its own session)."""
    with contextlib.suppress(Exception):
        import ctypes  # noqa: PLC0415

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def launch(args: argparse.Namespace, worker_argv: list[str]) -> int:
    """Run torchrun with one worker per process; map its end to this command's exit codes."""
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stop_file = out_dir / STOP_FILE
    stop_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}",
               f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
               f"--master-port={args.master_port}", "-m", "eagle3_pipeline.cli", "train", *worker_argv]
    _say(f"starting {args.nproc_per_node} process(es) on node {args.node_rank} of {args.nnodes} "
         f"(rendezvous {args.master_addr}:{args.master_port})")
    env = {**os.environ, STOP_FILE_ENV: str(stop_file.resolve()), "OMP_NUM_THREADS":
           os.environ.get("OMP_NUM_THREADS", "1")}
    stopped = {"signal": None}

    def request(signum, _frame):
        stopped["signal"] = signum
        stop_file.touch()
        _say(f"{signal.Signals(signum).name}: asking the workers to checkpoint and stop")

    previous = {s: signal.signal(s, request) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        child = subprocess.Popen(command, env=env, start_new_session=True,
                                 preexec_fn=_set_parent_death_signal)  # noqa: PLW1509 - prctl only
        while True:
            try:
                rc = child.wait()
                break
            except InterruptedError:
                continue
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_file.unlink(missing_ok=True)
    progress = {}
    with contextlib.suppress(OSError, ValueError):
        progress = json.loads((out_dir / "progress.json").read_text())
    if progress.get("state") == "stopped" or (stopped["signal"] and rc != 0):
        return EXIT_STOPPED
    if rc == 0:
        return EXIT_OK
    return int(progress.get("exit_code") or EXIT_CRASH) if progress.get("state") == "failed" else EXIT_CRASH


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _print_summary(summary: dict) -> None:
    if summary.get("already_complete"):
        _say(f"already done: {summary.get('drafter_dir')} was exported for these data and settings")
        return
    last, evaluation = summary.get("last") or {}, summary.get("eval") or {}
    seen = evaluation or last
    acc = "/".join(f"{a:.2f}" for a in seen.get("acc_k", []))
    _say(f"{summary['steps']} steps; {'held-out, whole conversations' if evaluation else 'last batch'}: acc per "
         f"position {acc}, simulated acceptance length {seen.get('acceptance_length', 0.0):.2f}")
    opening = evaluation.get("opening") or {}
    rounds = opening.get("rounds") or {}
    if rounds:
        # What serving should measure: the whole-conversation figures above read higher (a training curve).
        taus = ", ".join(f"{rounds[chain]['tau']:.2f} at {chain}" for chain in sorted(rounds, key=int))
        _say(f"held-out first answers of {opening.get('tokens')} tokens walked round by round as serving drafts "
             f"them: tau {taus} drafts per verify (what the evaluation should measure)")
    _say(f"drafter (SGLang): {summary['drafter_dir']}")
    if summary.get("speculators_dir"):
        _say(f"drafter (speculators / vLLM): {summary['speculators_dir']}")
    for chart in summary.get("charts", []):
        _say(f"chart: {chart}")


def run(args: argparse.Namespace) -> int:
    """The command: check, launch torchrun, or train in this process."""
    if not _under_torchrun() and (args.nproc_per_node > 1 or args.nnodes > 1) and not args.check:
        parser = argparse.ArgumentParser()
        configure_parser(parser)
        return launch(args, _worker_argv(args, parser._actions))  # noqa: SLF001
    return _run_here(args)


def _run_here(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from eagle3_pipeline.train import trainer  # noqa: PLC0415
    from eagle3_pipeline.train.data import DataError  # noqa: PLC0415
    from eagle3_pipeline.train.export import ExportError  # noqa: PLC0415
    from eagle3_pipeline.train.model import DrafterConfigError  # noqa: PLC0415
    from eagle3_pipeline.train.step import leave_process_group  # noqa: PLC0415
    from eagle3_pipeline.train.vocab import VocabError  # noqa: PLC0415

    bad_input = (DataError, trainer.TrainConfigError, VocabError, DrafterConfigError, ExportError, FileNotFoundError)
    out_dir = Path(args.output_dir)
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = train_config(args)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            device = trainer.resolve_device(cfg.device)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if args.check:
            world = None if _under_torchrun() else args.nnodes * args.nproc_per_node
            print(json.dumps(trainer.make_plan(cfg, world).status()), flush=True)
            return EXIT_OK
        summary = trainer.train(cfg)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # rank 0 has exported: the processes leave the group together
    except trainer.StopRequested as exc:
        _say(str(exc))
        return EXIT_STOPPED
    except bad_input as exc:
        _say(f"error: {exc}")
        if rank == 0 and not args.check:
            _note_exit(out_dir, "failed", str(exc), EXIT_BAD_INPUT)
        return EXIT_BAD_INPUT
    except Exception as exc:
        if rank == 0 and not args.check:
            _note_exit(out_dir, "failed", f"{type(exc).__name__}: {exc}", EXIT_CRASH)
        raise
    finally:
        leave_process_group()
    if rank == 0:
        _print_summary(summary)
    return EXIT_OK
