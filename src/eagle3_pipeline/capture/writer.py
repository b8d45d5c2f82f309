"""The capture writer: one safetensors file per request id, written atomically.

Both engines (SGLang through its forward hook, and the reference engine) write captures with
this code, so the extraction client reads one format:

``<capture_dir>/<rid>.safetensors`` with ``aux_hidden_states`` [T, n_aux * H] and
``last_hidden_states`` [T, H] for exactly the T tokens of the request's prefill, plus string
metadata (rid, num_tokens, aux_layer_ids, engine). A request whose prefill was not complete
(a cached prefix, a split prefill) never gets that file: ``<rid>.incomplete.json`` says why.
Files appear by rename, so a reader never sees half a file; the directory is mode 0700.

A request id ending in ``.f8`` (``FLOAT8_RID_SUFFIX``; the extraction's client sends such ids
when it stores float8, ``extraction_storage_dtype: float8_e4m3``) gets its states quantized by
the writer, on the device they are on (the engine's GPU), as a float8 sample stores them
(``extract/storage.py``: ``aux_hidden_states``/``last_hidden_states`` in float8_e4m3fn with
``aux_hidden_scales``/``last_hidden_scales``), plus ``last_hidden_states_unquantized`` [T, H]
in the model's dtype for the client's top-1 check; metadata ``storage_dtype: float8_e4m3``.
The engine's GPU does in microseconds what the client's CPU took seconds for, and the copy to
the host, the capture file and the client's reads shrink to 3/4 or less. The request says what
it wants, so the server needs no setting and one server serves both kinds of extraction.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open

from eagle3_pipeline.atomic import atomic_write, atomic_write_text

CAPTURE_SUFFIX = ".safetensors"
INCOMPLETE_SUFFIX = ".incomplete.json"
_RID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
FLOAT8_RID_SUFFIX = ".f8"  # a request id ending so asks for float8 states (module docstring)
UNQUANTIZED_LAST = "last_hidden_states_unquantized"  # a float8 capture's last states as computed


class CaptureError(ValueError):
    """A capture cannot be written or read as asked; the message says which and why."""


def check_rid(rid: str) -> str:
    """Refuse request ids that could escape the capture directory or collide with temp files."""
    if not isinstance(rid, str) or not _RID.match(rid) or rid.endswith((".tmp", INCOMPLETE_SUFFIX)):
        raise CaptureError(
            f"request id {rid!r} cannot name a capture file: use 1-200 characters of letters, digits, '.', '_', '-', "
            "starting with a letter or digit"
        )
    return rid


def wants_float8(rid: str) -> bool:
    """Whether the request ``rid`` asks for its states quantized to float8 (module docstring)."""
    return rid.endswith(FLOAT8_RID_SUFFIX)


def ensure_capture_dir(capture_dir: str | os.PathLike) -> Path:
    """Create the capture directory (mode 0700) if needed and return it."""
    path = Path(capture_dir)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def capture_path(capture_dir: str | os.PathLike, rid: str) -> Path:
    """Where the capture of ``rid`` is (or will be)."""
    return Path(capture_dir) / f"{check_rid(rid)}{CAPTURE_SUFFIX}"


def incomplete_path(capture_dir: str | os.PathLike, rid: str) -> Path:
    """Where the record of an incomplete capture of ``rid`` is."""
    return Path(capture_dir) / f"{check_rid(rid)}{INCOMPLETE_SUFFIX}"


# safetensors' names for the dtypes a capture can hold.
_SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",  # hidden states stored as float8 (extract/storage.py)
}


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy; from a GPU through pinned memory (cached by torch), the fast path."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.contiguous()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    return host


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str], digest=None
) -> int:
    """Write CPU tensors in the safetensors format, straight from their memory.

    Same bytes on disk as ``safetensors.torch.save_file`` would give a reader (8-byte header
    length, JSON header padded to 8 bytes, raw little-endian data in header order), but with no
    intermediate copy of the data: the file writes release the GIL, so capture writes do not
    stall a server's other threads. Files are read back with safetensors itself.
    """
    header: dict = {"__metadata__": metadata}
    offset = 0
    buffers = []
    for name, given in tensors.items():
        tensor = given.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        buffers.append(tensor.reshape(-1).view(torch.uint8).numpy())
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    pieces = [struct.pack("<Q", len(blob)), blob, *(memoryview(buffer) for buffer in buffers)]
    with open(path, "wb") as handle:
        for piece in pieces:
            handle.write(piece)
            if digest is not None:
                digest.update(piece)
    return 8 + len(blob) + offset


def write_capture(
    capture_dir: str | os.PathLike,
    rid: str,
    aux_hidden_states: torch.Tensor,
    last_hidden_states: torch.Tensor,
    aux_layer_ids: list[int] | tuple[int, ...],
    engine: str,
) -> Path:
    """Write the capture of one request atomically; return its path.

    ``aux_hidden_states`` is [T, n_aux * H] and ``last_hidden_states`` [T, H], both on any
    device and in the model's dtype: copied to the CPU as they are, or quantized where they are
    first when ``rid`` asks for float8 (``FLOAT8_RID_SUFFIX``).
    """
    if last_hidden_states.dim() != 2 or aux_hidden_states.dim() != 2:
        raise CaptureError(
            f"capture of {rid}: expected 2-D tensors, got aux {tuple(aux_hidden_states.shape)} "
            f"and last {tuple(last_hidden_states.shape)}"
        )
    tokens, hidden = last_hidden_states.shape
    n_aux = len(aux_layer_ids)
    if tuple(aux_hidden_states.shape) != (tokens, n_aux * hidden):
        raise CaptureError(
            f"capture of {rid}: aux_hidden_states is {tuple(aux_hidden_states.shape)}, expected "
            f"({tokens}, {n_aux} x {hidden}) for aux layers {list(aux_layer_ids)}"
        )
    directory = ensure_capture_dir(capture_dir)
    target = capture_path(directory, rid)
    if wants_float8(rid):
        from eagle3_pipeline.extract.storage import FLOAT8, quantize_states  # noqa: PLC0415

        with torch.inference_mode():
            states = quantize_states(aux_hidden_states.detach(), last_hidden_states.detach())
        tensors = {name: _to_host(tensor) for name, tensor in states.items()}
        tensors[UNQUANTIZED_LAST] = _to_host(last_hidden_states)
        extra = {"storage_dtype": FLOAT8}
    else:
        tensors = {"aux_hidden_states": _to_host(aux_hidden_states),
                   "last_hidden_states": _to_host(last_hidden_states)}
        extra = {}
    metadata = {
        **extra,
        "rid": rid,
        "num_tokens": str(tokens),
        "hidden_size": str(hidden),
        "aux_layer_ids": json.dumps([int(i) for i in aux_layer_ids]),
        "engine": engine,
    }
    atomic_write(target, lambda tmp: save_safetensors(tensors, tmp, metadata))
    stale = incomplete_path(directory, rid)
    if stale.exists():
        stale.unlink()
    return target


def write_incomplete(capture_dir: str | os.PathLike, rid: str, reason: str, **details) -> Path:
    """Record that the prefill of ``rid`` was not captured whole, and why; never a capture file."""
    directory = ensure_capture_dir(capture_dir)
    target = incomplete_path(directory, rid)
    record = json.dumps({"rid": rid, "reason": reason, **details}, sort_keys=True)
    atomic_write_text(target, record + "\n")
    return target


@dataclass
class Capture:
    """A capture read back: the two tensors and the metadata (a float8 capture's as stored: values,
    with its scales and unquantized last states in ``tensors``)."""

    rid: str
    aux_hidden_states: torch.Tensor
    last_hidden_states: torch.Tensor
    aux_layer_ids: list[int]
    engine: str
    storage_dtype: str | None = None
    tensors: dict[str, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        """T, the number of captured positions."""
        return int(self.last_hidden_states.shape[0])


def read_capture(path: str | os.PathLike) -> Capture:
    """Load a capture file (safetensors: no code is loaded, only tensors)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # a truncated or foreign file
        raise CaptureError(f"{path}: not a readable capture file: {exc}") from exc
    missing = {"aux_hidden_states", "last_hidden_states"} - set(tensors)
    if missing:
        raise CaptureError(f"{path}: capture file lacks {sorted(missing)}")
    return Capture(
        rid=metadata.get("rid", path.name[: -len(CAPTURE_SUFFIX)]),
        aux_hidden_states=tensors["aux_hidden_states"],
        last_hidden_states=tensors["last_hidden_states"],
        aux_layer_ids=json.loads(metadata.get("aux_layer_ids", "[]")),
        engine=metadata.get("engine", "unknown"),
        storage_dtype=metadata.get("storage_dtype"),
        tensors=tensors,
    )
