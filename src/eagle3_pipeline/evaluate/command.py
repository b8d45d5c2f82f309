"""``eagle3-pipeline evaluate``: measure the trained drafter by real speculative decoding on held-out prompts.

Engines:

- ``reference`` (default): the target on transformers in this process (``ModelRunner`` of the
  reference engine, CPU or one GPU), greedy chain speculative decoding with the drafter
  (``speculative.py``), batched as a serving engine batches requests, at every chain length of
  ``--draft-tokens`` (default 3 and 7: SpecForge's published "3-1-4" and "7-1-8") on the same prompts;
  then the target's own greedy decode of every prompt by FULL forwards (no KV cache: an oracle that
  shares nothing with the path it checks) to check that the outputs are the same token for token
  (``--no-check-outputs`` skips it);
- ``sglang``: an SGLang server already serving the drafter (``--server-url``; the evaluation
  role starts one with ``--print-sglang-argv``'s command), measured from ``/generate``'s
  meta_info (``sglang_client.py``), at the one chain length the server was started with.

Before anything is decoded the prompts are checked against the training data (``heldout.py``):
a prompt the drafter saw is excluded and listed (id, line, reason), and the next one is taken; the
run refuses (exit 2) only when fewer than ``--min-prompts`` remain.

Then the verdict (``verdict.py``): the measured acceptance per draft position against what the
training's held-out split predicts, and the output check. A measurement far below the prediction,
or outputs that differ from the target's own decode other than by numerical near-ties, FAIL the run
(exit 3) after evaluation.json is written with the verdict and its likely causes (the report shows
it). ``<output-dir>/evaluation.json`` is written atomically; a run whose drafter (SHA-256 of
model.safetensors), prompts and settings match an existing one changes nothing and gives the same
verdict again (``--force`` measures again). ``--check`` prints a JSON status line and measures nothing.

Exit codes: 0 measured (or already measured) and passed, 1 crash, 2 bad input or settings (the message
says which), 3 measured and failed its verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

from eagle3_pipeline.checksum import file_sha256
from eagle3_pipeline.cli_args import dataset_arg, path_str, positive_int
from eagle3_pipeline.evaluate.verdict import DEFAULT_MIN_RATIO, prediction_record

DEFAULT_BATCH_TOKENS = 131072
SHOWN_EXCLUSIONS = 20  # log lines; evaluation.json lists every excluded prompt

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT, EXIT_VERDICT_FAILED = 0, 1, 2, 3
RESULT_FILE = "evaluation.json"
RESULT_FORMAT = "eagle3-pipeline/evaluation"
# Which prompts the held-out selection takes (``heldout.select_heldout_prompts``); raised when that rule changes,
# so that a result measured on prompts the rule now refuses is measured again. 2: prompts whose decode passes
# the training's max_length are excluded.
HELDOUT_RULE = 2
# What the verdict weighs; raised when that changes, so that a result judged without it is measured again.
# 2: the replay from full forwards (``speculative.replay_chains``) beside every measured chain; 3: the prediction
# from the held-out split scored over what serving first answers of max_new_tokens drafts (``eval.opening``);
# 4: that prediction walked round by round as serving goes (``eval.opening.rounds``), not per token.
VERDICT_RULE = 4
ENGINES = ("reference", "sglang")
# SGLang's default chain for EAGLE3 drafters (3 steps, topk 1, 4 verified tokens, see
# serve/sglang_command.py DEFAULT_SPECULATIVE_STEPS) and the longer chain peers publish (SpecForge's
# "7-1-8"); the first is the headline figure.
DEFAULT_DRAFT_TOKENS = (3, 7)


def _chain_lengths(text: str) -> list[int]:
    """``--draft-tokens``: one or more chain lengths, comma-separated, each >= 1, no repeats."""
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers, e.g. 3,7") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: one or more distinct chain lengths >= 1, e.g. 3,7")
    return values


class BadInput(ValueError):
    """Settings or files that make the evaluation impossible; the message names them and the fix."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The command's options; each is the evaluation role's ``evaluation_<name>`` variable."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    add = parser.add_argument
    add("--drafter-dir", type=path_str, required=True, help="the exported drafter (config.json + model.safetensors)")
    add("--prompts", type=dataset_arg,
        required=True, help="held-out conversations (ShareGPT or OpenAI: JSON Lines, a JSON array, Parquet, Arrow, "
        "or a folder of them; or a mixture, as a JSON list of {path, name, count}); the prompt of each is "
        "everything before its first assistant turn")
    add("--output-dir", type=path_str, required=True, help="where evaluation.json goes")
    add("--training-dir", type=path_str,
        help="the training's output (training.json: the simulated acceptance length); default: "
        "the drafter's parent when it holds training.json")
    add("--data-dir", type=path_str,
        help="the extraction the drafter was trained on (the overlap check, the aux layers, the chat "
        "template); default: the one training.json names")
    add("--target-model-path", type=path_str,
        help="the target model directory (default: the one the drafter's config names, "
        "else data_config.json's)")
    add("--num-prompts", type=positive_int, default=32, help="prompts measured (the first usable ones of the file, "
        "those seen in training excluded)")
    add("--min-prompts", type=positive_int, help="fail when fewer usable prompts remain (default: half of "
        "--num-prompts, rounded up)")
    add("--max-new-tokens", type=positive_int, default=128, help="tokens generated per prompt")
    add("--draft-tokens", type=_chain_lengths, default=list(DEFAULT_DRAFT_TOKENS),
        help="drafts per verify forward, the chain length k (SGLang's --speculative-num-steps); several, "
        "comma-separated, are measured on the same prompts (the sglang engine measures one)")
    add("--min-acceptance-ratio", type=float, default=DEFAULT_MIN_RATIO,
        help="fail when the measured acceptance at a draft position is, with 99%% confidence, below this share of "
        "what the training's held-out split predicts (0 turns the check off)")
    add("--batch-tokens", type=positive_int, default=DEFAULT_BATCH_TOKENS,
        help="reference engine: KV-cache slots per batch of requests decoded together (bounds memory)")
    add("--ignore-eos", action="store_true", help="generate max-new-tokens tokens whatever the target says")
    add("--engine", choices=ENGINES, default="reference")
    add("--device", default="auto", help="reference engine: auto, cpu, cuda or cuda:N")
    add("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
        help="reference engine: the target's dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    add("--decode", choices=("slots", "transformers"), default="slots",
        help="reference engine: read the target over the engine's slot cache (flash attention per request, no "
        "padding; used when the model passes the engine's start-up check) or over transformers' own cache")
    add("--no-check-outputs", dest="check_outputs", action="store_false",
        help="reference engine: skip the target's greedy decode by full forwards (the check that the outputs are "
        "the target's own)")
    add("--server-url", help="sglang engine: the server serving the drafter, e.g. http://127.0.0.1:30100")
    add("--api-key-file", type=path_str,
        help="sglang engine: a file holding the server's API key (never on the command line)")
    add("--force", action="store_true", help="measure again even when evaluation.json matches these settings")
    add("--check", action="store_true", help="check the inputs, print a JSON status line, measure nothing")
    sg = parser.add_argument_group("the SGLang launch command (--print-sglang-argv)")
    sg.add_argument("--print-sglang-argv", action="store_true",
                    help="print SGLang's launch argv for serving the drafter (JSON) and exit")
    sg.add_argument("--sglang-python", type=path_str, default="python3", help="the Python of the SGLang venv")
    sg.add_argument("--port", type=int, default=30100)
    sg.add_argument("--tp-size", type=positive_int, default=1)
    sg.add_argument("--extra-args-json", default="[]", help="more SGLang arguments, a JSON list of argv tokens")
    sg.add_argument("--api-key-config", type=path_str, help="SGLang --config YAML holding the API key")


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
    prompts, prompts_sha256 = _prompts(args.prompts)
    if args.engine == "sglang" and not args.server_url and not args.check:
        raise BadInput("--engine sglang needs --server-url (the SGLang server serving the drafter)")
    return {
        "drafter_dir": str(drafter_dir), "drafter_sha256": file_sha256(weights), "drafter_config": config,
        "training_dir": str(training_dir) if training_dir else None, "training": training,
        "data_dir": str(Path(data_dir).resolve()), "target_model_path": str(Path(target).resolve()) if target else None,
        "prompts": prompts, "prompts_sha256": prompts_sha256,
    }  # fmt: skip


