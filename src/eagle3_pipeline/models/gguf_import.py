"""A GGUF model file (llama.cpp's format) turned into a plain Hugging Face checkpoint directory, checked.

The pipeline's engines (SGLang, the reference engine) and its steps (the extraction's check,
the training's embeddings) read Hugging Face checkpoints. A model that comes as a GGUF file
is read with transformers (``from_pretrained(..., gguf_file=...)``, which dequantizes every
tensor into float32, exactly), rebuilt as the same model class from its configuration without
the GGUF quantization settings, and saved with its tokenizer, chat template and generation
config in the chosen dtype.

Before it counts, the checkpoint is loaded back and checked against the GGUF-loaded model on
a few prompts: the tokenizers must give the same ids, the logits must agree within what
rounding the weights to the chosen dtype allows, and the greedy next token must be the same
at every position where the GGUF model's top two are further apart than that rounding.

The directory appears whole or not at all (built beside it, renamed into place:
``eagle3_pipeline.atomic_dir``), and ``.import-gguf.json`` in it records the GGUF's SHA-256
and the settings: a second run with the same input changes nothing; a different input is
refused unless ``--force``; a directory that is not a conversion is never replaced.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import signal
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

from eagle3_pipeline.atomic import atomic_write_text
from eagle3_pipeline.atomic_dir import abandoned, directory_lock, remove_abandoned, staged_directory
from eagle3_pipeline.checksum import file_sha256
from eagle3_pipeline.cli_args import path_arg

RECORD_NAME = ".import-gguf.json"
# Bump when the conversion below changes what it writes for the same GGUF and settings.
RECIPE_VERSION = 1
DTYPES = ("bfloat16", "float32", "float16")
DEFAULT_DTYPE = "bfloat16"
# What reading a GGUF with transformers needs beyond torch and transformers; the same pins as
# pyproject.toml's `gguf` extra.
REQUIREMENTS = {"gguf": "gguf==0.19.0", "accelerate": "accelerate==1.15.0"}
# Largest logit difference allowed between the checkpoint and the GGUF-loaded model (both run in
# float32), relative to the largest logit. float32 holds the dequantized weights exactly (only
# kernel order differs, ~1e-6); bfloat16 (8 significant bits) and float16 (11) round each weight
# by up to 2^-9 and 2^-12 of itself, which through a few dozen layers moves the logits by ~1e-2
# and ~1e-3 of the largest (SmolLM2-135M, 30 layers: 7.7e-3 and 1.1e-3). A wrong conversion
# (a permuted or missing tensor) moves them by order 1.
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
# Prompts of the check, in no model's particular format; the chat template (when the GGUF has
# one) adds a conversation, and a spread of token ids reaches rows that text may miss.
CHECK_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Water boils at 100 degrees Celsius at sea level, and",
)
CHECK_CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]
CHECK_MAX_TOKENS = 64
GGUF_MAGIC = b"GGUF"

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 4


class GgufImportError(Exception):
    """The conversion cannot be done or did not check out; the message names the file, the cause and the fix."""

    exit_code = EXIT_FAILED


class BadInput(GgufImportError):
    """The input or the settings are wrong (missing file, not a GGUF, unreadable architecture, another
    conversion in the way): nothing was written."""

    exit_code = EXIT_BAD_INPUT


class Stopped(BaseException):
    """SIGTERM arrived: the conversion was abandoned, nothing written at the output.

    Raised by the signal handler wherever the conversion is, often inside transformers: a
    BaseException (as KeyboardInterrupt), so that no library's ``except Exception`` takes it for an
    error of its own and goes on, or turns it into another error.
    """

    exit_code = EXIT_STOPPED


def _log(message: str) -> None:
    print(f"[import-gguf] {message}", file=sys.stderr, flush=True)


# -- the GGUF header ------------------------------------------------------------------------

# GGUF metadata value types (the format's spec): fixed sizes, string = 8, array = 9.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass
class GgufHeader:
    """What the start of a GGUF file says about it."""

    version: int
    tensor_count: int
    architecture: str | None
    name: str | None
    size: int


def _read_exact(handle, count: int, path: Path) -> bytes:
    data = handle.read(count)
    if len(data) != count:
        raise BadInput(f"{path}: the GGUF header ends early (truncated or damaged file); download it again")
    return data


def _read_string(handle, path: Path) -> str:
    (length,) = struct.unpack("<Q", _read_exact(handle, 8, path))
    return _read_exact(handle, length, path).decode("utf-8", errors="replace")


def _skip_value(handle, value_type: int, path: Path) -> None:
    if value_type in _SCALAR_SIZES:
        _read_exact(handle, _SCALAR_SIZES[value_type], path)
    elif value_type == _STRING:
        (length,) = struct.unpack("<Q", _read_exact(handle, 8, path))
        handle.seek(length, 1)
    elif value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", _read_exact(handle, 12, path))
        if item_type in _SCALAR_SIZES:
            handle.seek(count * _SCALAR_SIZES[item_type], 1)
        else:
            for _ in range(count):
                _skip_value(handle, item_type, path)
    else:
        raise BadInput(f"{path}: unknown GGUF metadata value type {value_type} (damaged file, or a GGUF version "
                       "newer than this reader); download it again or re-export it with a current llama.cpp")


def read_gguf_header(path: str | Path) -> GgufHeader:
    """Version, tensor count, ``general.architecture`` and ``general.name`` of a GGUF file, read from its
    first bytes (the metadata up to those keys); ``BadInput`` when it is missing or not a GGUF file."""
    path = Path(path)
    if not path.exists():
        raise BadInput(f"--gguf {path}: no such file; give the path of a .gguf model file")
    if not path.is_file():
        raise BadInput(f"--gguf {path}: not a regular file; give the path of a .gguf model file")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        magic = handle.read(4)
        if magic != GGUF_MAGIC:
            raise BadInput(f"--gguf {path}: not a GGUF file (it starts with {magic!r}, a GGUF file with "
                           f"{GGUF_MAGIC!r}); give a .gguf model file (for a Hugging Face directory no import "
                           "is needed: point the pipeline at it)")
        (version,) = struct.unpack("<I", _read_exact(handle, 4, path))
        if version > 0xFFFF:
            raise BadInput(f"--gguf {path}: a big-endian GGUF file, which transformers does not read; use the "
                           "little-endian export of the model")
        if version < 2:
            raise BadInput(f"--gguf {path}: GGUF version {version} is too old for transformers' reader (2 or "
                           "later); re-export the model with a current llama.cpp")
        tensor_count, kv_count = struct.unpack("<QQ", _read_exact(handle, 16, path))
        found: dict[str, str] = {}
        for _ in range(kv_count):
            key = _read_string(handle, path)
            (value_type,) = struct.unpack("<I", _read_exact(handle, 4, path))
            if key in ("general.architecture", "general.name") and value_type == _STRING:
                found[key] = _read_string(handle, path)
                if len(found) == 2:
                    break
            else:
                _skip_value(handle, value_type, path)
    return GgufHeader(version, tensor_count, found.get("general.architecture"), found.get("general.name"), size)


def missing_requirements() -> list[str]:
    """The pinned requirements (``REQUIREMENTS``) whose packages this Python cannot import."""
    return [pin for module, pin in REQUIREMENTS.items() if importlib.util.find_spec(module) is None]


def check_requirements() -> None:
    """``BadInput`` naming the pip command when gguf or accelerate is not installed."""
    missing = missing_requirements()
    if missing:
        names = ", ".join(pin.split("==")[0] for pin in missing)
        raise BadInput(
            f"reading a GGUF file with transformers needs the Python package(s) {names}, not installed in "
            f"{sys.prefix}; install them with: {sys.executable} -m pip install {' '.join(missing)} "
            "(or install this package with its extra: eagle3-pipeline[gguf])"
        )


# -- the record, and what a run would do ----------------------------------------------------


def read_record(output_dir: str | Path) -> dict | None:
    """The conversion record of ``output_dir``, or None when it has none (or an unreadable one)."""
    try:
        record = json.loads((Path(output_dir) / RECORD_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _identity(record: dict) -> tuple:
    return record.get("recipe_version"), record.get("gguf", {}).get("sha256"), record.get("settings", {}).get("dtype")


def _damage(output_dir: Path, record: dict) -> str | None:
    """What is wrong with the recorded files (missing, other size), or None when all are there."""
    for name, entry in sorted(record.get("files", {}).items()):
        path = output_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("size"):
            return f"{name} has {path.stat().st_size} bytes, {entry.get('size')} recorded"
    return None if record.get("files") else "its record lists no files"


@dataclass
class ImportPlan:
    """What a run would do: ``action`` is "none" (up to date) or "convert", with the reason."""

    action: str
    reason: str
    output: str
    gguf: str
    gguf_sha256: str
    dtype: str
    architecture: str | None
    abandoned: list[str] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        """Whether a run would change anything on disk."""
        return self.action == "convert" or bool(self.abandoned)


def inspect_gguf(gguf_file: str | Path) -> tuple[GgufHeader, str]:
    """(header, SHA-256) of a GGUF file; ``BadInput`` when it is missing, not a GGUF, or cannot be read here."""
    gguf_file = Path(gguf_file).absolute()
    header = read_gguf_header(gguf_file)
    if header.architecture is None:
        raise BadInput(f"--gguf {gguf_file}: the GGUF metadata has no general.architecture; transformers cannot "
                       "tell which model it holds (re-export it with a current llama.cpp)")
    check_requirements()
    _log(f"{gguf_file}: GGUF v{header.version}, architecture {header.architecture}"
         f"{f' ({header.name})' if header.name else ''}, {header.tensor_count} tensors, {header.size / 1e6:.1f} MB; "
         "hashing it")
    return header, file_sha256(gguf_file)


def plan_import(gguf_file: str | Path, output_dir: str | Path, *, dtype: str = DEFAULT_DTYPE,
                force: bool = False, inspected: tuple[GgufHeader, str] | None = None) -> ImportPlan:
    """What ``import_gguf`` with these arguments would do, changing nothing; ``BadInput`` when it would refuse.

    ``inspected`` is ``inspect_gguf(gguf_file)`` when already known (hashing a large file takes a while).
    """
    gguf_file, output_dir = Path(gguf_file).absolute(), Path(output_dir).absolute()
    if dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype}: not one of {', '.join(DTYPES)}")
    header, sha256 = inspected or inspect_gguf(gguf_file)
    debris = [str(path) for _kind, path in abandoned(output_dir)]

    def plan(action: str, reason: str) -> ImportPlan:
        return ImportPlan(action, reason, str(output_dir), str(gguf_file), sha256, dtype, header.architecture, debris)

    if not output_dir.exists():
        return plan("convert", f"{output_dir} does not exist")
    if not output_dir.is_dir():
        raise BadInput(f"--output {output_dir}: exists and is not a directory; choose another --output")
    record = read_record(output_dir)
    if record is None:
        if any(output_dir.iterdir()):
            raise BadInput(f"--output {output_dir}: exists and is not a GGUF conversion (no {RECORD_NAME}); it is "
                           "never replaced, not even with --force: remove it or choose another --output")
        return plan("convert", f"{output_dir} is empty")
    return plan(*_over_a_conversion(output_dir, record, gguf_file, sha256, dtype, force))


def _over_a_conversion(output_dir: Path, record: dict, gguf_file: Path, sha256: str, dtype: str,
                       force: bool) -> tuple[str, str]:
    """(action, reason) for a run over the conversion ``record`` describes; ``BadInput`` when it is another
    file's (or dtype's) and ``force`` is off."""
    wanted = (RECIPE_VERSION, sha256, dtype)
    if _identity(record) == wanted:
        damage = _damage(output_dir, record)
        if damage is not None:
            return "convert", f"{output_dir} holds this conversion, damaged: {damage}"
        if force:
            return "convert", f"--force: converting again over {output_dir}"
        return "none", f"{output_dir} already holds this conversion (sha256 {sha256[:12]}, {dtype})"
    if _identity(record)[1:] == wanted[1:]:  # this file and dtype, converted by an older version of this code
        return "convert", (f"{output_dir} holds this conversion by recipe {record.get('recipe_version')}; "
                           f"converting again with recipe {RECIPE_VERSION}")
    had = record.get("gguf", {})
    before = (f"{had.get('path', '?')} (sha256 {str(had.get('sha256', '?'))[:12]}, "
              f"{record.get('settings', {}).get('dtype', '?')}, recipe {record.get('recipe_version', '?')})")
    if not force:
        raise BadInput(f"--output {output_dir}: holds a conversion of {before}; this run asks for {gguf_file} "
                       f"(sha256 {sha256[:12]}, {dtype}, recipe {RECIPE_VERSION}): pass --force to replace it, or "
                       "choose another --output")
    return "convert", f"--force: replacing the conversion of {before}"


# -- the conversion -------------------------------------------------------------------------


@dataclass
class CheckReport:
    """How the checkpoint compared with the GGUF-loaded model."""

    prompts: int
    positions: int
    max_relative_difference: float
    tolerance: float
    greedy_same: int
    greedy_close_calls: int  # positions whose top two the rounding may swap, and did
    next_tokens: list[int]


def _load_gguf(gguf_file: Path, architecture: str):
    """(model in float32, tokenizer) read from the GGUF by transformers; ``BadInput`` when it cannot."""
    import torch  # noqa: PLC0415 - keep `eagle3-pipeline --help` and the up-to-date path fast
    import transformers  # noqa: PLC0415

    # Dequantize into plain dense layers even where a GGUF matmul kernel exists: the checkpoint
    # needs ordinary tensors. (Versions without GgufConfig always dequantize.)
    kwargs = {}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    directory, name = str(gguf_file.parent), gguf_file.name
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32, local_files_only=True, **kwargs)
    except (ValueError, KeyError, NotImplementedError, TypeError) as exc:
        raise BadInput(
            f"--gguf {gguf_file}: transformers {transformers.__version__} cannot read a causal language model of "
            f"GGUF architecture {architecture!r} ({str(exc).strip().splitlines()[0]}); convert the model's Hugging "
            "Face checkpoint instead, or use a transformers release that reads this architecture from GGUF"
        ) from exc
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError, TypeError, OSError) as exc:
        raise BadInput(
            f"--gguf {gguf_file}: transformers {transformers.__version__} cannot build the tokenizer stored in the "
            f"GGUF ({str(exc).strip().splitlines()[0]}); the pipeline needs the model's tokenizer"
        ) from exc
    packed = sorted({str(p.dtype) for p in model.parameters() if not p.dtype.is_floating_point})
    if packed:
        raise GgufImportError(f"--gguf {gguf_file}: transformers kept some weights packed ({', '.join(packed)}) "
                              "instead of dequantizing them; no plain checkpoint can be written from them")
    return model.eval(), tokenizer


def _plain_model(model, torch_dtype):
    """The same model class rebuilt from its configuration without GGUF quantization settings, holding the
    GGUF-loaded weights in ``torch_dtype`` (transformers refuses to save a model loaded from GGUF)."""
    settings = model.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(model.config).from_dict(settings)
    plain = type(model).from_pretrained(None, config=config, state_dict=model.state_dict(), dtype=torch_dtype)
    plain.generation_config = model.generation_config
    return plain.eval()


def _write_tokenizer(tokenizer, out: Path, max_positions: int | None) -> str | None:
    """Save the tokenizer in the form transformers 4.x (SGLang's) and 5.x both read; returns its chat template.

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` (no such class in 4.x) and the
    chat template to ``chat_template.jinja``; the template goes into ``tokenizer_config.json``
    instead (one place, read by both), and the class becomes ``PreTrainedTokenizerFast``.
    """
    tokenizer.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template_file = out / "chat_template.jinja"
    if template_file.is_file():
        config["chat_template"] = template_file.read_text(encoding="utf-8")
        template_file.unlink()
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for how_it_was_loaded in ("is_local", "local_files_only"):
        config.pop(how_it_was_loaded, None)
    # The GGUF says nothing of a tokenizer limit; transformers then writes a huge sentinel. The
    # model's context is the real limit.
    if max_positions and float(config.get("model_max_length") or math.inf) > 1e18:
        config["model_max_length"] = max_positions
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _check_prompts(tokenizer, vocab_size: int) -> list[tuple[str, list[int]]]:
    """(name, token ids) of the check's prompts, tokenized by ``tokenizer``."""
    prompts = [(f"text {i + 1}", tokenizer(text).input_ids[:CHECK_MAX_TOKENS]) for i, text in enumerate(CHECK_TEXTS)]
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(CHECK_CONVERSATION, add_generation_prompt=True, tokenize=False)
        prompts.append(("chat", tokenizer(rendered, add_special_tokens=False).input_ids[:CHECK_MAX_TOKENS]))
    prompts.append(("spread ids", [(7 + 7919 * i) % vocab_size for i in range(32)]))
    return [(name, ids) for name, ids in prompts if ids]


def _check_tokenizers(reference, saved, path: Path) -> None:
    """The saved tokenizer must give the GGUF's ids and render the chat template the same."""
    for text in CHECK_TEXTS:
        if reference(text).input_ids != saved(text).input_ids:
            raise GgufImportError(f"{path}: the saved tokenizer encodes {text!r} differently from the GGUF's "
                                  "tokenizer; the checkpoint is not kept")
    if reference.chat_template:
        ours = saved.apply_chat_template(CHECK_CONVERSATION, add_generation_prompt=True, tokenize=False)
        theirs = reference.apply_chat_template(CHECK_CONVERSATION, add_generation_prompt=True, tokenize=False)
        if ours != theirs:
            raise GgufImportError(f"{path}: the saved chat template renders a conversation differently from the "
                                  "GGUF's; the checkpoint is not kept")


def _check_logits(reference, saved, prompts, dtype: str, path: Path) -> CheckReport:
    """Both models in float32 on the same prompts: the logits within ``LOGIT_TOLERANCE[dtype]`` of the largest,
    and the same greedy token wherever the GGUF model's top two are further apart than the difference seen."""
    import torch  # noqa: PLC0415

    tolerance = LOGIT_TOLERANCE[dtype]
    worst, positions, same, close, next_tokens = 0.0, 0, 0, 0, []
    for name, ids in prompts:
        with torch.inference_mode():
            want = reference(input_ids=torch.tensor([ids])).logits[0].float()  # [T, V]
            got = saved(input_ids=torch.tensor([ids])).logits[0].float()
        difference = (got - want).abs().max()
        relative = (difference / want.abs().max().clamp_min(1e-6)).item()
        if not relative <= tolerance:  # also catches NaN
            raise GgufImportError(
                f"{path}: on the check prompt {name!r} the saved checkpoint's logits differ from the GGUF-loaded "
                f"model's by {relative:.3g} of the largest logit (allowed for {dtype}: {tolerance}); the conversion "
                "is wrong and is not kept")
        worst = max(worst, relative)
        top2 = want.topk(2, dim=-1).values  # [T, 2]
        decided = (top2[:, 0] - top2[:, 1]) > 2 * difference  # no rounding of this size can swap them
        agree = got.argmax(-1) == want.argmax(-1)
        if not bool(agree[decided].all()):
            position = int((decided & ~agree).nonzero()[0, 0])
            raise GgufImportError(
                f"{path}: on the check prompt {name!r} at position {position} the saved checkpoint's greedy token "
                f"differs from the GGUF-loaded model's, whose top two are further apart than any difference seen; "
                "the conversion is wrong and is not kept")
        positions += len(ids)
        same += int(agree.sum())
        close += int((~agree).sum())
        next_tokens.append(int(want[-1].argmax()))
    return CheckReport(len(prompts), positions, worst, tolerance, same, close, next_tokens)


def _file_entries(out: Path) -> dict[str, dict]:
    return {
        path.relative_to(out).as_posix(): {"size": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(out.rglob("*")) if path.is_file() and path.name != RECORD_NAME
    }


def _convert_into(out: Path, plan: ImportPlan) -> dict:
    """Write the checkpoint into ``out`` (a staging directory), check it, and return its record."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    if not sys.stderr.isatty():
        transformers.utils.logging.disable_progress_bar()  # carriage-return bars make unreadable logs
    started = time.monotonic()
    gguf_file = Path(plan.gguf)
    _log(f"loading {gguf_file} with transformers {transformers.__version__} (dequantized into float32)")
    reference, tokenizer = _load_gguf(gguf_file, plan.architecture or "?")
    config = reference.config
    parameters = sum(p.numel() for p in reference.parameters())
    _log(f"loaded {type(reference).__name__}: {parameters / 1e6:.1f} M parameters, {config.num_hidden_layers} layers, "
         f"hidden {config.hidden_size}, vocabulary {config.vocab_size}, "
         f"{'tied' if getattr(config, 'tie_word_embeddings', False) else 'separate'} input/output embeddings "
         f"({time.monotonic() - started:.0f}s)")

    plain = _plain_model(reference, getattr(torch, plan.dtype))
    plain.save_pretrained(str(out))
    del plain
    template = _write_tokenizer(tokenizer, out, getattr(config, "max_position_embeddings", None))
    if template is None:
        _log("the GGUF has no chat template: the checkpoint has none either (give the extraction one with "
             "--chat-template)")
    _log(f"wrote the checkpoint ({plan.dtype}) ({time.monotonic() - started:.0f}s); checking it against the "
         "GGUF-loaded model")

    saved_config = json.loads((out / "config.json").read_text())
    if "quantization_config" in saved_config:
        raise GgufImportError(f"{out / 'config.json'}: still names a quantization_config; the checkpoint is not kept")
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True)
    saved_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    _check_tokenizers(tokenizer, saved_tokenizer, out)
    report = _check_logits(reference, saved.eval(), _check_prompts(tokenizer, int(config.vocab_size)), plan.dtype,
                           out)
    _log(f"check: {report.prompts} prompts, {report.positions} positions: logits within "
         f"{report.max_relative_difference:.2g} of the largest (allowed {report.tolerance}); greedy token the same at "
         f"{report.greedy_same} of {report.positions} positions ({report.greedy_close_calls} where the top two are "
         f"closer than the rounding) ({time.monotonic() - started:.0f}s)")

    return {
        "recipe_version": RECIPE_VERSION,
        "gguf": {"path": plan.gguf, "sha256": plan.gguf_sha256, "size": gguf_file.stat().st_size,
                 "architecture": plan.architecture},
        "settings": {"dtype": plan.dtype},
        "model": {"class": type(reference).__name__, "parameters": parameters,
                  "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))},
        "check": asdict(report),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "gguf": version("gguf"),
                     "accelerate": version("accelerate")},
        "files": _file_entries(out),
        "seconds": round(time.monotonic() - started, 1),
    }


@dataclass
class ImportOutcome:
    """What a run did: ``changed`` is whether it wrote anything."""

    output: Path
    changed: bool
    action: str
    reason: str
    record: dict


def import_gguf(gguf_file: str | Path, output_dir: str | Path, *, dtype: str = DEFAULT_DTYPE,
                force: bool = False) -> ImportOutcome:
    """Convert ``gguf_file`` into a checked Hugging Face checkpoint at ``output_dir`` unless it is there already.

    Raises ``BadInput`` (nothing written) for a missing or non-GGUF file, missing packages, an
    architecture transformers cannot read, or another conversion (or any other directory) at
    ``output_dir``; ``GgufImportError`` when the written checkpoint does not check out (it is
    not kept). Directories left by killed runs beside ``output_dir`` are cleared.
    """
    output_dir = Path(output_dir).absolute()
    inspected = inspect_gguf(gguf_file)
    plan_import(gguf_file, output_dir, dtype=dtype, force=force, inspected=inspected)  # refusals before waiting
    with directory_lock(output_dir, _log):
        removed = remove_abandoned(output_dir, _log)
        # As the directory is now: another process may have written it while this one waited.
        plan = plan_import(gguf_file, output_dir, dtype=dtype, force=force, inspected=inspected)
        if plan.action == "none":
            _log(f"up to date: {plan.reason}; nothing to do")
            return ImportOutcome(output_dir, bool(removed), "none", plan.reason, read_record(output_dir) or {})
        _log(f"converting: {plan.reason}")
        started = time.monotonic()
        with staged_directory(output_dir) as staging:
            record = _convert_into(staging, plan)
            atomic_write_text(staging / RECORD_NAME, json.dumps(record, indent=2, sort_keys=True) + "\n")
    _log(f"done: {output_dir} ({time.monotonic() - started:.0f}s)")
    return ImportOutcome(output_dir, True, "convert", plan.reason, record)


# -- the command ------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline import-gguf``."""
    parser.add_argument("--gguf", type=path_arg, required=True, metavar="FILE", help="the GGUF model file to convert")
    parser.add_argument("--output", type=path_arg, required=True, metavar="DIR",
                        help="the Hugging Face checkpoint directory to write (or find up to date)")
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                        help=f"dtype of the saved weights (default {DEFAULT_DTYPE})")
    parser.add_argument("--force", action="store_true",
                        help="convert again even when up to date, or replace another GGUF's conversion at DIR")
    parser.add_argument("--check", action="store_true", help="say what a run would do; change nothing")
    parser.add_argument("--json", action="store_true",
                        help="print the result (or with --check the plan) as one JSON line on stdout")


def _stop_on_sigterm(signum, _frame) -> None:
    raise Stopped(f"stopped by signal {signum}: nothing was written at the output; run it again to convert")


def run(args: argparse.Namespace) -> int:
    """Run the command: 0 converted or up to date, 1 failed (conversion or check), 2 bad input, 4 stopped."""
    try:
        if args.check:
            plan = plan_import(args.gguf, args.output, dtype=args.dtype, force=args.force)
            message = (f"would convert {plan.gguf} ({plan.dtype}) into {plan.output}: {plan.reason}"
                       if plan.action == "convert" else f"up to date: {plan.reason}")
            if plan.abandoned:
                message += f"; would remove {len(plan.abandoned)} director(y/ies) left by killed runs"
            _log(f"check: {message}")
            print(json.dumps({**asdict(plan), "changes": plan.changes, "message": message}) if args.json
                  else message, flush=True)
            return EXIT_OK
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
        outcome = import_gguf(args.gguf, args.output, dtype=args.dtype, force=args.force)
    except (GgufImportError, Stopped) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # disk full, permissions
        print(f"error: {args.output}: {exc}; nothing was written there", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"error: interrupted; nothing was written at {args.output}; run it again to convert", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps({"output": str(outcome.output), "changed": outcome.changed, "action": outcome.action,
                          "reason": outcome.reason}), flush=True)
    else:
        print(outcome.output, flush=True)
    return EXIT_OK
