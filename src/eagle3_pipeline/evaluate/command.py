"""``eagle3-pipeline evaluate``: measure the trained drafter by real speculative decoding on held-out prompts.

Engines:

- ``reference`` (default): the target on transformers in this process (``ModelRunner`` of the
  reference engine, CPU or one GPU), greedy chain speculative decoding with the drafter
  (``speculative.py``), and the target's own greedy decode of every prompt to check that the
  output is the same token for token (``--no-check-outputs`` skips that, and the tokens/s
  without drafting with it);
- ``sglang``: an SGLang server already serving the drafter (``--server-url``; the evaluation
  role starts one with ``--print-sglang-argv``'s command), measured from ``/generate``'s
  meta_info (``sglang_client.py``).

Before anything is decoded the prompts are checked against the training data (``heldout.py``):
an overlap refuses the run (exit 2) naming the ids. ``<output-dir>/evaluation.json`` is written
atomically; a run whose drafter (SHA-256 of model.safetensors), prompts and settings match an
existing one changes nothing (``--force`` measures again). ``--check`` prints a JSON status line
and measures nothing.

Exit codes: 0 measured (or already measured), 1 crash, 2 bad input or settings (the message says which).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from eagle3_pipeline.checksum import file_sha256
from eagle3_pipeline.train.command import _positive_int  # the same option type as train's

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT = 0, 1, 2
RESULT_FILE = "evaluation.json"
RESULT_FORMAT = "eagle3-pipeline/evaluation"
ENGINES = ("reference", "sglang")
# SGLang's default chain for EAGLE3 drafters (3 steps, topk 1, 4 verified tokens), see
# serve/sglang_command.py DEFAULT_SPECULATIVE_STEPS: measure what is served by default.
DEFAULT_DRAFT_TOKENS = 3


class BadInput(ValueError):
    """Settings or files that make the evaluation impossible; the message names them and the fix."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The command's options; each is the evaluation role's ``evaluation_<name>`` variable."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    add = parser.add_argument
    add("--drafter-dir", required=True, help="the exported drafter (config.json + model.safetensors)")
    add("--prompts", required=True, help="held-out conversations (ShareGPT or OpenAI JSONL); the prompt of each is "
        "everything before its first assistant turn")
    add("--output-dir", required=True, help="where evaluation.json goes")
    add("--training-dir", help="the training's output (training.json: the simulated acceptance length); default: "
        "the drafter's parent when it holds training.json")
    add("--data-dir", help="the extraction the drafter was trained on (the overlap check, the aux layers, the chat "
        "template); default: the one training.json names")
    add("--target-model-path", help="the target model directory (default: the one the drafter's config names, "
        "else data_config.json's)")
    add("--num-prompts", type=_positive_int, default=32, help="prompts measured (the first usable ones of the file)")
    add("--max-new-tokens", type=_positive_int, default=128, help="tokens generated per prompt")
    add("--draft-tokens", type=_positive_int, default=DEFAULT_DRAFT_TOKENS,
        help="drafts per verify forward (the chain length k; SGLang's --speculative-num-steps)")
    add("--ignore-eos", action="store_true", help="generate max-new-tokens tokens whatever the target says")
    add("--engine", choices=ENGINES, default="reference")
    add("--device", default="auto", help="reference engine: auto, cpu, cuda or cuda:N")
    add("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
        help="reference engine: the target's dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    add("--no-check-outputs", dest="check_outputs", action="store_false",
        help="reference engine: skip the target's plain greedy decode (the equality check and the tokens/s "
        "without drafting)")
    add("--server-url", help="sglang engine: the server serving the drafter, e.g. http://127.0.0.1:30100")
    add("--api-key-file", help="sglang engine: a file holding the server's API key (never on the command line)")
    add("--force", action="store_true", help="measure again even when evaluation.json matches these settings")
    add("--check", action="store_true", help="check the inputs, print a JSON status line, measure nothing")
    sg = parser.add_argument_group("the SGLang launch command (--print-sglang-argv)")
    sg.add_argument("--print-sglang-argv", action="store_true",
                    help="print SGLang's launch argv for serving the drafter (JSON) and exit")
    sg.add_argument("--sglang-python", default="python3", help="the Python of the SGLang venv")
    sg.add_argument("--port", type=int, default=30100)
    sg.add_argument("--tp-size", type=_positive_int, default=1)
    sg.add_argument("--extra-args-json", default="[]", help="more SGLang arguments, a JSON list of argv tokens")
    sg.add_argument("--api-key-config", help="SGLang --config YAML holding the API key")


def _say(message: str) -> None:
    print(f"eagle3 evaluate: {message}", file=sys.stderr, flush=True)


def _read_json(path: Path, what: str) -> dict:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: missing ({what})") from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path}: unreadable {what}: {exc}") from None
    if not isinstance(document, dict):
        raise BadInput(f"{path}: not a JSON object ({what})")
    return document