def _prompts(prompts) -> tuple[object, str]:
    """The held-out prompts (a path, or a mixture's sources) with their paths made absolute, and their digest: a
    file's SHA-256 (as before folders and mixtures), else that of their files' digests. BadInput when one is
    missing, or when a mixture weighs its sources (the selection takes prompts until it has enough: give counts)."""
    from eagle3_pipeline.conversations.dataset import dataset_facts, dataset_paths  # noqa: PLC0415

    for path in dataset_paths(prompts):
        if not path.exists():
            raise BadInput(f"--prompts {path.resolve()}: no such file (held-out conversations: JSONL, a JSON array, "
                           "Parquet or Arrow, or a folder of them)")
    if isinstance(prompts, tuple):
        if any(source.weight is not None for source in prompts):
            raise BadInput("--prompts: a mixture of held-out prompts takes a count per source (or none: all of "
                           "each), not weights; the selection reads prompts until it has --num-prompts usable ones")
        prompts = tuple(dataclasses.replace(source, path=source.path.resolve()) for source in prompts)
    else:
        prompts = prompts.resolve()
        if prompts.is_file():
            return prompts, file_sha256(prompts)
    facts = json.dumps(dataset_facts(prompts), sort_keys=True)
    return prompts, hashlib.sha256(facts.encode()).hexdigest()


