"""The embedded tiny target model: a small Llama trained on the CPU from the stdlib's docstrings.

It stands in for the served target (Kimi-K2.5 in production) wherever no GPU and no download
is allowed: tests, CI, ``make demo``. It is a real Hugging Face model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json) with grouped-query attention and an untied ``lm_head``, trained just
long enough that its predictions are far from uniform, so a drafter trained on its hidden
states has something to learn.

The build is deterministic (fixed seeds, deterministic algorithms, fixed thread count, sorted
corpus) and cached: ``.build.json`` holds a hash of the whole recipe (hyperparameters, corpus
fingerprint, library versions); a directory whose stamp matches is returned as is. The build
happens in a temporary directory beside the output and is renamed into place only when
complete, so a crash never leaves a directory that looks built.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.cli_args import path_arg
from eagle3_pipeline.data.demo_dataset import build_conversation, is_demo_subject, sharegpt_to_messages
from eagle3_pipeline.data.stdlib_corpus import DocEntry, corpus_fingerprint, extract_entries, stdlib_source_files

# Bump whenever the build below changes in a way the hyperparameters do not show.
RECIPE_VERSION = 1
STAMP_NAME = ".build.json"
# The training seed of a build whose caller names none (``tiny-model --seed`` and ``recipe`` win): a
# model built from another seed answers differently, which is how the tests are shown to hold for any
# model the build can make (``make test-seeds``).
SEED_ENV = "EAGLE3_TINY_SEED"

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
END_TOKEN = "<|end|>"  # ends every turn; the model's eos
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
ROLE_TOKENS = (SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, END_TOKEN, *ROLE_TOKENS)  # ids 0..5, in this order

# Each turn is "<|role|>\n{content}<|end|>\n"; an assistant's tokens are those after
# "<|assistant|>\n" up to and including the next "<|end|>" (see assistant_token_spans).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that decides the built model's bytes, besides the corpus and library versions."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # < heads: grouped-query attention, as in the real targets
    intermediate_size: int = 704
    max_position_embeddings: int = 2048
    seq_len: int = 256
    batch_size: int = 4
    steps: int = 400
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    chat_fraction: float = 0.5  # share of documented objects seen as a chat conversation
    eval_fraction: float = 0.05  # documented objects never trained on, for the accuracy check
    eval_tokens: int = 16384
    seed: int = 0
    threads: int = 2  # fixed, so the weights do not depend on the machine's core count


def seed_from_env() -> int:
    """The seed ``$EAGLE3_TINY_SEED`` asks for (0 when unset); a value that is no integer >= 0 is refused."""
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"{SEED_ENV}={value!r}: the tiny model's seed must be an integer >= 0 (unset it for 0)")
    return int(value)


def default_recipe() -> TinyRecipe:
    """The recipe of a build that names none: the default one, with the seed of ``$EAGLE3_TINY_SEED``."""
    return dataclasses.replace(TinyRecipe(), seed=seed_from_env())


def cache_name(seed: int) -> str:
    """The directory name a checkout's cache gives the build of ``seed``: tiny-llama, or tiny-llama-seed-N.

    One directory per seed, so that builds of several seeds never rebuild over one another.
    """
    return "tiny-llama" if seed == 0 else f"tiny-llama-seed-{seed}"


def _log(message: str) -> None:
    print(f"[tiny-model] {message}", file=sys.stderr, flush=True)


def is_evaluation_entry(entry: DocEntry, recipe: TinyRecipe | None = None) -> bool:
    """Whether ``entry`` is held out of the tiny model's training (a stable hash of its name)."""
    fraction = (recipe or TinyRecipe()).eval_fraction
    return int(hashlib.sha256(entry.name.encode()).hexdigest()[:8], 16) < fraction * 2**32


def entry_text(entry: DocEntry) -> str:
    """An entry as plain training text: its name and signature, a blank line, its docstring."""
    return f"{entry.name}{entry.signature}\n\n{entry.docstring}\n"


