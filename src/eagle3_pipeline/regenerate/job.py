"""``eagle3-pipeline regenerate``: the target answers every assistant turn of a conversation dataset itself.

A drafter learns the target's distribution best from the target's own answers, not from the
dataset's (written by people or by another model). This command replaces each assistant turn by
the answer of the server's model to the regenerated history before it (``conversation.py``), on
a server started for serving (radix cache and CUDA graphs on: each turn's prompt is the turn
before's prompt plus its answer, so the server reuses that prefill). Its output is the input
for the extraction (``output.py`` has the layout).

One run is one part (``--part K/N``, default 0/1) of the dataset, run by the part job that the
extraction shares (``parts/job.py``: the split over hosts, the lock, the journal, the worker
pool, progress, the exit codes). What the regeneration adds:

1. the settings that shape the answers (the target's tokenizer and chat template, the same
   rendering the extraction uses; temperature, max_new_tokens, on_length, max_length), compared
   with ``D/regeneration-settings.json``; a conversation's key hashes them, its id and its turns;
2. ``concurrency`` conversations in flight, one request each at a time (many requests in flight,
   so the server batches them); a finished conversation is one journal line;
3. the part's conversations and summary, written once every conversation is done; with one part
   (and without ``--no-merge``) merged into ``D/regenerated.jsonl`` and ``D/regeneration.json``.
   A part that is written (and merged) already is left as it is: nothing is written at all.

SIGTERM (the supervisor's stop) and SIGINT stop asking: each conversation finishes the request
it has in flight and is then left (or journaled, when that was its last turn); a rerun with the
same settings continues. A kill -9 loses at most the conversations in flight.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import secrets
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.cli_args import path_arg
from eagle3_pipeline.parts import files
from eagle3_pipeline.parts import job as part_job
from eagle3_pipeline.parts.job import EXIT_BAD_INPUT, EXIT_OK, PartConfig, PartJob, PartPlan, PartProgress
from eagle3_pipeline.regenerate import output

RID_PREFIX = "e3r"
DEFAULT_MAX_LENGTH = part_job.DEFAULT_MAX_LENGTH  # the extraction's: a longer conversation is cut there anyway


@dataclass
class RegenerateConfig(PartConfig):
    """Everything one run needs (the CLI's options): the shared ones and the regeneration's."""

    concurrency: int = 64
    temperature: float = 0.0
    max_new_tokens: int = 512
    on_length: str = "keep"


@dataclass
class Conversation:
    """A conversation of this part, with the key its journal record carries."""

    ordinal: int
    line: int
    sample_id: str
    messages: tuple
    key: str
    source: str | None = None  # in a mixture: the source it came from


@dataclass
class Plan(PartPlan):
    """What a run found before asking anything: the shared plan, its items ``Conversation``."""

    renderer: object = None
    engine: str = "?"  # "reference 0.3.0": the server's engine and version
    context_length: int | None = None


def answer_settings(model_path: Path, renderer, cfg: RegenerateConfig) -> dict:
    """The settings that shape the answers (every part and rerun must share them)."""
    from eagle3_pipeline.checksum import file_sha256  # noqa: PLC0415

    def sha(name: str) -> str | None:
        return file_sha256(model_path / name) if (model_path / name).is_file() else None

    tokenizer = {name: sha(name) for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")}
    return {
        "target_model_path": str(model_path),
        "target_config_sha256": sha("config.json"),
        "tokenizer_sha256": {k: v for k, v in tokenizer.items() if v},
        "chat_template_sha256": renderer.template_hash,
        "chat_template_file": str(cfg.chat_template) if cfg.chat_template else None,
        "temperature": cfg.temperature,
        "max_new_tokens": cfg.max_new_tokens,
        "on_length": cfg.on_length,
        "max_length": cfg.max_length,
    }


def conversation_key(settings: dict, sample_id: str, messages) -> str:
    """What identifies a finished conversation: the shaping settings, its id and its turns."""
    shaping = {k: v for k, v in settings.items() if k not in files.INFORMATIONAL_SETTINGS}
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode())
    digest.update(b"\0" + sample_id.encode("utf-8", "surrogatepass") + b"\0")
    digest.update(json.dumps(list(messages), sort_keys=True).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _server_facts(client) -> dict:
    info = client.server_info()
    if not isinstance(info, dict):
        raise ValueError(f"{client.url}/server_info answered {str(info)[:200]!r}, not a JSON object")
    return info


def make_plan(cfg: RegenerateConfig, client=None, dry: bool = False) -> Plan:
    """Step 1 of the part job; raises ``ValueError`` subclasses (and OSError) on bad input.

    ``client``: the server, asked for its model path (unless ``--model-path``), context length and
    engine; None for ``--check`` with ``--model-path``, which needs no server. ``dry``: leave the
    journal as it is, even a torn last line (a live run may be appending to it).
    """
    from eagle3_pipeline.conversations.template import load_renderer  # noqa: PLC0415

    part_job.check_dataset(cfg.dataset)
    info = _server_facts(client) if client is not None else {}
    model_path = Path(cfg.model_path or info.get("model_path") or "")
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"target model {model_path}: no config.json there; the regeneration reads the target's tokenizer and "
            "chat template from the server's model directory on this host (give --model-path when it lives elsewhere)"
        )
    renderer = load_renderer(model_path, cfg.chat_template, trust_remote_code=cfg.trust_remote_code)
    settings = answer_settings(model_path, renderer, cfg)
    claim_settings(cfg.output_dir, settings, create=False)
    records, conversations, skipped = part_job.read_part(cfg, lambda item: Conversation(
        item.ordinal, item.line, item.sample_id, item.messages,
        conversation_key(settings, item.sample_id, item.messages), item.source))
    journal, by_key = part_job.open_journal(cfg, "regenerated", dry)
    done = {c.key: by_key[c.key] for c in conversations if c.key in by_key}
    context = info.get("context_length")
    plan = Plan(settings, records, conversations, skipped, journal, done, renderer=renderer,
                engine=f"{info.get('engine', 'sglang')} {info.get('version', '?')}" if info else "?",
                context_length=int(context) if isinstance(context, int) and context > 0 else None)
    plan.todo = [c for c in conversations if c.key not in done]
    return plan


def claim_settings(out_dir: Path, settings: dict, create: bool = True) -> bool:
    """``files.claim_settings`` on ``D/regeneration-settings.json``."""
    return files.claim_settings(out_dir, settings, create, file_name=output.SETTINGS_FILE,
                                what="conversations regenerated")


def _dataset_facts(cfg: RegenerateConfig) -> dict:
    from eagle3_pipeline.conversations.dataset import dataset_facts  # noqa: PLC0415

    return {**dataset_facts(cfg.dataset), "num_samples_limit": cfg.num_samples}


def part_texts(cfg: RegenerateConfig, plan: Plan) -> tuple[str, str]:
    """The part's conversations and summary as they are written once every conversation is done."""
    finished = [plan.done[c.key] for c in plan.items if c.key in plan.done]
    return output.part_documents(cfg.part[0], cfg.part[1], plan.records, finished, plan.skipped,
                                 _dataset_facts(cfg))


class Progress(PartProgress):
    """The part's progress: conversations done of this part's, turns, generated tokens/s."""

    unit = "conversations"

    def __init__(self, cfg: RegenerateConfig, plan: Plan):
        super().__init__(cfg, "regenerate", plan, sum(r.get("generated_tokens", 0) for r in plan.done.values()))
        self.skipped += sum(1 for r in plan.done.values() if r["status"] != "ok")
        self.turns = sum(r.get("turns", 0) for r in plan.done.values())

    def eta_s(self) -> float | None:
        left = self.total - self.done
        per_conversation = self.elapsed() / self.done_now if self.done_now else None
        return 0.0 if left <= 0 else (round(left * per_conversation, 1) if per_conversation else None)

    def extra(self) -> dict:
        return {"unit": "conversations", "turns": self.turns}

    def counts(self) -> str:
        return f"{self.skipped} skipped, {self.turns} turns"


class ConversationWorker:
    """Regenerates one conversation through the server; safe to run in many threads."""

    def __init__(self, cfg: RegenerateConfig, plan: Plan, client):
        from eagle3_pipeline.regenerate.conversation import Answer  # noqa: PLC0415

        self.cfg = cfg
        self.plan = plan
        self.client = client
        self.answer_type = Answer
        self.stopping = threading.Event()
        # Request ids differ between runs: a killed run's requests may still be in the server.
        self.run_id = secrets.token_hex(3)

    def generate(self, conversation: Conversation, turn: int, prompt: list[int], budget: int):
        """One turn: the prompt's ids to /generate, the answer's ids and text back."""
        from eagle3_pipeline.server_client import EngineError  # noqa: PLC0415

        rid = f"{RID_PREFIX}-{self.cfg.part[0]}-{self.run_id}-{conversation.key[:16]}-{turn}"
        body = {"input_ids": prompt, "rid": rid,
                "sampling_params": {"max_new_tokens": budget, "temperature": self.cfg.temperature}}
        answer = self.client.call("POST", "/generate", body)
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        ids = answer.get("output_ids") if isinstance(answer, dict) else None
        if not isinstance(meta, dict) or not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise EngineError(200, f"unexpected /generate answer (no output_ids and meta_info): {str(answer)[:300]}")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in ("stop", "length"):
            raise EngineError(200, f"the request {rid} ended with finish reason {finish!r}, neither stop nor length")
        text = self.plan.renderer.tokenizer.decode(ids, skip_special_tokens=True)
        return self.answer_type(text, ids, kind)

    def __call__(self, conversation: Conversation) -> dict | None:
        """The conversation's journal record, or None when the run stopped before it was done."""
        from eagle3_pipeline.regenerate.conversation import (  # noqa: PLC0415
            ConversationSkipped,
            NotAnswered,
            regenerate_conversation,
        )
        from eagle3_pipeline.server_client import EngineError  # noqa: PLC0415

        base = {"key": conversation.key, "ordinal": conversation.ordinal, "line": conversation.line,
                "id": conversation.sample_id, **({"source": conversation.source} if conversation.source else {})}
        turns = iter(range(1, 1 << 30))
        try:
            result = regenerate_conversation(
                conversation.messages, self.plan.renderer,
                lambda prompt, budget: self.generate(conversation, next(turns), prompt, budget),
                max_new_tokens=self.cfg.max_new_tokens, max_length=self.cfg.max_length,
                context_length=self.plan.context_length, on_length=self.cfg.on_length,
                stopping=self.stopping.is_set,
            )
        except NotAnswered:
            return None
        except ConversationSkipped as exc:
            return {**base, "status": "skipped", "reason": exc.reason, "detail": exc.detail}
        except EngineError as exc:  # the server refused this conversation's request: its own fault
            return {**base, "status": "skipped", "reason": "engine_error", "detail": str(exc)}
        return {**base, "status": "ok", "engine": self.plan.engine, **result.record()}


class RegenerationJob(PartJob):
    """The regeneration's part of the shared part job: each conversation answered by the target."""

    label, what, done_what, unit = "regenerate", "regeneration", "regenerated", "conversation"
    check_finished_first = True

    def make_plan(self, dry: bool = False) -> Plan:
        return make_plan(self.cfg, self.client, dry)

    def claim_settings(self, settings: dict, create: bool = True) -> bool:
        return claim_settings(self.cfg.output_dir, settings, create)

    def finished(self, plan: Plan) -> str | None:
        cfg = self.cfg
        if not _finished(cfg, plan):
            return None
        where = cfg.output_dir / output.OUTPUT_FILE if cfg.part[1] == 1 and cfg.merge else "part files"
        return (f"part {cfg.part[0]}/{cfg.part[1]}: all {len(plan.items)} conversations done already ({where} up to "
                "date): nothing to do")

    def describe(self, plan: Plan) -> str:
        cfg = self.cfg
        return (f"part {cfg.part[0]}/{cfg.part[1]}: {plan.records} records, {len(plan.items)} conversations, "
                f"{len(plan.skipped)} skipped, {len(plan.done)} already done, {len(plan.todo)} to regenerate "
                f"with {self.client.url} ({plan.engine}; temperature {cfg.temperature}, max_new_tokens "
                f"{cfg.max_new_tokens}, on_length {cfg.on_length}, max_length {cfg.max_length})")

    def progress(self, plan: Plan) -> Progress:
        return Progress(self.cfg, plan)

    def start_work(self, plan: Plan, progress: Progress) -> ConversationWorker:
        return ConversationWorker(self.cfg, plan, self.client)

    def count(self, plan: Plan, progress: Progress, record: dict) -> None:
        plan.done[record["key"]] = record
        progress.done += 1
        progress.done_now += 1
        if record["status"] == "ok":
            progress.turns += record["turns"]
            progress.tokens_now += record["generated_tokens"]
        else:
            progress.skipped += 1

    def finish(self, plan: Plan, progress: Progress) -> tuple[int, str]:
        cfg = self.cfg
        index, count = cfg.part
        written = sum(1 for r in plan.done.values() if r["status"] == "ok")
        if plan.records and not written:
            return EXIT_BAD_INPUT, (
                f"no conversation of part {index}/{count} could be regenerated ({plan.records} records, every one "
                f"left out; see {output.PARTS_DIR}/{files.part_name(index, count)}.journal.jsonl and the skips above)")
        output.write_part(cfg.output_dir, index, count, part_texts(cfg, plan))
        message = (f"part {index}/{count} complete: {written} conversations regenerated, "
                   f"{progress.skipped} skipped, {progress.turns} turns")
        return EXIT_OK, message

    def merge(self) -> str:
        summary, _ = output.merge(self.cfg.output_dir)
        return f"{output.OUTPUT_FILE}: {summary['num_conversations']} conversations"


def _finished(cfg: RegenerateConfig, plan: Plan) -> bool:
    """Whether this part is done and written (and merged, when this run would merge)."""
    index, count = cfg.part
    if plan.todo or not output.part_is_written(cfg.output_dir, index, count, part_texts(cfg, plan)):
        return False
    return count > 1 or not cfg.merge or output.is_merged(cfg.output_dir)


def check_status(cfg: RegenerateConfig) -> dict:
    """``--check``: what a run would do, asking nothing of the server when ``--model-path`` is given."""
    from eagle3_pipeline.server_client import EngineClient  # noqa: PLC0415

    client = None if cfg.model_path else EngineClient(cfg.server_url, cfg.api_key, cfg.request_timeout_s, cfg.retries)
    plan = make_plan(cfg, client, dry=True)
    index, count = cfg.part
    complete = not plan.todo and output.part_is_written(cfg.output_dir, index, count, part_texts(cfg, plan))
    return {
        "part": f"{index}/{count}",
        "records": plan.records,
        "conversations": len(plan.items),
        "skipped": len(plan.skipped),
        "done": len(plan.done),
        "todo": len(plan.todo),
        "complete": complete,
        "merged": complete and output.is_merged(cfg.output_dir),
        "output": str(cfg.output_dir / output.OUTPUT_FILE),
    }


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline regenerate``: the part job's, and the regeneration's."""
    part_job.add_options(parser, server="serving", concurrency=64,
                         concurrency_help="conversations in flight (one request each)",
                         check_help="print what a run would do as JSON; ask nothing (no server needed with "
                         "--model-path)", merged_file="regenerated.jsonl")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer at most")
    parser.add_argument("--on-length", choices=["keep", "cut", "drop"], default="keep",
                        help="an answer that hits --max-new-tokens: keep it and go on, cut the conversation after "
                        "it, or drop the conversation")
    parser.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH,
                        help="stop a conversation once it renders to this many tokens (the extraction's "
                        "--max-length: it cuts there anyway)")
    parser.add_argument("--api-key-file", type=path_arg, help="a file whose first line is the server's API key")
    part_job.model_path_option(parser, "the tokenizer and chat template")


def config_from_args(args: argparse.Namespace) -> RegenerateConfig:
    """The run's settings from the command line; ValueError naming the option that is wrong."""
    api_key = None
    if args.api_key_file is not None:
        try:
            api_key = args.api_key_file.read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read a key from it ({exc or 'empty'})") \
                from None
        if not api_key:
            raise ValueError(f"--api-key-file {args.api_key_file}: its first line is empty")
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    if not 0 <= args.temperature < 100:
        raise ValueError(f"--temperature must be between 0 (greedy) and 100, got {args.temperature}")
    return RegenerateConfig(**part_job.config_fields(args, api_key), temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, on_length=args.on_length)


def run(args: argparse.Namespace) -> int:
    """``eagle3-pipeline regenerate``."""
    return part_job.main(args, config_from_args, check_status, RegenerationJob)


def configure_merge(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline regenerate-merge``."""
    parser.add_argument("output_dir", type=path_arg, help="the regeneration's output directory")


def run_merge(args: argparse.Namespace) -> int:
    """Merge every part into regenerated.jsonl and regeneration.json; print a JSON summary."""
    try:
        summary, changed = output.merge(args.output_dir)
    except (output.OutputError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    shown = {key: summary[key] for key in ("num_records", "num_conversations", "num_skipped", "turns",
                                          "turns_left_out", "leading_dropped", "generated_tokens",
                                          "finish_reasons", "truncated_kept", "cut", "limited", "skipped_reasons",
                                          "parts")}
    print(json.dumps({**shown, "changed": changed, "output": str(args.output_dir / output.OUTPUT_FILE)},
                     sort_keys=True))
    return EXIT_OK