def shown_dataset(dataset) -> str:
    """A dataset as evaluation.json records it: the path, or the mixture as JSON."""
    if isinstance(dataset, tuple):
        return json.dumps([{"path": str(s.path), "name": s.name, **({"count": s.count} if s.count else {})}
                           for s in dataset])
    return str(dataset)


def fingerprint(args: argparse.Namespace, inputs: dict) -> str:
    """What makes two evaluations the same: the drafter's weights, the prompts and every setting."""
    settings = {
        "drafter_sha256": inputs["drafter_sha256"], "prompts_sha256": inputs["prompts_sha256"],
        "data_dir": inputs["data_dir"], "target_model_path": inputs["target_model_path"],
        "num_prompts": args.num_prompts, "min_prompts": _min_prompts(args), "max_new_tokens": args.max_new_tokens,
        "draft_tokens": list(args.draft_tokens), "min_acceptance_ratio": args.min_acceptance_ratio,
        "ignore_eos": args.ignore_eos, "engine": args.engine,
        "device": args.device if args.engine == "reference" else None,
        "dtype": args.dtype if args.engine == "reference" else None,
        "check_outputs": args.check_outputs if args.engine == "reference" else None,
        "heldout_rule": HELDOUT_RULE, "verdict_rule": VERDICT_RULE,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _min_prompts(args: argparse.Namespace) -> int:
    return args.min_prompts or (args.num_prompts + 1) // 2


def previous_result(output_dir: Path, wanted: str) -> dict | None:
    """The existing evaluation.json when it was measured with the same fingerprint."""
    path = output_dir / RESULT_FILE
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) and document.get("fingerprint") == wanted else None


def _prepare(inputs: dict):
    """Open the data, check aux layers and chat template, load the renderer: (data, renderer, aux layers)."""
    from eagle3_pipeline.conversations.template import load_renderer  # noqa: PLC0415
    from eagle3_pipeline.evaluate.speculative import drafter_aux_layers  # noqa: PLC0415
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


def measure_chains(target, proposer, prompt_ids: list[list[int]], draft_tokens: list[int], max_new_tokens: int,
                   batch_tokens: int, ignore_eos: bool = False, say=_say) -> tuple[list[dict], dict]:
    """Speculative decoding of every prompt at each chain length, in batches of similar length (a chain of 0: the
    target decoding alone, ``proposer`` unused).

    Returns (one record per chain length: stats, decode seconds, batches, tokens/s; {chain length: the
    ``SpeculativeOutput`` of each prompt, in prompt order}).
    """
    from eagle3_pipeline.evaluate.speculative import (  # noqa: PLC0415
        AcceptanceStats,
        batches_by_tokens,
        speculative_generate,
    )

    runs, outputs = [], {}
    for chain in draft_tokens:
        stats = AcceptanceStats(chain)
        results = [None] * len(prompt_ids)
        began = time.perf_counter()
        batches = batches_by_tokens(prompt_ids, batch_tokens, reserve=target.reserve(max_new_tokens, chain))
        for batch in batches:
            decoded = speculative_generate(target, proposer, [prompt_ids[i] for i in batch], max_new_tokens, chain,
                                           ignore_eos)
            for index, result in zip(batch, decoded):
                results[index] = result
                stats.add(result)
            elapsed = time.perf_counter() - began
            say(f"{_chain_name(chain)}: {stats.requests}/{len(prompt_ids)} prompts, tau so far {stats.tau:.2f}, "
                f"{stats.completion_tokens / elapsed:,.0f} tokens/s")
        decode_s = time.perf_counter() - began
        outputs[chain] = results
        runs.append({"stats": stats, "decode_s": decode_s, "batches": len(batches),
                     "tokens_per_s": stats.completion_tokens / decode_s if decode_s else None})
    return runs, outputs