def resolve(args: argparse.Namespace) -> dict:
    """Every path and setting of the run, defaults filled in, files checked to exist; the fingerprint's inputs."""
    drafter_dir = Path(args.drafter_dir).resolve()
    weights = drafter_dir / "model.safetensors"
    config = _read_json(drafter_dir / "config.json", "the drafter's config; export the drafter with "
                        "`eagle3-pipeline train`")
    if not weights.is_file():
        raise BadInput(f"{weights}: missing; the drafter export is incomplete (train again to export it)")
    training_dir = Path(args.training_dir).resolve() if args.training_dir else None
    if training_dir is None and (drafter_dir.parent / "training.json").is_file():
        training_dir = drafter_dir.parent
    training = _read_json(training_dir / "training.json", "the training's summary") if training_dir else {}
    data_dir = args.data_dir or (training.get("config") or {}).get("data_dir")
    if not data_dir:
        raise BadInput("no --data-dir, and no training.json naming one: the held-out prompts must be checked "
                       "against the training data; give --data-dir (the extraction output) or --training-dir")
    ours = config.get("eagle3_pipeline") or {}
    target = args.target_model_path or (training.get("config") or {}).get("target_model_path") or \
        ours.get("target_model_path")
    prompts = Path(args.prompts).resolve()
    if not prompts.is_file():
        raise BadInput(f"--prompts {prompts}: no such file (held-out conversations, JSONL)")
    if args.engine == "sglang" and not args.server_url and not args.check:
        raise BadInput("--engine sglang needs --server-url (the SGLang server serving the drafter)")
    return {
        "drafter_dir": str(drafter_dir), "drafter_sha256": file_sha256(weights), "drafter_config": config,
        "training_dir": str(training_dir) if training_dir else None, "training": training,
        "data_dir": str(Path(data_dir).resolve()), "target_model_path": str(Path(target).resolve()) if target else None,
        "prompts": str(prompts), "prompts_sha256": file_sha256(prompts),
    }  # fmt: skip


def fingerprint(args: argparse.Namespace, inputs: dict) -> str:
    """What makes two evaluations the same: the drafter's weights, the prompts and every setting."""
    settings = {
        "drafter_sha256": inputs["drafter_sha256"], "prompts_sha256": inputs["prompts_sha256"],
        "data_dir": inputs["data_dir"], "target_model_path": inputs["target_model_path"],
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "draft_tokens": args.draft_tokens,
        "ignore_eos": args.ignore_eos, "engine": args.engine,
        "device": args.device if args.engine == "reference" else None,
        "dtype": args.dtype if args.engine == "reference" else None,
        "check_outputs": args.check_outputs if args.engine == "reference" else None,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def previous_result(output_dir: Path, wanted: str) -> dict | None:
    """The existing evaluation.json when it was measured with the same fingerprint."""
    path = output_dir / RESULT_FILE
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) and document.get("fingerprint") == wanted else None


def simulated_acceptance(training: dict) -> tuple[float | None, str | None]:
    """(training's simulated acceptance length, where it comes from): its held-out eval, else its last batch."""
    for key, where in (("eval", "training's held-out eval split"), ("last", "training's last batch")):
        value = (training.get(key) or {}).get("acceptance_length")
        if isinstance(value, (int, float)):
            return float(value), where
    return None, None


def _prepare(inputs: dict):
    """Open the data, check aux layers and chat template, load the renderer: (data, renderer, aux layers)."""
    from eagle3_pipeline.evaluate.speculative import drafter_aux_layers  # noqa: PLC0415
    from eagle3_pipeline.extract.template import load_renderer  # noqa: PLC0415
    from eagle3_pipeline.train.data import open_dataset  # noqa: PLC0415

    data = open_dataset(inputs["data_dir"])
    aux = drafter_aux_layers(inputs["drafter_config"])
    if [int(a) for a in data.manifest["aux_layers"]] != aux:
        raise BadInput(f"the drafter's aux layers {aux} differ from the data's {data.manifest['aux_layers']} "
                       f"({inputs['data_dir']}): it was not trained on this extraction")
    if inputs["target_model_path"] is None:
        inputs["target_model_path"] = str(Path(data.manifest["target_model_path"]).resolve())
    target = Path(inputs["target_model_path"])
    if not (target / "config.json").is_file():
        raise BadInput(f"target model {target}: no config.json (give --target-model-path, a local model directory)")
    template_file = data.manifest.get("chat_template_file")
    renderer = load_renderer(target, template_file)
    recorded = data.manifest.get("chat_template_sha256")
    if recorded and renderer.template_hash != recorded:
        raise BadInput(f"the chat template of {target} (sha256 {renderer.template_hash[:12]}) is not the one the data "
                       f"was extracted with ({recorded[:12]}): the prompts would not be rendered as in training")
    return data, renderer, aux


