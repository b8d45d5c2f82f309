"""``eagle3-pipeline regenerate``: the target answers every assistant turn of a conversation dataset itself.

A drafter learns the target's distribution best from the target's own answers, not from the
dataset's (written by people or by another model). This command replaces each assistant turn by
the answer of the server's model to the regenerated history before it (``conversation.py``), on
a server started for serving (radix cache and CUDA graphs on: each turn's prompt is the turn
before's prompt plus its answer, so the server reuses that prefill). Its output is the input
for the extraction (``output.py`` has the layout). One run is one part (``--part K/N``, default
0/1): the records whose 0-based ordinal ``i`` has ``i % N == K``, so N hosts, each with its own
server, share the work in one output directory, as the extraction's hosts do. The steps:

1. read the settings that shape the answers (the target's tokenizer and chat template, the same
   rendering the extraction uses; temperature, max_new_tokens, on_length, max_length) and
   compare them with ``D/regeneration-settings.json``;
2. read the dataset (the extraction's reader: a bad record is a skip with the reader's reason)
   and keep this part's conversations; drop those the journal already holds (a key hashes the
   settings, the id and the conversation); then lock the settings (a refused run locks nothing);
3. regenerate the rest, ``concurrency`` conversations in flight (one request each at a time:
   many requests in flight, so the server batches them), appending each finished conversation
   to the journal and keeping a progress file current;
4. write the part's conversations and summary; with one part (and without ``--no-merge``)
   merge them into ``D/regenerated.jsonl`` and ``D/regeneration.json``.

SIGTERM (the supervisor's stop) and SIGINT stop asking: each conversation finishes the request
it has in flight and is then left (or journaled, when that was its last turn); a rerun with the
same settings continues. A kill -9 loses at most the conversations in flight. Exit codes as the
extraction's: 0 done, 1 failed, 2 bad input or settings, 3 server unreachable, 4 stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.cli_args import path_arg, path_str
from eagle3_pipeline.extract.job import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_UNREACHABLE,
    ExtractConfig,
)
from eagle3_pipeline.progress_file import ProgressReporter
from eagle3_pipeline.regenerate import output
from eagle3_pipeline.work_window import run_window

RID_PREFIX = "e3r"
DEFAULT_MAX_LENGTH = ExtractConfig.max_length  # the extraction's: a longer conversation is cut there anyway


@dataclass
class RegenerateConfig:
    """Everything one run needs (the CLI's options)."""

    dataset: Path
    output_dir: Path
    server_url: str
    api_key: str | None = None
    model_path: str | None = None
    chat_template: Path | None = None
    num_samples: int | None = None
    part: tuple[int, int] = (0, 1)
    temperature: float = 0.0
    max_new_tokens: int = 512
    on_length: str = "keep"
    max_length: int = DEFAULT_MAX_LENGTH
    concurrency: int = 64
    retries: int = 5
    request_timeout_s: float = 600.0
    merge: bool = True
    quiet: bool = False
    trust_remote_code: bool = False


@dataclass
class Conversation:
    """A conversation of this part, with the key its journal record carries."""

    ordinal: int
    line: int
    sample_id: str
    messages: tuple
    key: str


@dataclass
class Plan:
    """What a run found before asking anything."""

    settings: dict
    renderer: object
    records: int  # records of this part (conversations + skips)
    conversations: list[Conversation]
    skipped: list[dict]  # records the reader left out
    journal: object
    done: dict[str, dict]  # key -> journal record, for this selection
    todo: list[Conversation] = field(default_factory=list)
    engine: str = "?"  # "reference 0.3.0": the server's engine and version
    context_length: int | None = None


def _log(cfg: RegenerateConfig, message: str) -> None:
    if not cfg.quiet:
        print(f"[regenerate] {message}", file=sys.stderr, flush=True)


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
    from eagle3_pipeline.extract.store import INFORMATIONAL_SETTINGS  # noqa: PLC0415

    shaping = {k: v for k, v in settings.items() if k not in INFORMATIONAL_SETTINGS}
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
    """Steps 1-2 of the module docstring; raises ``ValueError`` subclasses (and OSError) on bad input.

    ``client``: the server, asked for its model path (unless ``--model-path``), context length and
    engine; None for ``--check`` with ``--model-path``, which needs no server. ``dry``: leave the
    journal as it is, even a torn last line (a live run may be appending to it).
    """
    from eagle3_pipeline.extract import store  # noqa: PLC0415
    from eagle3_pipeline.extract.dataset import Skip, read_dataset  # noqa: PLC0415
    from eagle3_pipeline.extract.template import load_renderer  # noqa: PLC0415

    if not cfg.dataset.is_file():
        raise FileNotFoundError(f"dataset {cfg.dataset} does not exist")
    info = _server_facts(client) if client is not None else {}
    model_path = Path(cfg.model_path or info.get("model_path") or "")
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"target model {model_path}: no config.json there; the regeneration reads the target's tokenizer and "
            "chat template from the server's model directory on this host (give --model-path when it lives elsewhere)"
        )
    renderer = load_renderer(model_path, cfg.chat_template, trust_remote_code=cfg.trust_remote_code)
    settings = answer_settings(model_path, renderer, cfg)
    store.claim_settings(cfg.output_dir, settings, create=False, file_name=output.SETTINGS_FILE,
                         what="conversations regenerated")
    index, count = cfg.part
    conversations: list[Conversation] = []
    skipped: list[dict] = []
    records = 0
    for item in read_dataset(cfg.dataset, cfg.num_samples):
        if item.ordinal % count != index:
            continue
        records += 1
        if isinstance(item, Skip):
            skipped.append({"line": item.line, "id": item.sample_id, "reason": item.reason, "detail": item.detail})
            continue
        conversations.append(Conversation(item.ordinal, item.line, item.sample_id, item.messages,
                                          conversation_key(settings, item.sample_id, item.messages)))
    parts_dir = cfg.output_dir / output.PARTS_DIR
    splits = {p.name.split(".")[0].split("-of-")[1] for p in parts_dir.glob("part-*-of-*.j*")}
    other = sorted(splits - {str(count)})
    if other:
        raise store.StoreError(
            f"{cfg.output_dir} holds parts of a split over {' and '.join(other)} host(s), this run is part "
            f"{index}/{count}: a dataset is regenerated by one set of hosts; run with that many hosts, or use another "
            "output directory"
        )
    journal = store.Journal(output.part_path(cfg.output_dir, index, count, ".journal.jsonl"))
    by_key = journal.load(repair=not dry)
    done = {c.key: by_key[c.key] for c in conversations if c.key in by_key}
    context = info.get("context_length")
    plan = Plan(settings, renderer, records, conversations, skipped, journal, done,
                engine=f"{info.get('engine', 'sglang')} {info.get('version', '?')}" if info else "?",
                context_length=int(context) if isinstance(context, int) and context > 0 else None)
    plan.todo = [c for c in conversations if c.key not in done]
    return plan