def _chain_name(chain: int) -> str:
    return f"chain of {chain}" if chain else "the target alone"


def measure_target_alone(target, prompt_ids: list[list[int]], max_new_tokens: int, batch_tokens: int,
                         ignore_eos: bool = False, say=_say) -> tuple[dict, list]:
    """The target decoding the same prompts alone, greedy, over the same engine and batching, one token per
    forward: the speed drafting is measured against. (its record, as ``measure_chains``'s; its outputs)"""
    runs, outputs = measure_chains(target, None, prompt_ids, [0], max_new_tokens, batch_tokens, ignore_eos, say)
    return runs[0], outputs[0]


def speed_record(alone: dict | None) -> dict | None:
    """evaluation.json's ``target_alone``: the target's own decode of the same prompts, timed."""
    if alone is None:
        return None
    stats = alone["stats"]
    return {"tokens_per_s": alone["tokens_per_s"], "decode_s": alone["decode_s"], "batches": alone["batches"],
            "target_forwards": stats.rounds, "tokens_generated": stats.completion_tokens,
            "method": "the same engine, prompts, batching and greedy decode, without a drafter (one token per "
                      "target forward)"}


def draft_vocabulary_reach(in_draft_vocab, outputs: list) -> dict:
    """How many of the target's own answer tokens the drafter could draft at all: every output token after the
    prefill's (each is a draft's target) inside the draft vocabulary (``in_draft_vocab``: the drafter's ``t2d``,
    [V] bool). A token outside it is rejected at any position however well the drafter is trained."""
    tokens = [token for result in outputs for token in result.output_ids[1:]]
    inside = in_draft_vocab.detach().cpu().tolist()
    outside = sum(1 for token in tokens if not inside[token])
    return {"draft_vocab_size": sum(inside), "answer_tokens": len(tokens), "outside": outside,
            "share_outside": outside / len(tokens) if tokens else None}


def check_outputs(target, prompt_ids: list[list[int]], names: list[str], outputs: dict, max_new_tokens: int,
                  batch_tokens: int, ignore_eos: bool = False, reference=None, reference_s: float = 0.0,
                  say=_say) -> dict:
    """Every speculative output against the target's greedy decode by full forwards (``reference``: that decode,
    when already made for these prompts and settings, in ``reference_s`` seconds); the mismatches with their
    near-tie verdicts."""
    from eagle3_pipeline.evaluate.speculative import compare_with_reference, judge_mismatches  # noqa: PLC0415

    check = {"checked": True, "method": "greedy decode by a full forward of the whole sequence per token, no KV "
             "cache", "mismatches": [], "near_ties": 0, "faults": 0, "decode_s": reference_s}
    if reference is None:
        began = time.perf_counter()
        reference = target.greedy_reference(prompt_ids, max_new_tokens, ignore_eos, batch_tokens)
        check["decode_s"] = time.perf_counter() - began
    for chain, results in outputs.items():
        found = [compare_with_reference(result, want) for result, want in zip(results, reference)]
        judge_mismatches(target, prompt_ids, found)
        check["mismatches"] += [{"id": name, "draft_tokens": chain, **mismatch.as_dict()}
                                for name, mismatch in zip(names, found) if mismatch is not None]
    check["near_ties"] = sum(1 for m in check["mismatches"] if m["near_tie"])
    check["faults"] = len(check["mismatches"]) - check["near_ties"]
    compared = len(prompt_ids) * len(outputs)
    say(f"outputs checked against the target's greedy decode by full forwards ({check['decode_s']:.1f} s): "
        f"{compared - len(check['mismatches'])} of {compared} equal, {check['near_ties']} differ at a numerical "
        f"near-tie, {check['faults']} differ otherwise")
    return check