def run_reference(args, prompts, aux_layers: list[int], target_path: str) -> dict:
    """Speculative decoding of every prompt on the reference engine, checked against plain greedy decoding."""
    from eagle3_pipeline.evaluate.speculative import (  # noqa: PLC0415
        AcceptanceStats,
        EagleProposer,
        TargetModel,
        load_drafter,
        speculative_generate,
    )

    started = time.perf_counter()
    target = TargetModel.load(target_path, aux_layers, device=args.device, dtype=args.dtype)
    drafter, _ = load_drafter(args.drafter_dir, target.input_embeddings(), device=target.device)
    proposer = EagleProposer(drafter)
    _say(f"target {target_path} and drafter loaded on {target.device} in {time.perf_counter() - started:.1f} s")
    stats = AcceptanceStats(args.draft_tokens)
    spec_s = plain_s = 0.0
    plain_tokens = 0
    mismatches = []
    for index, prompt in enumerate(prompts, 1):
        result = speculative_generate(target, proposer, list(prompt.input_ids), args.max_new_tokens,
                                      args.draft_tokens, args.ignore_eos)
        stats.add(result)
        spec_s += result.wall_s
        note = ""
        if args.check_outputs:
            began = time.perf_counter()
            plain = target.greedy(list(prompt.input_ids), args.max_new_tokens, args.ignore_eos)
            plain_s += time.perf_counter() - began
            plain_tokens += len(plain)
            if plain != result.output_ids:
                at = next((i for i, (a, b) in enumerate(zip(plain, result.output_ids)) if a != b),
                          min(len(plain), len(result.output_ids)))
                mismatches.append({"id": prompt.sample_id, "first_difference": at})
                note = f"; OUTPUT DIFFERS from the target's greedy decode at token {at}"
        _say(f"prompt {index}/{len(prompts)} ({prompt.sample_id}): {len(result.output_ids)} tokens in "
             f"{len(result.rounds)} verify forwards; tau so far {stats.tau:.2f}{note}")
    return {
        "stats": stats, "outputs_match_target": (not mismatches) if args.check_outputs else None,
        "mismatches": mismatches, "device": str(target.device), "decode_s": spec_s,
        "tokens_per_s": stats.completion_tokens / spec_s if spec_s else None,
        "tokens_per_s_without_drafting": plain_tokens / plain_s if plain_s else None,
    }


def run_sglang(args, prompts) -> dict:
    """The prompts through a running SGLang server that serves the drafter."""
    from eagle3_pipeline.evaluate.sglang_client import measure_sglang  # noqa: PLC0415

    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None

    def progress(done: int, stats) -> None:
        _say(f"prompt {done}/{len(prompts)}: tau so far {stats.tau:.2f}")

    stats, _outputs, wall = measure_sglang(args.server_url, prompts, args.max_new_tokens, args.draft_tokens,
                                           api_key=api_key, progress=progress)
    return {"stats": stats, "outputs_match_target": None, "mismatches": [], "device": None, "decode_s": wall,
            "tokens_per_s": stats.completion_tokens / wall if wall else None, "tokens_per_s_without_drafting": None}


def print_sglang_argv(args: argparse.Namespace) -> int:
    """The SGLang launch command serving the drafter with these settings, as one JSON line."""
    from eagle3_pipeline.serve.sglang_command import speculative_launch_argv  # noqa: PLC0415

    drafter_dir = Path(args.drafter_dir).resolve()
    config = _read_json(drafter_dir / "config.json", "the drafter's config")
    target = args.target_model_path or (config.get("eagle3_pipeline") or {}).get("target_model_path")
    if not target:
        raise BadInput("no --target-model-path and the drafter's config names no target")
    try:
        extra = json.loads(args.extra_args_json)
    except ValueError as exc:
        raise BadInput(f"--extra-args-json: not JSON ({exc})") from None
    try:
        argv = speculative_launch_argv(args.sglang_python, target, str(drafter_dir), args.port, args.tp_size,
                                       args.draft_tokens, extra, args.api_key_config)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    print(json.dumps({"argv": argv, "url": f"http://127.0.0.1:{args.port}"}), flush=True)
    return EXIT_OK


def _summary_line(document: dict) -> str:
    simulated = document.get("simulated_tau")
    sim = f"{simulated:.2f}" if simulated is not None else "n/a"
    positions = "/".join(f"{value:.2f}" for value in document["accepted_per_position"])
    return (f"acceptance length (measured): tau {document['tau']:.2f} (simulated by training: {sim}), "
            f"per position {positions}")