def _dataset_facts(cfg: RegenerateConfig) -> dict:
    from eagle3_pipeline.checksum import file_sha256  # noqa: PLC0415

    return {"name": cfg.dataset.name, "sha256": file_sha256(cfg.dataset), "num_samples_limit": cfg.num_samples}


def part_texts(cfg: RegenerateConfig, plan: Plan) -> tuple[str, str]:
    """The part's conversations and summary as they are written once every conversation is done."""
    finished = [plan.done[c.key] for c in plan.conversations if c.key in plan.done]
    return output.part_documents(cfg.part[0], cfg.part[1], plan.records, finished, plan.skipped,
                                 _dataset_facts(cfg))


class Progress(ProgressReporter):
    """The part's progress file and line: conversations done of this part's, turns, generated tokens/s."""

    def __init__(self, cfg: RegenerateConfig, plan: Plan):
        index, count = cfg.part
        super().__init__(output.part_path(cfg.output_dir, index, count, ".progress.json"), cfg.quiet, "regenerate")
        self.part = f"{index}/{count}"
        self.total = len(plan.conversations)
        self.done = len(plan.done)
        self.skipped = len(plan.skipped) + sum(1 for r in plan.done.values() if r["status"] != "ok")
        self.turns = sum(r.get("turns", 0) for r in plan.done.values())
        self.tokens_before = sum(r.get("generated_tokens", 0) for r in plan.done.values())
        self.tokens_now = 0
        self.done_now = 0
        self.started = time.time()
        self._clock = time.monotonic()
        self.state = "running"
        self.message = ""

    def document(self) -> dict:
        elapsed = max(time.monotonic() - self._clock, 1e-9)
        left = self.total - self.done
        per_conversation = elapsed / self.done_now if self.done_now else None
        return {
            "state": self.state, "part": self.part, "pid": os.getpid(), "unit": "conversations",
            "total": self.total, "done": self.done, "skipped": self.skipped, "failed": 0, "turns": self.turns,
            "tokens": self.tokens_before + self.tokens_now, "tokens_per_s": round(self.tokens_now / elapsed, 1),
            "eta_s": 0.0 if left <= 0 else (round(left * per_conversation, 1) if per_conversation else None),
            "started": self.started, "updated": time.time(), "message": self.message,
        }

    def line(self) -> str:
        doc = self.document()
        width = 30
        filled = int(width * doc["done"] / self.total) if self.total else width
        eta = doc["eta_s"]
        eta_text = "?" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta))
        return (f"[regenerate {self.part}] [{'#' * filled}{'.' * (width - filled)}] {doc['done']}/{self.total} "
                f"conversations, {self.skipped} skipped, {self.turns} turns, {doc['tokens_per_s']:,.0f} tokens/s, "
                f"{eta_text} left")


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
        from eagle3_pipeline.extract.client import EngineError  # noqa: PLC0415

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
        from eagle3_pipeline.extract.client import EngineError  # noqa: PLC0415
        from eagle3_pipeline.regenerate.conversation import (  # noqa: PLC0415
            ConversationSkipped,
            NotAnswered,
            regenerate_conversation,
        )

        base = {"key": conversation.key, "ordinal": conversation.ordinal, "line": conversation.line,
                "id": conversation.sample_id}
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