def judge_runs(measured_runs: list[dict], training: dict, check: dict, min_ratio: float,
               replay=None, max_new_tokens: int | None = None) -> tuple[list[dict], dict]:
    """Each chain's figures for evaluation.json beside the training's prediction and the replay's (``replay``: a
    ``speculative.Replay``), and the verdict over all. ``max_new_tokens``: the decode's, so that the prediction
    comes from the training's score over answers of that length when it has one (``verdict.predict``: walked
    round by round when the training did); ``predicted_tau_per_token`` is the same tokens scored per token and
    ``predicted_tau_all_tokens`` the whole held-out split's, beside it."""
    from eagle3_pipeline.evaluate.verdict import judge, predict, predicted_rates, predicted_tau  # noqa: PLC0415

    every_token, _ = predicted_rates(training)  # without max_new_tokens: never the opening score
    per_token = replay.per_token() if replay is not None else None
    runs, rates, support, source = [], {}, {}, None
    for run in measured_runs:
        stats = run["stats"]
        chain = stats.draft_tokens
        prediction = predict(training, max_new_tokens, chain)
        rates[chain], support[chain] = prediction.rates, prediction.support
        source = source or prediction.source
        replayed = replay.chains.get(chain) if replay is not None else None
        runs.append({"draft_tokens": chain, **stats.as_dict(), "predicted_tau": prediction.tau,
                     "predicted_tau_per_token": prediction.per_token_tau,
                     "predicted_tau_all_tokens": predicted_tau(every_token, chain),
                     "predicted_conditional_acceptance": prediction.rates,
                     "replayed": None if replayed is None else {
                         **replayed.as_dict(),
                         "per_token_conditional_acceptance": per_token["cond_acc_k"][:chain],
                         "per_token_tau": predicted_tau(per_token["cond_acc_k"], chain)},
                     "decode_s": run["decode_s"], "batches": run["batches"], "tokens_per_s": run["tokens_per_s"]})
    return runs, judge(runs, rates, source, check["faults"], min_ratio, support)


def replay(target, drafter, prompt_ids: list[list[int]], reference, chains: list[int], max_new_tokens: int,
           say=_say):
    """``replay_chains`` of the prompts' full-forward greedy decode, timed and said (a ``speculative.Replay``)."""
    from eagle3_pipeline.evaluate.speculative import replay_chains  # noqa: PLC0415

    began = time.perf_counter()
    replayed = replay_chains(target, drafter, prompt_ids, reference, chains, max_new_tokens)
    say(f"replayed from full forwards in {time.perf_counter() - began:.1f} s: " + ", ".join(
        f"tau {stats.tau:.3f} at {chain}" for chain, stats in replayed.chains.items()))
    return replayed


def run_reference(args, prompts, aux_layers: list[int], target_path: str) -> dict:
    """Speculative decoding of every prompt on the reference engine at each chain length, batched, then the
    check against the target's greedy decode by full forwards."""
    from eagle3_pipeline.evaluate.speculative import EagleProposer, TargetModel, load_drafter  # noqa: PLC0415

    started = time.perf_counter()
    target = TargetModel.load(target_path, aux_layers, device=args.device, dtype=args.dtype, decode=args.decode)
    drafter, _ = load_drafter(args.drafter_dir, target.input_embeddings(), device=target.device)
    _say(f"target {target_path} and drafter loaded on {target.device} ({target.dtype_name}) in "
         f"{time.perf_counter() - started:.1f} s")
    prompt_ids = [list(prompt.input_ids) for prompt in prompts]
    runs, outputs = measure_chains(target, EagleProposer(drafter), prompt_ids, args.draft_tokens,
                                   args.max_new_tokens, args.batch_tokens, args.ignore_eos)
    # After the chains: the first chain pays any warm-up, never the baseline it is divided by.
    alone, outputs[0] = measure_target_alone(target, prompt_ids, args.max_new_tokens, args.batch_tokens,
                                             args.ignore_eos)
    check = {"checked": False, "method": None, "mismatches": [], "near_ties": 0, "faults": 0}
    replayed = None
    if args.check_outputs:
        began = time.perf_counter()
        reference = target.greedy_reference(prompt_ids, args.max_new_tokens, args.ignore_eos, args.batch_tokens)
        check = check_outputs(target, prompt_ids, [p.sample_id for p in prompts], outputs, args.max_new_tokens,
                              args.batch_tokens, args.ignore_eos, reference, time.perf_counter() - began)
        replayed = replay(target, drafter, prompt_ids, reference, args.draft_tokens, args.max_new_tokens)
    reach = draft_vocabulary_reach(drafter.t2d, outputs[0])
    if reach["answer_tokens"]:
        _say(f"draft vocabulary ({reach['draft_vocab_size']:,} tokens): {reach['outside']} of the target's "
             f"{reach['answer_tokens']} answer tokens ({reach['share_outside']:.1%}) are outside it and can never "
             "be drafted")
    return {"runs": runs, "check": check, "replay": replayed, "target_alone": alone, "draft_vocabulary": reach,
            "device": str(target.device), "dtype": target.dtype_name, "decode": target.runner.decode_path}