def run(args: argparse.Namespace) -> int:
    """The command."""
    try:
        if args.print_sglang_argv:
            return print_sglang_argv(args)
        return _run(args)
    except BadInput as exc:
        _say(f"error: {exc}")
        return EXIT_BAD_INPUT


def _run(args: argparse.Namespace) -> int:
    from eagle3_pipeline.atomic import atomic_write_text  # noqa: PLC0415
    from eagle3_pipeline.evaluate.heldout import HeldoutError, check_no_overlap, load_heldout_prompts  # noqa: PLC0415
    from eagle3_pipeline.evaluate.speculative import EvaluationError  # noqa: PLC0415
    from eagle3_pipeline.extract.client import EngineError, ServerUnreachable  # noqa: PLC0415
    from eagle3_pipeline.train.data import DataError  # noqa: PLC0415
    from eagle3_pipeline.train.export import ExportError  # noqa: PLC0415

    output_dir = Path(args.output_dir).resolve()
    try:
        inputs = resolve(args)
        wanted = fingerprint(args, inputs)
        done = None if args.force else previous_result(output_dir, wanted)
        if args.check:
            print(json.dumps({"complete": done is not None, "fingerprint": wanted,
                              "result": str(output_dir / RESULT_FILE)}), flush=True)
            return EXIT_OK
        if done is not None:
            _say(f"already measured: {output_dir / RESULT_FILE} is for this drafter, these prompts and settings")
            _say(_summary_line(done))
            return EXIT_OK
        data, renderer, aux_layers = _prepare(inputs)
        prompts, skipped = load_heldout_prompts(inputs["prompts"], renderer, args.num_prompts)
        for line in skipped:
            _say(f"prompt left out: {line}")
        overlap = check_no_overlap(prompts, data)
        _say(f"{len(prompts)} held-out prompts, none among the {overlap['training_samples']} training samples")
        started = time.time()
        if args.engine == "reference":
            measured = run_reference(args, prompts, aux_layers, inputs["target_model_path"])
        else:
            measured = run_sglang(args, prompts)
    except (BadInput, HeldoutError, DataError, ExportError, EvaluationError, ValueError) as exc:
        _say(f"error: {exc}")
        return EXIT_BAD_INPUT
    except (ServerUnreachable, EngineError) as exc:
        _say(f"error: the SGLang server: {exc}")
        return EXIT_CRASH
    stats = measured["stats"]
    simulated, simulated_from = simulated_acceptance(inputs["training"])
    document = {
        "format": RESULT_FORMAT, "fingerprint": wanted, "engine": args.engine,
        **stats.as_dict(),
        "draft_tokens": args.draft_tokens, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "ignore_eos": args.ignore_eos,
        "outputs_match_target": measured["outputs_match_target"], "output_mismatches": measured["mismatches"],
        "simulated_acceptance_length": simulated, "simulated_from": simulated_from,
        "simulated_tau": 1 + simulated if simulated is not None else None,
        "note": ("tau = tokens produced by verify forwards / verify forwards = 1 + mean drafts accepted per round "
                 "(the prefill and its first token counted in neither); the training's simulated acceptance length "
                 "sum_k prod_{i<=k} cond_acc_i counts accepted drafts only, so compare tau with 1 + simulated. "
                 "sglang_accept_length is SGLang's completion_tokens / spec_verify_ct (the prefill's token counted)."),
        "wall_s": time.time() - started, "decode_s": measured["decode_s"], "tokens_per_s": measured["tokens_per_s"],
        "tokens_per_s_without_drafting": measured["tokens_per_s_without_drafting"],
        "device": measured["device"], "server_url": args.server_url if args.engine == "sglang" else None,
        "drafter_dir": inputs["drafter_dir"], "drafter_sha256": inputs["drafter_sha256"],
        "target_model_path": inputs["target_model_path"], "data_dir": inputs["data_dir"],
        "training_dir": inputs["training_dir"], "prompts_file": inputs["prompts"],
        "prompts_sha256": inputs["prompts_sha256"], "prompt_ids": [p.sample_id for p in prompts],
        "overlap_check": overlap, "finished": time.time(),
    }  # fmt: skip
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output_dir / RESULT_FILE, json.dumps(document, indent=1) + "\n")
    if document["outputs_match_target"] is False:
        _say(f"warning: {len(measured['mismatches'])} output(s) differ from the target's own greedy decode: "
             f"{measured['mismatches'][:5]} (numerical ties between a one-token and a multi-token forward?)")
    speed = document["tokens_per_s"]
    plain = document["tokens_per_s_without_drafting"]
    _say(f"{stats.completion_tokens} tokens, {stats.rounds} verify forwards; "
         f"{speed or 0:.1f} tokens/s with drafting" + (f", {plain:.1f} without" if plain else ""))
    _say(_summary_line(document))
    _say(f"written: {output_dir / RESULT_FILE}")
    return EXIT_OK