def _run_conversations(cfg: RegenerateConfig, plan: Plan, worker: ConversationWorker, progress: Progress) -> int:
    """Step 3: the conversations through a thread pool; journal and progress on this thread."""
    from eagle3_pipeline.extract.client import ServerUnreachable  # noqa: PLC0415

    def count(record: dict) -> None:
        plan.done[record["key"]] = record
        progress.done += 1
        progress.done_now += 1
        if record["status"] == "ok":
            progress.turns += record["turns"]
            progress.tokens_now += record["generated_tokens"]
        else:
            progress.skipped += 1

    outcome = run_window(plan.todo, worker, cfg.concurrency, plan.journal, count, worker.stopping,
                         progress.update, "conversation")
    fatal = outcome.fatal
    if fatal is not None:
        progress.state = "failed"
        code = EXIT_UNREACHABLE if isinstance(fatal, ServerUnreachable) else EXIT_FAILED
        progress.message = str(fatal) if isinstance(fatal, ServerUnreachable) else (
            f"{type(fatal).__name__}: {fatal}; the {progress.done} conversations done are kept: fix the cause and "
            "rerun to continue")
        progress.update(force=True)
        print(f"error: {progress.message}", file=sys.stderr)
        return code
    if outcome.stopped:
        progress.state = "stopped"
        progress.message = (f"stopped on request after {progress.done} of {progress.total} conversations; rerun to "
                            "continue")
        progress.update(force=True)
        _log(cfg, progress.message)
        return EXIT_STOPPED
    return EXIT_OK


def _client(cfg: RegenerateConfig):
    from eagle3_pipeline.extract.client import EngineClient  # noqa: PLC0415

    return EngineClient(cfg.server_url, cfg.api_key, cfg.request_timeout_s, cfg.retries)