def run_sglang(args, prompts) -> dict:
    """The prompts through a running SGLang server that serves the drafter."""
    from eagle3_pipeline.evaluate.sglang_client import measure_sglang  # noqa: PLC0415

    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None

    def progress(done: int, stats) -> None:
        _say(f"prompt {done}/{len(prompts)}: tau so far {stats.tau:.2f}")

    if len(args.draft_tokens) != 1:
        raise BadInput(f"--engine sglang measures the one chain length its server was started with; --draft-tokens "
                       f"{','.join(map(str, args.draft_tokens))} names several: give one")
    stats, _outputs, wall = measure_sglang(args.server_url, prompts, args.max_new_tokens, args.draft_tokens[0],
                                           api_key=api_key, progress=progress)
    run = {"stats": stats, "decode_s": wall, "batches": len(prompts),
           "tokens_per_s": stats.completion_tokens / wall if wall else None}
    return {"runs": [run], "check": {"checked": False, "method": None, "mismatches": [], "near_ties": 0, "faults": 0},
            "device": None, "dtype": None}


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
                                       args.draft_tokens[0], extra, args.api_key_config)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    print(json.dumps({"argv": argv, "url": f"http://127.0.0.1:{args.port}"}), flush=True)
    return EXIT_OK


def _summary_line(document: dict) -> str:
    parts = []
    for run in document.get("runs") or [document]:
        predicted = run.get("predicted_tau")
        replayed = (run.get("replayed") or {}).get("tau")
        positions = "/".join(f"{value:.2f}" for value in run["conditional_acceptance_per_position"])
        speedup = f", {run['speedup']:.2f}x the target alone's tokens/s" if run.get("speedup") else ""
        parts.append(f"chain of {run['draft_tokens']}: tau {run['tau']:.2f} (replayed from full forwards "
                     f"{'%.2f' % replayed if replayed is not None else 'n/a'}, training predicts "
                     f"{'%.2f' % predicted if predicted is not None else 'n/a'}), acceptance per position "
                     f"{positions}{speedup}")
    line = "acceptance length (measured): " + "; ".join(parts)
    diagnosis = (document.get("verdict") or {}).get("diagnosis")
    return f"{line}\n{diagnosis}" if diagnosis else line