def assistant_token_spans(input_ids: list[int], assistant_id: int, end_id: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each assistant turn's tokens in a rendered conversation.

    A span starts after ``<|assistant|>`` and its newline, and ends after the turn's ``<|end|>``
    (included: the model must learn to stop). A turn left open by ``add_generation_prompt`` or
    truncation runs to the end.
    """
    spans = []
    for i, token in enumerate(input_ids):
        if token == assistant_id:
            start = min(i + 2, len(input_ids))
            stop = next((j + 1 for j in range(start, len(input_ids)) if input_ids[j] == end_id), len(input_ids))
            spans.append((start, stop))
    return spans


def recipe_fingerprint(recipe: TinyRecipe, corpus_hash: str) -> dict:
    """What the stamp records and hashes: the recipe, the corpus, and the versions that shape the weights."""
    import tokenizers  # noqa: PLC0415 - keep `eagle3-pipeline --help` fast
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    return {
        "recipe_version": RECIPE_VERSION,
        "recipe": dataclasses.asdict(recipe),
        "corpus_sha256": corpus_hash,
        "chat_template": CHAT_TEMPLATE,
        "special_tokens": list(SPECIAL_TOKENS),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }


def _hash(document: dict) -> str:
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def read_stamp(output_dir: Path) -> dict | None:
    """The build stamp of ``output_dir``, or None where there is none (or it does not parse)."""
    try:
        return json.loads((Path(output_dir) / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def is_built(output_dir: Path, recipe_hash: str, fingerprint: dict | None = None) -> bool:
    """Whether ``output_dir`` holds a complete build of the recipe with this hash (files of the recorded sizes).

    ``fingerprint``: instead of the hash, a build whose stamp records this fingerprint but for its
    library versions also counts (the same recipe and corpus, built under other releases).
    """
    stamp = read_stamp(output_dir)
    if fingerprint is not None:
        if not stamp or any(stamp.get(key) != value for key, value in fingerprint.items() if key != "versions"):
            return False
    elif not stamp or stamp.get("recipe_sha256") != recipe_hash:
        return False
    sizes = {name: record.get("size") for name, record in stamp.get("files", {}).items()}
    paths = [Path(output_dir) / name for name in MODEL_FILES]
    return all(path.is_file() and path.stat().st_size == sizes.get(path.name) for path in paths)


@contextlib.contextmanager
def _deterministic_torch(threads: int):
    import torch  # noqa: PLC0415

    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


def _train_tokenizer(texts: list[str], recipe: TinyRecipe, out: Path):
    """Byte-level BPE over ``texts``; writes tokenizer.json and tokenizer_config.json; returns the HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    if tokenizer.get_vocab_size() != recipe.vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, the recipe asks {recipe.vocab_size}")
    tokenizer.save(str(out / "tokenizer.json"))
    # Written by hand, in the form both transformers 4.x (SGLang's) and 5.x read: the class
    # name 5.x would write ("TokenizersBackend") does not exist in 4.x.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": END_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": list(ROLE_TOKENS),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": recipe.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": END_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return AutoTokenizer.from_pretrained(str(out), local_files_only=True)


def _documents(entries: list[DocEntry], tokenizer, recipe: TinyRecipe) -> list[list[int]]:
    """Token ids of each entry: as a chat conversation (``chat_fraction`` of them) or as plain text."""
    rng = random.Random(recipe.seed)
    texts = []
    for i, entry in enumerate(entries):
        if is_demo_subject(entry) and rng.random() < recipe.chat_fraction:
            conversation = build_conversation(entry, rng, f"tiny-{i}")
            texts.append(tokenizer.apply_chat_template(sharegpt_to_messages(conversation), tokenize=False))
        else:
            texts.append(BOS_TOKEN + entry_text(entry))
    return [encoding.ids for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def _pack(documents: list[list[int]], seq_len: int):
    """Documents concatenated and cut into rows of ``seq_len`` tokens (the tail is dropped): [N, seq_len]."""
    import torch  # noqa: PLC0415

    flat = torch.tensor([token for document in documents for token in document], dtype=torch.long)
    rows = flat.numel() // seq_len
    return flat[: rows * seq_len].view(rows, seq_len)


def _learning_rate(step: int, recipe: TinyRecipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return recipe.learning_rate * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


def _train(model, rows, recipe: TinyRecipe) -> float:
    """Next-token training on shuffled rows for ``recipe.steps`` steps; returns the mean loss of the last 10."""
    import torch  # noqa: PLC0415

    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay, betas=(0.9, 0.95)
    )
    order = torch.randperm(rows.shape[0], generator=generator)
    cursor, recent = 0, []
    model.train()
    started = time.monotonic()
    for step in range(recipe.steps):
        if cursor + recipe.batch_size > order.numel():  # next epoch, reshuffled
            order, cursor = torch.randperm(rows.shape[0], generator=generator), 0
        batch = rows[order[cursor : cursor + recipe.batch_size]]  # [B, T]
        cursor += recipe.batch_size
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, recipe)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent = [*recent[-9:], loss.item()]
        if (step + 1) % max(1, recipe.steps // 6) == 0 or step + 1 == recipe.steps:
            _log(f"train step {step + 1}/{recipe.steps}: loss {loss.item():.3f} ({time.monotonic() - started:.0f}s)")
    model.eval()
    return sum(recent) / len(recent)


def evaluate_next_token(model, rows) -> dict:
    """Mean loss and greedy top-1 accuracy of next-token prediction over rows [N, T]."""
    import torch  # noqa: PLC0415

    correct = total = 0
    loss_sum = 0.0
    with torch.no_grad():
        for row in rows.split(8):
            logits = model(input_ids=row).logits[:, :-1]  # [B, T-1, V]
            targets = row[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            loss_sum += loss.item()
            correct += (logits.argmax(-1) == targets).sum().item()
            total += targets.numel()
    return {"loss": loss_sum / total, "top1_accuracy": correct / total, "tokens": total}


def _stamp(out: Path, fingerprint: dict, metrics: dict) -> None:
    files = {}
    for name in MODEL_FILES:
        data = (out / name).read_bytes()
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    stamp = {"recipe_sha256": _hash(fingerprint), **fingerprint, "files": files, "metrics": metrics}
    (out / STAMP_NAME).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")


def _build_into(out: Path, recipe: TinyRecipe, fingerprint: dict, files: list) -> None:
    import torch  # noqa: PLC0415
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    started = time.monotonic()
    entries = extract_entries(files)
    train_entries = [entry for entry in entries if not is_evaluation_entry(entry, recipe)]
    eval_entries = [entry for entry in entries if is_evaluation_entry(entry, recipe)]
    _log(f"corpus: {len(train_entries)} documented objects to train on, {len(eval_entries)} held out")

    tokenizer = _train_tokenizer([entry_text(entry) for entry in train_entries], recipe, out)
    _log(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens ({time.monotonic() - started:.0f}s)")

    rows = _pack(_documents(train_entries, tokenizer, recipe), recipe.seq_len)  # [N, T]
    eval_rows = _pack(
        [tokenizer.encode(BOS_TOKEN + entry_text(entry), add_special_tokens=False) for entry in eval_entries],
        recipe.seq_len,
    )[: max(1, recipe.eval_tokens // recipe.seq_len)]
    trained_tokens = recipe.steps * recipe.batch_size * recipe.seq_len
    epochs = trained_tokens / rows.numel()
    _log(f"data: {rows.numel()} training tokens ({epochs:.2f} epochs), {eval_rows.numel()} held out")

    ids = tokenizer.convert_tokens_to_ids
    config = LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=ids(BOS_TOKEN),
        eos_token_id=ids(END_TOKEN),
        pad_token_id=ids(PAD_TOKEN),
    )
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    _log(f"model: Llama, {parameters / 1e6:.2f} M parameters; training {recipe.steps} steps")
    final_loss = _train(model, rows, recipe)

    held_out = evaluate_next_token(model, eval_rows)
    # The share of the most frequent training token: what a model ignoring its context gets.
    counts = torch.bincount(rows.flatten(), minlength=recipe.vocab_size)
    unigram = (eval_rows[:, 1:] == counts.argmax()).float().mean().item()
    metrics = {
        "final_train_loss": round(final_loss, 4),
        "uniform_loss": round(math.log(recipe.vocab_size), 4),
        "held_out_loss": round(held_out["loss"], 4),
        "held_out_top1_accuracy": round(held_out["top1_accuracy"], 4),
        "held_out_unigram_top1_accuracy": round(unigram, 4),
        "held_out_tokens": held_out["tokens"],
        "parameters": parameters,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    _log(
        f"held out: loss {metrics['held_out_loss']:.3f} (uniform {metrics['uniform_loss']:.3f}), top-1 "
        f"{metrics['held_out_top1_accuracy']:.1%} (most frequent token alone: {unigram:.1%})"
    )

    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    ).save_pretrained(str(out))
    _stamp(out, fingerprint, metrics)
    # mkdtemp makes the directory private, and some writers their files: a server running as
    # another user must be able to read the model, as with any directory the user creates.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o777 & ~umask)
    for path in out.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_abandoned_builds(output_dir: Path) -> None:
    """Delete temporary build directories of ``output_dir`` left by processes that are gone (killed builds)."""
    for path in output_dir.parent.glob(f".{output_dir.name}.building-*"):
        pid = path.name.rsplit(".building-", 1)[1].split("-", 1)[0]
        if not pid.isdigit() or _process_exists(int(pid)):
            continue  # a build in progress (or not ours to judge)
        _log(f"removing {path}, left by a build that did not finish (process {pid} is gone)")
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _build_lock():
    """Hold this user's tiny-model build lock: one build at a time on a machine.

    Two builds at once are each an OpenMP team spinning on the same few cores: both take several
    times longer than one after the other. A build that waited finds the directory it wanted
    may now be built, and returns it.
    """
    import fcntl  # noqa: PLC0415 - POSIX only, like the rest of the pipeline's hosts

    path = Path(tempfile.gettempdir()) / f"eagle3-pipeline-tiny-model-{os.getuid()}.lock"
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another tiny-model build on this machine to finish (lock {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock; so does the process's death


def build_tiny_model(output_dir: Path, *, force: bool = False, recipe: TinyRecipe | None = None,
                     any_versions: bool = False) -> Path:
    """Build the tiny model into ``output_dir`` unless a build of the same recipe is there; return its path.

    ``recipe``: the default one with the seed of ``$EAGLE3_TINY_SEED`` when not given. ``force`` rebuilds
    anyway. An existing directory that is not a tiny-model build (no stamp)
    and is not empty is refused rather than replaced. ``any_versions``: a build of the same recipe
    and corpus made under other library versions is taken as it is, for a caller that only loads
    the checkpoint (tests under another transformers release); without it, other versions rebuild.
    """
    if not str(output_dir).strip():
        raise ValueError("no output directory given for the tiny model (an empty path)")
    output_dir = Path(output_dir).absolute()
    recipe = recipe or default_recipe()
    files = stdlib_source_files()
    fingerprint = recipe_fingerprint(recipe, corpus_fingerprint(files))
    if not force and is_built(output_dir, _hash(fingerprint)):
        _log(f"cached: {output_dir} matches the recipe")
        return output_dir
    if not force and any_versions and is_built(output_dir, "", fingerprint=fingerprint):
        _log(f"cached: {output_dir} matches the recipe (built under other library versions: "
             f"{read_stamp(output_dir)['versions']})")
        return output_dir
    with _build_lock():
        if not force and is_built(output_dir, _hash(fingerprint)):  # built by the build we waited for
            _log(f"cached: {output_dir} matches the recipe")
            return output_dir
        if output_dir.exists() and read_stamp(output_dir) is None and any(output_dir.iterdir()):
            raise FileExistsError(
                f"{output_dir} exists and is not a tiny-model build (no {STAMP_NAME}); "
                "remove it or choose another --output"
            )
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_builds(output_dir)
        _log(f"building {output_dir} (recipe {_hash(fingerprint)[:12]})")
        tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.building-{os.getpid()}-", dir=output_dir.parent))
        try:
            with _deterministic_torch(recipe.threads):
                _build_into(tmp, recipe, fingerprint, files)
            if output_dir.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
                os.replace(output_dir, old / "model")
                os.replace(tmp, output_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, output_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _log(f"built: {output_dir}")
    return output_dir


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline tiny-model``."""
    parser.add_argument("--output", type=path_arg,
        required=True, metavar="DIR", help="model directory to build or reuse")
    parser.add_argument("--force", action="store_true", help="rebuild even when a matching build is there")
    parser.add_argument(
        "--seed", type=int, default=None, metavar="N",
        help=f"training seed of the build (default: ${SEED_ENV}, else 0); part of the recipe, so another seed "
             "rebuilds: give each seed its own --output",
    )


def run(args: argparse.Namespace) -> int:
    """Build (or reuse) the model and print its directory."""
    try:
        recipe = default_recipe() if args.seed is None else dataclasses.replace(TinyRecipe(), seed=args.seed)
        path = build_tiny_model(args.output, force=args.force, recipe=recipe)
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