def run_regeneration(cfg: RegenerateConfig) -> int:  # noqa: PLR0911 - one exit per outcome
    """The whole run; returns an exit code (see the module docstring), messages on stderr."""
    from eagle3_pipeline.extract import store  # noqa: PLC0415
    from eagle3_pipeline.extract.client import EngineError, ServerUnreachable  # noqa: PLC0415
    from eagle3_pipeline.extract.job import lock_part  # noqa: PLC0415

    client = _client(cfg)
    try:
        plan = make_plan(cfg, client, dry=True)
        if _finished(cfg, plan):  # nothing to do: nothing is written, not even the lock or the progress
            _log(cfg, f"part {cfg.part[0]}/{cfg.part[1]}: all {len(plan.conversations)} conversations done already "
                      f"({cfg.output_dir / output.OUTPUT_FILE if cfg.part[1] == 1 and cfg.merge else 'part files'} "
                      "up to date): nothing to do")
            return EXIT_OK
        # A directory that does not exist yet has no run on it: it is locked once created,
        # after the checks (a refused run leaves nothing behind). Planned again under the lock,
        # which may repair a journal line torn by a kill.
        lock = lock_part(cfg, "regeneration") if cfg.output_dir.exists() else None
        plan = make_plan(cfg, client)
    except ServerUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (OSError, ValueError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    index, count = cfg.part
    _log(cfg, f"part {index}/{count}: {plan.records} records, {len(plan.conversations)} conversations, "
              f"{len(plan.skipped)} skipped, {len(plan.done)} already done, {len(plan.todo)} to regenerate "
              f"with {client.url} ({plan.engine}; temperature {cfg.temperature}, max_new_tokens "
              f"{cfg.max_new_tokens}, on_length {cfg.on_length}, max_length {cfg.max_length})")
    if plan.skipped:
        reasons = Counter(s["reason"] for s in plan.skipped)
        _log(cfg, "skipped: " + ", ".join(f"{n} {r}" for r, n in reasons.most_common()))
    try:
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        lock = lock or lock_part(cfg, "regeneration")
        store.claim_settings(cfg.output_dir, plan.settings, file_name=output.SETTINGS_FILE,
                             what="conversations regenerated")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    progress = Progress(cfg, plan)
    progress.update(force=True)
    outcome = EXIT_OK
    if plan.todo:
        worker = ConversationWorker(cfg, plan, client)
        outcome = _run_conversations(cfg, plan, worker, progress)
    plan.journal.close()
    del lock
    if outcome != EXIT_OK:
        return outcome
    texts = part_texts(cfg, plan)
    written = sum(1 for r in plan.done.values() if r["status"] == "ok")
    if plan.records and not written:
        progress.state, progress.message = "failed", (
            f"no conversation of part {index}/{count} could be regenerated ({plan.records} records, every one left "
            f"out; see {output.PARTS_DIR}/{store.part_name(index, count)}.journal.jsonl and the skips above)")
        progress.update(force=True)
        print(f"error: {progress.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    output.write_part(cfg.output_dir, index, count, texts)
    message = (f"part {index}/{count} complete: {written} conversations regenerated, "
               f"{progress.skipped} skipped, {progress.turns} turns")
    if count == 1 and cfg.merge:
        summary, _ = output.merge(cfg.output_dir)
        message += f"; {output.OUTPUT_FILE}: {summary['num_conversations']} conversations"
    progress.state, progress.message = "done", message
    progress.update(force=True)
    _log(cfg, message)
    return EXIT_OK


def _finished(cfg: RegenerateConfig, plan: Plan) -> bool:
    """Whether this part is done and written (and merged, when this run would merge)."""
    index, count = cfg.part
    if plan.todo or not output.part_is_written(cfg.output_dir, index, count, part_texts(cfg, plan)):
        return False
    return count > 1 or not cfg.merge or output.is_merged(cfg.output_dir)


def check_status(cfg: RegenerateConfig) -> dict:
    """``--check``: what a run would do, asking nothing of the server when ``--model-path`` is given."""
    plan = make_plan(cfg, None if cfg.model_path else _client(cfg), dry=True)
    index, count = cfg.part
    complete = not plan.todo and output.part_is_written(cfg.output_dir, index, count, part_texts(cfg, plan))
    return {
        "part": f"{index}/{count}",
        "records": plan.records,
        "conversations": len(plan.conversations),
        "skipped": len(plan.skipped),
        "done": len(plan.done),
        "todo": len(plan.todo),
        "complete": complete,
        "merged": complete and output.is_merged(cfg.output_dir),
        "output": str(cfg.output_dir / output.OUTPUT_FILE),
    }


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline regenerate``."""
    parser.add_argument("--dataset", type=path_arg, required=True,
                        help="JSONL, or one JSON array: ShareGPT conversations or OpenAI messages")
    parser.add_argument("--output-dir", type=path_arg, required=True)
    parser.add_argument("--server-url", required=True, help="http://HOST:PORT of the serving server")
    parser.add_argument("--part", default="0/1", help="K/N: this host's share (records with ordinal %% N == K)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer at most")
    parser.add_argument("--on-length", choices=["keep", "cut", "drop"], default="keep",
                        help="an answer that hits --max-new-tokens: keep it and go on, cut the conversation after "
                        "it, or drop the conversation")
    parser.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH,
                        help="stop a conversation once it renders to this many tokens (the extraction's "
                        "--max-length: it cuts there anyway)")
    parser.add_argument("--concurrency", type=int, default=64, help="conversations in flight (one request each)")
    parser.add_argument("--num-samples", type=int, help="only the first N records (default: all)")
    parser.add_argument("--api-key-file", type=path_arg, help="a file whose first line is the server's API key")
    parser.add_argument("--model-path", type=path_str,
        help="the target model directory here, for the tokenizer and chat template "
                        "(default: the server's model_path)")
    parser.add_argument("--chat-template", type=path_arg, help="a Jinja chat template file instead of the tokenizer's "
                        "(the extraction's --chat-template, when it has one)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow the tokenizer's own code (Kimi's tiktoken tokenizer needs it)")
    parser.add_argument("--retries", type=int, default=5, help="retries of a request on transient failures")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--check", action="store_true", help="print what a run would do as JSON; ask nothing "
                        "(no server needed with --model-path)")
    parser.add_argument("--no-merge", action="store_true", help="do not merge into regenerated.jsonl at the end")
    parser.add_argument("--quiet", action="store_true")


def config_from_args(args: argparse.Namespace) -> RegenerateConfig:
    """The run's settings from the command line; ValueError naming the option that is wrong."""
    from eagle3_pipeline.extract.store import parse_part  # noqa: PLC0415

    api_key = None
    if args.api_key_file is not None:
        try:
            api_key = args.api_key_file.read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read a key from it ({exc or 'empty'})") \
                from None
        if not api_key:
            raise ValueError(f"--api-key-file {args.api_key_file}: its first line is empty")
    for name in ("max_new_tokens", "max_length", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.retries < 0:
        raise ValueError("--retries must not be negative")
    if not 0 <= args.temperature < 100:
        raise ValueError(f"--temperature must be between 0 (greedy) and 100, got {args.temperature}")
    if args.num_samples is not None and args.num_samples < 1:
        raise ValueError("--num-samples must be at least 1")
    return RegenerateConfig(
        dataset=args.dataset, output_dir=args.output_dir, server_url=args.server_url, api_key=api_key,
        model_path=args.model_path, chat_template=args.chat_template, num_samples=args.num_samples,
        part=parse_part(args.part), temperature=args.temperature, max_new_tokens=args.max_new_tokens,
        on_length=args.on_length, max_length=args.max_length, concurrency=args.concurrency, retries=args.retries,
        request_timeout_s=args.request_timeout_s, merge=not args.no_merge, quiet=args.quiet,
        trust_remote_code=args.trust_remote_code,
    )


def run(args: argparse.Namespace) -> int:
    """``eagle3-pipeline regenerate``."""
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.check:
        from eagle3_pipeline.extract.client import ServerUnreachable  # noqa: PLC0415

        try:
            print(json.dumps(check_status(cfg), sort_keys=True))
        except ServerUnreachable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return EXIT_OK
    return run_regeneration(cfg)


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