def _verdict_lines(document: dict) -> list[str]:
    verdict = document.get("verdict") or {}
    if verdict.get("passed", True):
        return []
    return ["error: the drafter FAILED its evaluation: " + " | ".join(verdict.get("problems") or []),
            "likely causes: " + " | ".join(verdict.get("likely_causes") or [])]


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
    from eagle3_pipeline.evaluate.heldout import HeldoutError, select_heldout_prompts  # noqa: PLC0415
    from eagle3_pipeline.evaluate.speculative import EvaluationError  # noqa: PLC0415
    from eagle3_pipeline.server_client import EngineError, ServerUnreachable  # noqa: PLC0415
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
            for line in _verdict_lines(done):
                _say(line)
            return EXIT_OK if (done.get("verdict") or {}).get("passed", True) else EXIT_VERDICT_FAILED
        data, renderer, aux_layers = _prepare(inputs)
        selection = select_heldout_prompts(inputs["prompts"], renderer, data, args.num_prompts, _min_prompts(args),
                                           args.max_new_tokens)
        prompts = selection.prompts
        for line in selection.skipped:
            _say(f"prompt left out: {line}")
        for entry in selection.excluded[:SHOWN_EXCLUSIONS]:
            _say(f"prompt excluded: {entry['id']} (line {entry['line']}): {entry['reason']} {entry['other']}")
        if len(selection.excluded) > SHOWN_EXCLUSIONS:
            _say(f"... and {len(selection.excluded) - SHOWN_EXCLUSIONS} more excluded (evaluation.json lists all)")
        _say(f"{len(prompts)} held-out prompts, none among the {selection.training_samples} training samples, none "
             f"over {selection.longest_prompt or 'any'} tokens ({len(selection.excluded)} excluded)")
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
    check = measured["check"]
    runs, verdict = judge_runs(measured["runs"], inputs["training"], check, args.min_acceptance_ratio,
                               measured.get("replay"), args.max_new_tokens)
    source = verdict["predicted_from"]
    alone = speed_record(measured.get("target_alone"))
    for run in runs:  # what a user gains: tokens/s with the drafter over the target decoding alone
        run["speedup"] = (run["tokens_per_s"] / alone["tokens_per_s"]
                          if alone and alone["tokens_per_s"] and run["tokens_per_s"] else None)
    primary = runs[0]
    simulated = (prediction_record(inputs["training"], args.max_new_tokens)[0] or {}).get("acceptance_length")
    document = {
        "format": RESULT_FORMAT, "fingerprint": wanted, "engine": args.engine,
        **{key: primary[key] for key in primary if key not in ("accepted", "reached")},
        "runs": runs, "verdict": verdict,
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
        "excluded_prompts": selection.excluded, "overlap_check": selection.summary(),
        "target_alone": alone, "draft_vocabulary": measured.get("draft_vocabulary"), "reference_check": check,
        "outputs_match_target": (not check["faults"]) if check["checked"] else None,
        "output_mismatches": check["mismatches"],
        "simulated_acceptance_length": simulated, "simulated_from": source,
        "simulated_tau": primary["predicted_tau"],
        "replayed_tau": (primary.get("replayed") or {}).get("tau"), "diagnosis": verdict["diagnosis"],
        "note": ("tau = tokens produced by verify forwards / verify forwards = 1 + mean drafts accepted per round "
                 "(the prefill and its first token counted in neither); predicted_tau: from simulated_from, the "
                 "rounds the training's held-out first answers go through when it walked them (else, and "
                 "predicted_tau_per_token: 1 + sum_k prod_{i<=k} cond_acc_i per token, which counts easy stretches "
                 "by their tokens rather than their rounds and so predicts more); predicted_tau_all_tokens: per token "
                 "over every assistant token of the training's held-out split; replayed_tau: the same "
                 "drafter and prompts replayed from full forwards of the target's greedy decode (no cache), and "
                 "replayed.per_token_tau the replay's tokens scored per token. "
                 "sglang_accept_length is SGLang's completion_tokens / spec_verify_ct (the prefill's token counted). "
                 "speedup: tokens_per_s with the drafter / target_alone's (the same engine, prompts and batching, "
                 "greedy, no drafter); none for the sglang engine (its server serves the drafter)."),
        "wall_s": time.time() - started, "device": measured["device"], "dtype": measured["dtype"],
        "decode": measured.get("decode"),
        "server_url": args.server_url if args.engine == "sglang" else None,
        "drafter_dir": inputs["drafter_dir"], "drafter_sha256": inputs["drafter_sha256"],
        "target_model_path": inputs["target_model_path"], "data_dir": inputs["data_dir"],
        "training_dir": inputs["training_dir"], "prompts_file": shown_dataset(inputs["prompts"]),
        "prompts_sha256": inputs["prompts_sha256"], "prompt_ids": [p.sample_id for p in prompts],
        "finished": time.time(),
    }  # fmt: skip
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output_dir / RESULT_FILE, json.dumps(document, indent=1) + "\n")
    if check["near_ties"]:
        shown = [(m["id"], m["draft_tokens"], m["first_difference"], m["logit_gap"]) for m in check["mismatches"]
                 if m["near_tie"]][:5]
        _say(f"{check['near_ties']} output(s) differ from the target's greedy decode at a numerical near-tie "
             f"(id, chain, token, logit gap): {shown}")
    if alone:
        _say(f"the target alone: {alone['tokens_generated']} tokens, {alone['target_forwards']} forwards in "
             f"{alone['batches']} batch(es), {alone['tokens_per_s'] or 0:,.1f} tokens/s")
    for run in runs:
        speedup = f", {run['speedup']:.2f}x the target alone's" if run.get("speedup") else ""
        _say(f"chain of {run['draft_tokens']}: {run['tokens_generated']} tokens, {run['target_forwards']} verify "
             f"forwards in {run['batches']} batch(es), {run['tokens_per_s'] or 0:,.1f} tokens/s{speedup}")
    _say(_summary_line(document))
    _say(f"written: {output_dir / RESULT_FILE}")
    for line in _verdict_lines(document):
        _say(line)
    return EXIT_OK if verdict["passed"] else EXIT_VERDICT_FAILED
