"""How a sample file stores hidden states: as the target computed them, or as float8 with per-token scales.

Every writer (the engine's capture writer for a float8 extraction, ``capture/writer.py``; the
extraction client; ``convert-storage``) builds a sample's states with ``quantize_states`` or
``sample_tensors``, and every reader (training, ``verify``, the conversion, ``compare_datasets``)
reads one with ``read_sample``; nothing else knows the layout. A sample file holds
``input_ids`` [T] int32 and ``loss_mask`` [T] uint8, and, by the dataset's storage dtype:

- unquantized (``extraction_storage_dtype: bfloat16``, the default): ``aux_hidden_states``
  [T, n_aux * H] and ``last_hidden_states`` [T, H] in the target's dtype, as captured (bfloat16
  for every served model; float32 for the tiny CPU model of the tests);
- ``float8_e4m3``: the same two tensors in ``torch.float8_e4m3fn``, and beside them
  ``aux_hidden_scales`` [T, n_aux] and ``last_hidden_scales`` [T, 1] in float32: one scale per
  token per captured layer (each H-wide slice of a row). ``scale = absmax(slice) / 448``
  (448: e4m3fn's largest finite value), ``q = round_to_nearest_even(x / scale)``, and a reader
  gets back ``x' = q * scale`` (in float32, then in the target's dtype). A slice of zeros has
  scale 0 and reads back as zeros.

Bytes per stored token (ids int32 + mask uint8 = 5 bytes; plus a header of a few hundred bytes
per file):

    unquantized:  (n_aux + 1) x H x dtype size (2 for bf16)  + 5
    float8_e4m3:  (n_aux + 1) x H x 1  +  (n_aux + 1) x 4 (scales)  + 5

Kimi-K2.5 (H 7168, 3 aux layers): 57,349 against 28,693 bytes (0.500); SmolLM2-135M (H 576):
4,613 against 2,325 (0.504). Float32 scales rather than bfloat16 ones: they cost (n_aux + 1) x 2
bytes a token more (0.03 % at Kimi's size, 0.3 % at SmolLM2's) and need no rounding rule
(a bfloat16 scale rounded down would push the slice's absmax past 448).

Error bound (a = the slice's absmax; e4m3 keeps 3 mantissa bits, so its unit roundoff is 2^-4):

- every element: |x' - x| <= a / 28 (half the spacing of e4m3's top binade, 32 / 2, over 448),
  which is within the 2^-4 x a that the format's unit roundoff allows;
- elements in e4m3's normal range (|x| >= a x 2^-6 / 448): |x' - x| <= 2^-4 x |x|;
- smaller ones (e4m3 subnormals): |x' - x| <= a x 2^-10 / 448;
- then the read-back's rounding into the target's dtype: 2^-8 x |x'| more for bfloat16
  (2^-24 for float32).

``tests/unit/test_extract_storage.py`` checks each bound element by element.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

FLOAT8 = "float8_e4m3"
UNQUANTIZED = "bfloat16"  # the option's name for "as captured, in the target's dtype"
STORAGE_DTYPES = (UNQUANTIZED, FLOAT8)
FLOAT8_TORCH = torch.float8_e4m3fn
FLOAT8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
QUANTIZE_CHUNK = 1 << 19  # elements quantized at once on a CPU (2 MiB of float32 temporaries)
QUANTIZE_CHUNK_GPU = 1 << 24  # and on a GPU (64 MiB of float32 temporaries)
IDS_BYTES = 5  # input_ids int32 + loss_mask uint8, per token
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HIDDEN_NAMES = ("aux_hidden_states", "last_hidden_states")
SCALE_NAMES = {"aux_hidden_states": "aux_hidden_scales", "last_hidden_states": "last_hidden_scales"}
# A float8 sample file's states, in file order (after input_ids and loss_mask).
FLOAT8_FILE_ORDER = ("aux_hidden_states", "aux_hidden_scales", "last_hidden_states", "last_hidden_scales")
# While ``convert-storage`` runs (or after it was killed), its journal is in the dataset directory:
# some files are converted, the manifest still describes the others. Its presence is the sign.
CONVERSION_JOURNAL = "storage-conversion.journal.jsonl"


class StorageError(ValueError):
    """Stored hidden states that cannot be read as the manifest says; the message says why and what to do."""


def finish_command(data_dir: Path | str) -> str:
    """The command that finishes an interrupted conversion of ``data_dir`` (in place)."""
    return f"eagle3-pipeline convert-storage {data_dir} --to {FLOAT8}"


@dataclass(frozen=True)
class Layout:
    """What a dataset's sample files hold: shapes, the target's dtype and the storage dtype."""

    n_aux: int
    hidden: int
    dtype: str  # the target's dtype: what a reader gets back
    storage: str  # FLOAT8, or the target's dtype (unquantized)

    @classmethod
    def of(cls, manifest: dict) -> Layout:
        """The layout a manifest (``data_config.json``) or the settings (``extraction.json``) record.

        ``storage_dtype`` is recorded only when the states are quantized (an unquantized dataset's
        settings are those of the datasets written before storage dtypes existed).
        """
        storage = manifest.get("storage_dtype") or manifest["dtype"]
        if storage not in (FLOAT8, manifest["dtype"]):
            raise StorageError(f"storage dtype {storage!r}: expected {FLOAT8} or the target's {manifest['dtype']}")
        return cls(len(manifest["aux_layers"]), int(manifest["hidden_size"]), str(manifest["dtype"]), storage)

    @property
    def quantized(self) -> bool:
        return self.storage == FLOAT8

    @property
    def target_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the hidden-state tensors in the files."""
        return FLOAT8_TORCH if self.quantized else self.target_dtype

    def bytes_per_token(self) -> int:
        """Bytes a token takes in a sample file, headers aside (the module docstring's formula)."""
        slices = self.n_aux + 1
        if self.quantized:
            return slices * self.hidden + slices * SCALE_BYTES + IDS_BYTES
        return slices * self.hidden * DTYPE_BYTES[self.dtype] + IDS_BYTES

    def formula(self) -> str:
        """``bytes_per_token`` spelled out, for messages: e.g. ``(3 aux + 1) x 7168 x 1 + (3 aux + 1) x 4 + 5``."""
        slices = f"({self.n_aux} aux + 1)"
        if self.quantized:
            return f"{slices} x {self.hidden} x 1 + {slices} x {SCALE_BYTES} (scales) + {IDS_BYTES} (ids, mask)"
        return f"{slices} x {self.hidden} x {DTYPE_BYTES[self.dtype]} + {IDS_BYTES} (ids, mask)"

    def expected(self, tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Tensor name -> (shape, dtype) of a sample of ``tokens`` tokens (ids and mask: any integer dtype)."""
        want: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
            "input_ids": ((tokens,), None), "loss_mask": ((tokens,), None),
            "aux_hidden_states": ((tokens, self.n_aux * self.hidden), self.stored_dtype),
            "last_hidden_states": ((tokens, self.hidden), self.stored_dtype),
        }
        if self.quantized:
            want["aux_hidden_scales"] = ((tokens, self.n_aux), SCALE_DTYPE)
            want["last_hidden_scales"] = ((tokens, 1), SCALE_DTYPE)
        return want

    def describe(self) -> dict:
        """The ``storage`` record of ``data_config.json``."""
        document = {"dtype": self.storage, "quantized": self.quantized, "read_as": self.dtype,
                    "bytes_per_token": self.bytes_per_token()}
        if self.quantized:
            document.update(
                values="torch.float8_e4m3fn", max=FLOAT8_MAX,
                scales={"dtype": "float32", "scheme": "absmax: scale = max|x| / 448 over one token's values of one "
                        "captured layer; x = value x scale",
                        "tensors": {"aux_hidden_scales": ["T", self.n_aux], "last_hidden_scales": ["T", 1]}},
            )
        return document


# -- quantize, dequantize ----------------------------------------------------------------------
def quantize(states: torch.Tensor, slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, slices * H] states to (values [T, slices * H] float8_e4m3fn, scales [T, slices] float32).

    On any device, with the same bits on each: every step is exact (abs, max, casts) or one
    IEEE-rounded float32 division (``scale = absmax / 448``, ``x / scale``) or round-to-nearest-even
    into e4m3fn. Both divisions divide by a tensor on the states' device: torch turns a division
    by a Python number on a GPU into a multiplication by its reciprocal, which rounds differently.
    """
    tokens, width = states.shape
    values = torch.empty((tokens, width), dtype=FLOAT8_TORCH, device=states.device)
    scales = torch.empty((tokens, slices), dtype=SCALE_DTYPE, device=states.device)
    limit = torch.tensor(FLOAT8_MAX, dtype=SCALE_DTYPE, device=states.device)
    # A few rows at a time: on a CPU the float32 temporaries stay in its cache (4 times faster than
    # whole, measured on a Kimi-shaped sample); on a GPU they stay small beside the server's memory.
    chunk = QUANTIZE_CHUNK if states.device.type == "cpu" else QUANTIZE_CHUNK_GPU
    step = max(1, chunk // width)
    for start in range(0, tokens, step):
        rows = states[start:start + step].reshape(-1, slices, width // slices)  # [t, k, H]
        absmax = rows.abs().amax(dim=-1).to(SCALE_DTYPE)  # [t, k]
        scale = absmax / limit
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        # In float32, in place: a bf16 tensor divided by a float32 one takes 4 times longer on a CPU.
        scaled = rows.to(SCALE_DTYPE, copy=True).div_(divisor[..., None])
        # The clamp: x / scale may round past 448 (e4m3fn has no infinity).
        values[start:start + step] = scaled.clamp_(-FLOAT8_MAX, FLOAT8_MAX).reshape(-1, width).to(FLOAT8_TORCH)
        scales[start:start + step] = scale
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``quantize``'s inverse on any device: values [T, k * H] float8, scales [T, k] -> [T, k * H] ``dtype``."""
    tokens, width = values.shape
    slices = scales.shape[-1]
    restored = values.reshape(tokens, slices, width // slices).to(SCALE_DTYPE) * scales[..., None]
    return restored.reshape(tokens, width).to(dtype)


def quantize_states(aux: torch.Tensor, last: torch.Tensor) -> dict[str, torch.Tensor]:
    """``aux`` [T, n_aux * H] and ``last`` [T, H] as a float8 sample stores them (values and scales,
    in file order), on their device: the capture writer calls it on the engine's GPU."""
    aux_values, aux_scales = quantize(aux, aux.shape[1] // last.shape[1])
    last_values, last_scales = quantize(last, 1)
    return dict(zip(FLOAT8_FILE_ORDER, (aux_values, aux_scales, last_values, last_scales)))


def sample_tensors(input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor, last: torch.Tensor,
                   storage_dtype: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a sample file, in file order: the states quantized when ``storage_dtype`` is FLOAT8.

    ``aux`` [T, n_aux * H] and ``last`` [T, H] come as captured (and verified); any other
    ``storage_dtype`` (None, bfloat16) stores them as they are.
    """
    tensors = {"input_ids": input_ids, "loss_mask": loss_mask}
    if storage_dtype != FLOAT8:
        return {**tensors, "aux_hidden_states": aux, "last_hidden_states": last}
    return {**tensors, **quantize_states(aux, last)}


def check_quantized_sample(tensors: dict[str, torch.Tensor], layout: Layout, tokens: int) -> tuple[str, str] | None:
    """What is wrong with a float8 sample an engine quantized, before it is stored: (reason, detail), or None.

    Names, shapes and dtypes as ``check_tensors``; the values through their scales only, with no
    pass over them: a slice holding NaN or inf has a NaN or inf absmax, so finite scales mean
    finite states (and ``quantize`` clamps the values into e4m3fn's range).
    """
    problem = check_tensors(tensors, layout, tokens, ".")
    if problem:
        return "capture_shape", problem
    for name, scales_name in SCALE_NAMES.items():
        scales = tensors[scales_name]
        if not bool(torch.isfinite(scales).all()):
            return "non_finite", f"{name} has NaN or inf values (its scales are not finite)"
        if bool((scales < 0).any()):
            return "capture_shape", f"{scales_name} has a negative scale"
    return None


# -- reading ------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return FLOAT8 if dtype == FLOAT8_TORCH else str(dtype).removeprefix("torch.")


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN and no infinity. For float8_e4m3fn, read from its bits: the format has no
    infinities, and its only NaNs are the bytes 0x7F and 0xFF (exponent and mantissa all ones), so one mask over
    the bytes gives what converting every value to float32 would, at a fraction of the cost (a deep verify of
    all of ShareGPT checks some 26 G stored values)."""
    if tensor.dtype == FLOAT8_TORCH:
        return not bool(tensor.view(torch.uint8).bitwise_and(0x7F).eq(0x7F).any())
    return bool(torch.isfinite(tensor).all())


def check_tensors(  # noqa: PLR0911 - one return per problem found
    tensors: dict[str, torch.Tensor], layout: Layout, tokens: int, data_dir: Path | str,
                  finite: bool = False) -> str | None:
    """What is wrong with a sample's tensors for ``layout`` (None: nothing); ``finite`` also checks the values.

    A file stored in the other storage dtype gets a message naming the command that finishes a
    conversion, since an interrupted one is how a dataset comes to mix them.
    """
    stored = tensors.get("last_hidden_states")
    if stored is not None and (stored.dtype == FLOAT8_TORCH) != layout.quantized:
        manifest_says = layout.storage
        return (f"holds {_dtype_name(stored.dtype)} hidden states, data_config.json says {manifest_says}: the "
                "dataset mixes storage dtypes (a storage conversion stopped midway?); finish it with "
                f"`{finish_command(data_dir)}`, or check the files with `eagle3-pipeline verify {data_dir}`")
    for name, (shape, dtype) in layout.expected(tokens).items():
        if name not in tensors:
            return f"lacks {name}; the file is not an extracted sample of this dataset"
        got = tensors[name]
        if tuple(got.shape) != shape:
            return f"{name} is {tuple(got.shape)}, expected {shape}"
        if dtype is not None and got.dtype != dtype:
            return f"{name} is {got.dtype}, the manifest says {_dtype_name(dtype)}"
    if finite:
        for name in (*HIDDEN_NAMES, *(SCALE_NAMES.values() if layout.quantized else ())):
            if not all_finite(tensors[name]):
                return f"{name} has NaN or inf values"
        if layout.quantized and any(bool((tensors[name] < 0).any()) for name in SCALE_NAMES.values()):
            return "a scale is negative"
    return None


def decode(tensors: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """The states in the target's dtype (dequantized when stored as float8); scales dropped."""
    if not layout.quantized:
        return tensors
    decoded = {name: tensor for name, tensor in tensors.items() if name not in SCALE_NAMES.values()}
    for name, scales in SCALE_NAMES.items():
        decoded[name] = dequantize(tensors[name], tensors[scales], layout.target_dtype)
    return decoded


def read_sample(path: Path, layout: Layout, tokens: int, *, dequantize: bool = True) -> dict[str, torch.Tensor]:
    """A sample file's tensors, checked against ``layout`` (names, shapes, dtypes).

    ``dequantize``: states in the target's dtype; else as stored (float8 values with their
    ``*_scales``, for a reader that dequantizes on the GPU). Raises ``StorageError`` naming the file.
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = set(handle.keys())
            tensors = {name: handle.get_tensor(name) for name in layout.expected(tokens) if name in names}
    except FileNotFoundError:
        raise StorageError(f"{path}: missing (listed in data_config.json); run `eagle3-pipeline verify`") from None
    except (SafetensorError, OSError) as exc:
        raise StorageError(f"{path}: unreadable: {exc}; run `eagle3-pipeline verify`") from None
    problem = check_tensors(tensors, layout, tokens, path.parent.parent)
    if problem:
        raise StorageError(f"{path}: {problem}")
    return decode(tensors, layout) if dequantize else tensors


def header_metadata(blob: bytes) -> dict[str, str]:
    """The string metadata of a safetensors file held in memory."""
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + length]).get("__metadata__") or {}


def unfinished_conversion(data_dir: Path) -> str | None:
    """Why ``data_dir`` cannot be read now (a storage conversion is unfinished there), or None."""
    journal = Path(data_dir) / CONVERSION_JOURNAL
    if not journal.exists():
        return None
    return (f"{data_dir}: a storage conversion is unfinished there ({CONVERSION_JOURNAL}): some sample files are "
            f"converted and the others not yet, so the dataset mixes storage dtypes; finish it with "
            f"`{finish_command(data_dir)}` (the same command, with --copy-to, when it was converting into a copy)")


def refuse_unfinished_conversion(data_dir: Path) -> None:
    """Raise ``StorageError`` when a storage conversion of ``data_dir`` is unfinished."""
    why = unfinished_conversion(data_dir)
    if why:
        raise StorageError(why)


# -- measuring ---------------------------------------------------------------------------------
def _manifest(data_dir: Path) -> dict:
    path = Path(data_dir) / "data_config.json"
    if not path.is_file():
        raise StorageError(f"{data_dir}: no data_config.json: not a complete extraction output")
    refuse_unfinished_conversion(Path(data_dir))
    return json.loads(path.read_text())


def _entries(manifest: dict) -> list[dict]:
    return sorted((e for shard in manifest["shards"].values() for e in shard["files"]), key=lambda e: e["file"])


def _data_bytes(path: Path) -> tuple[int, int]:
    """(file size, header size) of a safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        return size, 8 + struct.unpack("<Q", handle.read(8))[0]


def compare_datasets(reference_dir: Path | str, quantized_dir: Path | str) -> dict:
    """Bytes per token and the error of the dequantized states: an unquantized dataset against its float8 copy.

    Bytes are measured from the files: ``bytes_per_token`` (whole files over tokens) and its
    parts (``header``; hidden values, scales and ids+mask from the layout), beside the formula's
    ``formula_bytes_per_token``. Errors, per captured layer (``aux <layer id>`` and ``last``),
    over every token of every sample, the float8 copy read back as a reader gets it (in the
    target's dtype) against the stored original: ``rel_l2`` = ||x' - x|| / ||x|| of a token's
    slice (worst and mean over tokens; all-zero slices left out) and ``err_over_absmax`` =
    |x' - x| / max|x| of the slice (worst over elements, mean over elements).
    """
    reference_dir, quantized_dir = Path(reference_dir), Path(quantized_dir)
    ref_manifest, q_manifest = _manifest(reference_dir), _manifest(quantized_dir)
    ref_layout, q_layout = Layout.of(ref_manifest), Layout.of(q_manifest)
    if ref_layout.quantized or not q_layout.quantized:
        raise StorageError(f"compare_datasets: {reference_dir} must be unquantized ({ref_layout.storage}) and "
                           f"{quantized_dir} float8 ({q_layout.storage})")
    ref_entries, q_entries = _entries(ref_manifest), _entries(q_manifest)
    if [(e["file"], e["tokens"]) for e in ref_entries] != [(e["file"], e["tokens"]) for e in q_entries] or (
            ref_layout.n_aux, ref_layout.hidden) != (q_layout.n_aux, q_layout.hidden):
        raise StorageError(f"{reference_dir} and {quantized_dir} do not hold the same samples of the same shapes")
    labels = [f"aux {layer}" for layer in ref_manifest["aux_layers"]] + ["last"]
    sums = {label: {"rel_l2_max": 0.0, "rel_l2_sum": 0.0, "tokens": 0, "err_max": 0.0, "err_sum": 0.0,
                    "elements": 0} for label in labels}
    sizes = {"reference": [0, 0], "quantized": [0, 0]}  # [file bytes, header bytes]
    tokens = 0
    for entry in ref_entries:
        for side, root in (("reference", reference_dir), ("quantized", quantized_dir)):
            size, header = _data_bytes(root / entry["file"])
            sizes[side][0] += size
            sizes[side][1] += header
        original = read_sample(reference_dir / entry["file"], ref_layout, entry["tokens"])
        restored = read_sample(quantized_dir / entry["file"], q_layout, entry["tokens"])
        tokens += entry["tokens"]
        x = torch.cat([original["aux_hidden_states"], original["last_hidden_states"]], dim=1).double()
        y = torch.cat([restored["aux_hidden_states"], restored["last_hidden_states"]], dim=1).double()
        x = x.reshape(entry["tokens"], len(labels), ref_layout.hidden)  # [T, n_aux + 1, H]
        error = (y.reshape(x.shape) - x).abs()
        absmax = x.abs().amax(dim=-1)  # [T, k]
        norms = x.norm(dim=-1)
        rel_l2 = error.norm(dim=-1) / norms
        over_absmax = error / absmax.clamp(min=torch.finfo(torch.float64).tiny)[..., None]
        for index, label in enumerate(labels):
            acc = sums[label]
            kept = rel_l2[:, index][norms[:, index] > 0]
            if kept.numel():
                acc["rel_l2_max"] = max(acc["rel_l2_max"], float(kept.max()))
                acc["rel_l2_sum"] += float(kept.sum())
                acc["tokens"] += kept.numel()
            acc["err_max"] = max(acc["err_max"], float(over_absmax[:, index].max()))
            acc["err_sum"] += float(over_absmax[:, index].sum())
            acc["elements"] += over_absmax[:, index].numel()

    def side(name: str, layout: Layout) -> dict:
        files, headers = sizes[name]
        slices = layout.n_aux + 1
        values = slices * layout.hidden * (1 if layout.quantized else DTYPE_BYTES[layout.dtype])
        return {"storage_dtype": layout.storage, "bytes": files, "bytes_per_token": files / tokens,
                "formula_bytes_per_token": layout.bytes_per_token(),
                "per_token": {"hidden_values": values, "scales": slices * SCALE_BYTES if layout.quantized else 0,
                              "ids_and_mask": IDS_BYTES, "headers": headers / tokens}}

    reference, quantized = side("reference", ref_layout), side("quantized", q_layout)
    return {
        "samples": len(ref_entries), "tokens": tokens, "hidden_size": ref_layout.hidden, "n_aux": ref_layout.n_aux,
        "reference": reference, "quantized": quantized,
        "bytes_ratio": quantized["bytes"] / reference["bytes"],
        "layers": {label: {"rel_l2_worst": acc["rel_l2_max"],
                           "rel_l2_mean": acc["rel_l2_sum"] / acc["tokens"] if acc["tokens"] else math.nan,
                           "err_over_absmax_worst": acc["err_max"],
                           "err_over_absmax_mean": acc["err_sum"] / acc["elements"] if acc["elements"] else math.nan}
                   for label, acc in sums.items()},
    }
