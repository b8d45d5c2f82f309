"""Decoding over a KV cache of fixed slots: the reference engine's fast path for Llama-family decoders.

The transformers path keeps a batch's cache as growing tensors (``DynamicCache``): every decode step
appends a column to every layer's keys and values (a copy of the whole cache), and every request that
joins or leaves the batch copies it again. Serving hundreds of requests at once (the regeneration),
those copies, not the model, set the pace. Here the cache is allocated once per server: ``slots``
rows of ``slot_tokens`` positions for every layer, keys and values laid out as flash attention's
packed form, ``[(slots + 1) * slot_tokens, kv_heads, head_dim]`` (the extra slot is scratch for the
padding rows of a CUDA graph). A request takes a free slot for its life: its prompt's keys and values
are written at positions ``0..P-1`` of the slot, each decoded token's at the next position, and
nothing is ever moved. Attention reads each row's own slot: flash attention (varlen) with the slot's
first key as the row's key offset and the tokens written so far as its used length (CUDA, bf16 or
fp16), or scaled dot-product attention row by row elsewhere.

A decode step is one token per row; on CUDA the steps of each batch size (rounded up to a power of
two) are replayed as CUDA graphs, so a step costs the GPU's time, not Python's. So are the prefills of a
small model (a few prompts, a few thousand tokens: the requests admitted into a running batch), whose
hundreds of kernels a layer the host would otherwise launch one by one while the GPU waits: the tokens
are padded up to a power of two (``prefill_graph_tokens`` at most, chosen so that a padded prefill costs
the GPU a few milliseconds), the rows too, the padding tokens in rows of their own over the scratch slot.

The layer loop calls the model's own modules (embedding, norms, projections, MLP, rotary embedding);
only the attention and the cache are this module's. Whether that reproduces the model is not assumed:
``ModelRunner`` compares slot decoding with full forwards of transformers at start, and a model that
differs keeps the transformers path. ``unsupported`` refuses up front what cannot work (no Llama-style
layers, sliding windows, position-dependent RoPE scaling).
"""

from __future__ import annotations

import heapq
import logging
import time

import torch
import torch.nn.functional as F

LOG = logging.getLogger(__name__)

# RoPE variants whose frequencies do not depend on the sequence length (graph-safe, slot-safe).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Tokens per prefill forward: bounds the activations of a prefill of many long prompts.
PREFILL_TOKENS = 32768
# Prefills replayed as CUDA graphs: padded to a power of two of at least PREFILL_GRAPH_MIN_TOKENS tokens, and at
# most the tokens whose forward costs PREFILL_GRAPH_FLOPS (2 x the layers' parameters a token; a few ms of an
# H100's, about what the host spends launching an eager prefill's kernels) or PREFILL_GRAPH_MAX_TOKENS. A model
# too large for PREFILL_GRAPH_MIN_TOKENS tokens within that budget prefills eagerly (its GPU time dominates).
PREFILL_GRAPH_FLOPS = 4e12
PREFILL_GRAPH_MIN_TOKENS = 256
PREFILL_GRAPH_MAX_TOKENS = 16384


def unsupported(model) -> str | None:  # noqa: PLR0911 - one return per reason
    """Why ``model`` cannot decode over slots (None when it can, to be confirmed by the start-up check)."""
    config = model.config
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None or not len(layers):
        return "the decoder has no list of layers"
    for name in ("embed_tokens", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            return f"the decoder has no `{name}`"
    if model.get_output_embeddings() is None:
        return "the model has no output embeddings (lm_head)"
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        names = ("input_layernorm", "post_attention_layernorm", "mlp")
        if attention is None or not all(hasattr(layer, name) for name in names):
            return "its decoder layers are not Llama-style (self_attn, input_layernorm, post_attention_layernorm, mlp)"
        if not all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
            return "its attention has no separate q/k/v/o projections"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if window or any(kind != "full_attention" for kind in layer_types):
        return "it has sliding-window attention layers"
    rope = getattr(decoder.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE_TYPES:
        return f"its RoPE type {rope!r} depends on the sequence length"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return "it caps its attention or output logits"
    return None


def bytes_per_token(model, dtype: torch.dtype) -> int:
    """Bytes of keys and values one cached token takes over all layers."""
    config = model.config
    attention = model.get_decoder().layers[0].self_attn
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return int(config.num_hidden_layers) * 2 * kv_heads * int(attention.head_dim) * dtype.itemsize


def plan_slots(model, max_batch_size: int, slot_tokens: int, cache_gib: float, share: int = 1) -> tuple[int, int]:
    """(slots, tokens a slot): ``max_batch_size`` slots of ``slot_tokens`` (capped at the model's context
    length), fewer when they would take more than ``cache_gib`` GiB (0: half the GPU memory free now on
    CUDA, 2 GiB on the CPU, divided by ``share``, the processes that share the device). A model that cannot
    decode over slots (``unsupported``: multi-latent attention, say) gets none: its server keeps the
    transformers path."""
    if unsupported(model) is not None:
        return 0, int(slot_tokens)
    weight = model.get_input_embeddings().weight
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or slot_tokens
    slot_tokens = max(1, min(int(slot_tokens), context))
    if cache_gib <= 0:
        cache_gib = (torch.cuda.mem_get_info(weight.device)[0] / 2**31 if weight.device.type == "cuda" else 2.0)
        cache_gib /= max(1, int(share))
    per_slot = slot_tokens * bytes_per_token(model, weight.dtype)
    fit = int(cache_gib * 2**30 // per_slot) - 1  # one slot of scratch
    return max(0, min(int(max_batch_size), fit)), slot_tokens


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _bucket(n: int, limit: int) -> int:
    """The CUDA-graph batch size for ``n`` rows: the next power of two, at most ``limit``."""
    size = 1
    while size < n:
        size *= 2
    return min(size, limit)


def flash_possible(model) -> bool:
    """Whether slot decoding of ``model`` runs flash attention (CUDA, bf16 or fp16, head_dim at most 256): what its
    CUDA graphs need (the other attention reads host-side lengths)."""
    weight = model.get_input_embeddings().weight
    head_dim = int(model.get_decoder().layers[0].self_attn.head_dim)
    return (weight.device.type == "cuda" and weight.dtype in (torch.bfloat16, torch.float16) and head_dim <= 256
            and hasattr(torch.ops.aten, "_flash_attention_forward"))


def prefill_graph_tokens(layers, flops: float = PREFILL_GRAPH_FLOPS) -> int:
    """The most tokens a prefill replayed as a CUDA graph takes for a model with these decoder ``layers``: the
    largest power of two whose forward costs at most ``flops`` (2 x parameters a token), at most
    ``PREFILL_GRAPH_MAX_TOKENS``; 0 when not even ``PREFILL_GRAPH_MIN_TOKENS`` fit."""
    per_token = 2 * sum(p.numel() for layer in layers for p in layer.parameters())
    size = PREFILL_GRAPH_MIN_TOKENS
    if size * per_token > flops:
        return 0
    while size * 2 <= PREFILL_GRAPH_MAX_TOKENS and size * 2 * per_token <= flops:
        size *= 2
    return size


class SlotDecoder:
    """A model's decode steps over a preallocated slot cache (see the module docstring)."""

    def __init__(self, model, slots: int, slot_tokens: int, graphs: bool = True, prefill_graphs: bool = True):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        if slots < 1 or slot_tokens < 2:
            raise ValueError(f"need at least one slot of 2 tokens, got {slots} x {slot_tokens}")
        decoder = model.get_decoder()
        self.embed, self.norm, self.rotary = decoder.embed_tokens, decoder.norm, decoder.rotary_emb
        self.layers = list(decoder.layers)
        self.lm_head = model.get_output_embeddings()
        config = model.config
        attention = self.layers[0].self_attn
        self.head_dim = int(attention.head_dim)
        self.scale = float(getattr(attention, "scaling", self.head_dim**-0.5))
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.slots, self.slot_tokens = int(slots), int(slot_tokens)
        self.scratch = self.slots  # the padding rows' slot
        shape = (len(self.layers), (self.slots + 1) * self.slot_tokens, self.kv_heads, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._free = list(range(self.slots))
        self.flash = flash_possible(model)
        # Graphs replay fixed kernels: only flash attention reads the slots without host-side lengths.
        self.graphs_on = bool(graphs) and self.flash
        self._graphs: dict[int, tuple] = {}
        self._pool = None
        self._static: dict[str, torch.Tensor] | None = None
        # Prefills of at most this many tokens (padded) replay CUDA graphs, keyed by (tokens, rows); 0: none.
        self.prefill_graph_tokens = prefill_graph_tokens(self.layers) if self.graphs_on and prefill_graphs else 0
        self._prefill_graphs: dict[tuple[int, int], tuple] = {}
        self.prefill_graphs_failure: str | None = None  # why prefill graphs went off while serving
        self._prefill_static: dict[str, torch.Tensor] | None = None
        self.replay_wait_s = 0.0  # seconds the host waited for replayed decode steps to finish (``stats``)

    # -- slots -------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """``count`` free slots (the lowest numbers); ValueError when fewer are free."""
        if count > len(self._free):
            raise ValueError(f"{count} slots asked for, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(count)]

    def release(self, slots) -> None:
        """Give slots back; their old keys and values are overwritten by the next holder."""
        for slot in slots:
            heapq.heappush(self._free, int(slot))

    def describe(self) -> str:
        """One line for the server's log and /server_info."""
        attention = "flash attention" if self.flash else "scaled dot-product attention"
        graphs = "CUDA graphs" if self.graphs_on else "no CUDA graphs"
        if self.prefill_graph_tokens:
            graphs += f" (decode; prefills up to {self.prefill_graph_tokens} tokens)"
        elif self.prefill_graphs_failure:
            graphs += f" (decode; prefill graphs off: {self.prefill_graphs_failure})"
        return f"slots: {self.slots} x {self.slot_tokens} tokens, {attention}, {graphs}"

    # -- the forward ----------------------------------------------------------------------------
    def forward(self, tokens, positions, write_index, cu_q, max_q: int, key_start, used, *, select=None,
                aux_layers=(), host=None):
        """Packed rows through the model over the slot cache: (logits float32 of the ``select``ed tokens
        (all when None), {aux layer: its output for every token}).

        ``tokens``, ``positions``, ``write_index`` (slot * slot_tokens + position): [N]; ``cu_q``: [B + 1]
        int32 offsets of each row's tokens; ``key_start``: [B + 1] int32, each row's slot * slot_tokens
        (then any end); ``used``: [B] int32, each row's length after this forward's keys are written.
        ``host``: the same three as lists, for the attention that is not flash.
        """
        count = tokens.shape[0]
        hidden = self.embed(tokens)  # [N, H]
        cos, sin = self.rotary(hidden[None], positions[None])  # [1, N, D] each
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [N, 1, D]: over the heads
        captured = {}
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(count, -1, self.head_dim)  # [N, heads, D]
            k = attention.k_proj(x).view(count, -1, self.head_dim)  # [N, kv_heads, D]
            v = attention.v_proj(x).view(count, -1, self.head_dim)
            if hasattr(attention, "q_norm"):  # Qwen3-style per-head norms, before RoPE
                q, k = attention.q_norm(q), attention.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.keys[index].index_copy_(0, write_index, k)
            self.values[index].index_copy_(0, write_index, v)
            out = self._attend(index, q, cu_q, max_q, key_start, used, host)  # [N, heads, D]
            hidden = hidden + attention.o_proj(out.reshape(count, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if index in aux_layers:
                captured[index] = hidden
        if select is not None:
            hidden = hidden.index_select(0, select)
        return self.lm_head(self.norm(hidden)).float(), captured

    def _attend(self, layer: int, q, cu_q, max_q: int, key_start, used, host):
        keys, values = self.keys[layer], self.values[layer]
        if self.flash:
            return torch.ops.aten._flash_attention_forward(
                q, keys, values, cu_q, key_start, max_q, self.slot_tokens, 0.0, True, False, scale=self.scale,
                seqused_k=used)[0]
        # Row by row: the row's queries over its slot's used keys, causal from the bottom right (the last
        # query sees every key, the first sees the keys before the row's new ones and itself).
        cu_q_host, key_start_host, used_host = host
        outs = []
        for row in range(len(used_host)):
            first, last = cu_q_host[row], cu_q_host[row + 1]
            start, length = key_start_host[row], used_host[row]
            rows = last - first
            query = q[first:last].transpose(0, 1)[None]  # [1, heads, n, D]
            key = keys[start:start + length].transpose(0, 1)[None]  # [1, kv_heads, L, D]
            value = values[start:start + length].transpose(0, 1)[None]
            allowed = (torch.arange(length, device=q.device)[None, :]
                       <= torch.arange(length - rows, length, device=q.device)[:, None])
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=self.scale,
                                                 enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)

    # -- prefill and decode ------------------------------------------------------------------------
    def _layout(self, slots: list[int], lengths: list[int], starts: list[int]):
        """Host lists of one forward's rows: row ``b`` writes ``lengths[b]`` tokens at positions
        ``starts[b]..`` of slot ``slots[b]``."""
        cu_q, key_start, used = [0], [], []
        for slot, length, start in zip(slots, lengths, starts):
            cu_q.append(cu_q[-1] + length)
            key_start.append(slot * self.slot_tokens)
            used.append(start + length)
        key_start.append((self.slots + 1) * self.slot_tokens)
        return cu_q, key_start, used

    def _check_room(self, slots, ends) -> None:
        for slot, end in zip(slots, ends):
            if not 0 <= slot <= self.slots or end > self.slot_tokens:
                raise ValueError(f"slot {slot}: {end} tokens do not fit its {self.slot_tokens}")

    def prefill(self, slots: list[int], prompts: list[list[int]], aux_layers=()):
        """Write each prompt's keys and values into its slot: (the logits [n, V] float32 of each prompt's last
        token, the ``aux_layers``' outputs concatenated for every prompt token, packed [sum P, n_aux*H], or None).
        Prompts are packed (no padding), at most ``PREFILL_TOKENS`` a forward (rows whole)."""
        self._check_room(slots, [len(p) for p in prompts])
        groups, group, size = [], [], 0
        for b, prompt in enumerate(prompts):
            if group and size + len(prompt) > PREFILL_TOKENS:
                groups.append(group)
                group, size = [], 0
            group.append(b)
            size += len(prompt)
        groups.append(group)
        logits, aux = [], []
        for group in groups:
            rows = [prompts[i] for i in group]
            if not aux_layers and self._prefill_shape(rows) is not None:
                try:
                    logits.append(self._prefill_replay([slots[i] for i in group], rows))
                    continue
                except RuntimeError as exc:  # a shape whose capture fails (out of memory, say): eager from now on
                    self._prefill_graphs_off(exc)
            last, captured = self._rows([slots[i] for i in group], rows, [0] * len(group), aux_layers)
            logits.append(last)
            if aux_layers:
                aux.append(torch.cat([captured[layer] for layer in aux_layers], dim=-1))
        return torch.cat(logits), (torch.cat(aux) if aux_layers else None)

    def extend(self, slots: list[int], tokens, positions, aux_layers=()):
        """Rows of ``n`` tokens [B, n] at consecutive positions [B, n] of their slots (a row's keys at those
        positions and beyond are overwritten: a row attends to the keys up to the position it reads): (logits
        [B, n, V] float32, the ``aux_layers``' outputs concatenated [B, n, n_aux*H] or None)."""
        rows, count = tokens.shape
        device = self.device
        slot_ids = torch.tensor(slots, device=device)
        write = (slot_ids[:, None] * self.slot_tokens + positions).reshape(-1)
        used = (positions[:, -1] + 1).to(torch.int32)
        cu_q = torch.arange(rows + 1, dtype=torch.int32, device=device) * count
        key_start = torch.cat([slot_ids * self.slot_tokens,
                               torch.tensor([(self.slots + 1) * self.slot_tokens], device=device)]).to(torch.int32)
        # Checked on every read (one host copy): a row past its slot would write into the next slot's keys.
        ends = used.tolist()
        self._check_room(slots, ends)
        host = None if self.flash else (cu_q.tolist(), key_start.tolist(), ends)
        logits, captured = self.forward(tokens.reshape(-1), positions.reshape(-1), write, cu_q, count, key_start, used,
                                        aux_layers=aux_layers, host=host)
        aux = torch.cat([captured[layer] for layer in aux_layers], dim=-1).view(rows, count, -1) if aux_layers \
            else None
        return logits.view(rows, count, -1), aux

    def _rows(self, slots: list[int], rows: list[list[int]], starts: list[int], aux_layers=()):
        """Row ``b``'s tokens ``rows[b]`` written at positions ``starts[b]..`` of slot ``slots[b]``, packed
        into one forward: (the logits [B, V] float32 of each row's last token, {aux layer: its output for
        every token})."""
        lengths = [len(row) for row in rows]
        cu_q, key_start, used = self._layout(slots, lengths, starts)
        positions = [start + p for start, length in zip(starts, lengths) for p in range(length)]
        write = [slot * self.slot_tokens + start + p
                 for slot, start, length in zip(slots, starts, lengths) for p in range(length)]
        device = self.device
        return self.forward(
            torch.tensor([t for row in rows for t in row], device=device),
            torch.tensor(positions, device=device), torch.tensor(write, device=device),
            torch.tensor(cu_q, dtype=torch.int32, device=device), max(lengths),
            torch.tensor(key_start, dtype=torch.int32, device=device),
            torch.tensor(used, dtype=torch.int32, device=device),
            select=torch.tensor([c - 1 for c in cu_q[1:]], device=device), aux_layers=aux_layers,
            host=(cu_q, key_start, used))

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]):
        """One token per row at its position in its slot: the logits [n, V] float32 of each row."""
        self._check_room(slots, [p + 1 for p in positions])
        if self.graphs_on:
            return self._replay(slots, tokens, positions)
        return self._rows(slots, [[token] for token in tokens], positions)[0]

    # -- prefills padded to a graph's shape --------------------------------------------------------------
    def _prefill_shape(self, rows: list[list[int]], limit: int | None = None) -> tuple[int, int, int] | None:
        """(tokens, rows, tokens a row at most) of the padded forward that prefills ``rows``, or None when
        it is too large for a graph (``limit``: the most tokens, ``prefill_graph_tokens`` unless given)."""
        limit = self.prefill_graph_tokens if limit is None else limit
        count = sum(len(row) for row in rows)
        if not limit or count > limit:
            return None
        tokens = max(_bucket(count, limit), min(PREFILL_GRAPH_MIN_TOKENS, limit))
        longest = min(tokens, self.slot_tokens)  # a prompt fits its slot; a padding row fits the scratch slot
        padding_rows = -(-(tokens - count) // longest)
        return tokens, _bucket(len(rows) + padding_rows, 1 << 30), longest

    def _prefill_layout(self, slots: list[int], rows: list[list[int]], shape: tuple[int, int, int]):
        """Host tensors of one padded prefill forward of ``shape`` (``_prefill_shape``): row ``b`` writes
        ``rows[b]`` at positions 0.. of slot ``slots[b]``; the padding tokens (id 0) go in rows of at most
        ``longest`` tokens over the scratch slot, each at positions 0.. (so equal positions get equal keys), then
        rows of no tokens. ``select``: each real row's last token (then 0)."""
        tokens, count_rows, longest = shape
        lengths = [len(row) for row in rows]
        used = sum(lengths)
        pad = tokens - used
        pad_lengths = [min(longest, pad - start) for start in range(0, pad, longest)]
        all_lengths = torch.tensor(lengths + pad_lengths + [0] * (count_rows - len(lengths) - len(pad_lengths)),
                                   dtype=torch.long)
        cu_q = torch.zeros(count_rows + 1, dtype=torch.long)
        torch.cumsum(all_lengths, 0, out=cu_q[1:])
        row_of = torch.repeat_interleave(torch.arange(count_rows), all_lengths)  # [tokens]
        positions = torch.arange(tokens) - cu_q[:-1][row_of]
        starts = torch.tensor(slots + [self.scratch] * (count_rows - len(slots)), dtype=torch.long) * self.slot_tokens
        ids = torch.zeros(tokens, dtype=torch.long)
        if used:
            ids[:used] = torch.tensor([t for row in rows for t in row], dtype=torch.long)
        key_start = torch.cat([starts, torch.tensor([(self.slots + 1) * self.slot_tokens])])
        select = torch.zeros(count_rows, dtype=torch.long)
        select[: len(rows)] = cu_q[1: len(rows) + 1] - 1
        return {"tokens": ids, "positions": positions, "write": starts[row_of] + positions, "cu_q": cu_q,
                "key_start": key_start, "used": all_lengths, "select": select}

    def _padded_forward(self, slots: list[int], rows: list[list[int]], shape: tuple[int, int, int]):
        """The padded prefill forward, eagerly (what a prefill graph replays; tests compare it with ``_rows``):
        the logits [B, V] float32 of each row's last token."""
        layout = self._prefill_layout(slots, rows, shape)
        device = self.device
        host = None if self.flash else (layout["cu_q"].tolist(), layout["key_start"].tolist(), layout["used"].tolist())
        logits, _ = self.forward(
            layout["tokens"].to(device), layout["positions"].to(device), layout["write"].to(device),
            layout["cu_q"].to(device, torch.int32), shape[2], layout["key_start"].to(device, torch.int32),
            layout["used"].to(device, torch.int32), select=layout["select"].to(device), host=host)
        return logits[: len(rows)]

    def _prefill_buffers(self) -> dict[str, torch.Tensor]:
        """The prefill graphs' input buffers (each graph reads its first tokens and rows) and pinned staging."""
        if self._prefill_static is None:
            most = self.prefill_graph_tokens
            rows = _bucket(self.slots + -(-most // min(most, self.slot_tokens)), 1 << 30) + 1
            device = self.device
            self._prefill_static = {
                **{name: torch.zeros(most, dtype=torch.long, device=device)
                   for name in ("tokens", "positions", "write")},
                **{name: torch.zeros(rows, dtype=torch.int32, device=device) for name in ("cu_q", "key_start", "used")},
                "select": torch.zeros(rows, dtype=torch.long, device=device),
                "staging": torch.zeros((7, max(most, rows)), dtype=torch.long).pin_memory(),
            }
        return self._prefill_static

    def _load_prefill(self, layout: dict[str, torch.Tensor]) -> None:
        """Copy a layout into the prefill graphs' input buffers (through pinned memory)."""
        static = self._prefill_buffers()
        staging = static["staging"]
        for index, name in enumerate(("tokens", "positions", "write", "cu_q", "key_start", "used", "select")):
            size = layout[name].shape[0]
            staging[index, :size] = layout[name]
            static[name][:size].copy_(staging[index, :size], non_blocking=True)

    def _prefill_graph(self, shape: tuple[int, int, int]):
        """The captured padded prefill of ``shape`` (captured at its first use, over a layout of padding alone)."""
        if shape in self._prefill_graphs:
            return self._prefill_graphs[shape]
        tokens, rows, longest = shape
        static = self._prefill_buffers()
        self._load_prefill(self._prefill_layout([], [], shape))
        args = (static["tokens"][:tokens], static["positions"][:tokens], static["write"][:tokens],
                static["cu_q"][: rows + 1], longest, static["key_start"][: rows + 1], static["used"][:rows])
        select = static["select"][:rows]
        graph, (logits, _) = self._capture(lambda: self.forward(*args, select=select))
        self._prefill_graphs[shape] = (graph, logits)
        return self._prefill_graphs[shape]

    def _prefill_graphs_off(self, exc: Exception) -> None:
        """Prefill eagerly from now on, this prefill too: replaying or capturing a prefill graph failed."""
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        LOG.warning("a prefill (graphs up to %s tokens) could not replay a CUDA graph (%s): prefills are eager "
                    "from now on", self.prefill_graph_tokens, reason)
        self.prefill_graph_tokens = 0
        self.prefill_graphs_failure = reason
        self._prefill_graphs.clear()

    def _prefill_replay(self, slots: list[int], rows: list[list[int]]):
        """Prefill ``rows`` into ``slots`` by replaying the graph of their padded shape: the logits [B, V]."""
        shape = self._prefill_shape(rows)
        graph, logits = self._prefill_graph(shape)
        self._load_prefill(self._prefill_layout(slots, rows, shape))
        graph.replay()
        out = logits[: len(rows)].clone()  # the graph's output buffer is its next replay's too
        torch.cuda.current_stream().synchronize()  # the staging buffer is the next prefill's
        return out

    # -- CUDA graphs ----------------------------------------------------------------------------------
    def _static_inputs(self) -> dict[str, torch.Tensor]:
        """One set of input buffers for every graph (each graph reads its first B rows)."""
        if self._static is None:
            size, device = self.slots, self.device
            self._static = {
                "tokens": torch.zeros(size, dtype=torch.long, device=device),
                "positions": torch.zeros(size, dtype=torch.long, device=device),
                "write": torch.zeros(size, dtype=torch.long, device=device),
                "key_start": torch.zeros(size + 1, dtype=torch.int32, device=device),
                "used": torch.ones(size, dtype=torch.int32, device=device),
                "cu_q": torch.arange(size + 1, dtype=torch.int32, device=device),
                "staging": torch.zeros((4, size), dtype=torch.long).pin_memory(),
            }
        return self._static

    def _graph(self, size: int):
        """The captured decode step of ``size`` rows (captured at its first use)."""
        if size in self._graphs:
            return self._graphs[size]
        static = self._static_inputs()
        args = (static["tokens"][:size], static["positions"][:size], static["write"][:size],
                static["cu_q"][: size + 1], 1, static["key_start"][: size + 1], static["used"][:size])
        # Padding rows: the scratch slot, one token.
        static["write"][:size].fill_(self.scratch * self.slot_tokens)
        static["key_start"][: size + 1].fill_(self.scratch * self.slot_tokens)
        static["used"][:size].fill_(1)
        graph, (logits, _) = self._capture(lambda: self.forward(*args))
        self._graphs[size] = (graph, logits)
        return self._graphs[size]

    def _capture(self, run):
        """``run()`` (a forward over static buffers) captured as a CUDA graph in the decoder's one memory pool, after a
        warm-up on a side stream that chooses and loads its kernels: (the graph, what the captured run returned)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the capture writers' copies on other threads go on while this thread captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = run()
        return graph, out

    def _replay(self, slots, tokens, positions):
        n = len(slots)
        size = _bucket(n, self.slots)
        graph, logits = self._graph(size)
        static = self._static_inputs()
        staging = static["staging"]
        pad = size - n
        scratch = self.scratch * self.slot_tokens
        staging[0, :size] = torch.tensor(tokens + [0] * pad)
        staging[1, :size] = torch.tensor(positions + [0] * pad)
        staging[2, :size] = torch.tensor([s * self.slot_tokens + p for s, p in zip(slots, positions)]
                                         + [scratch] * pad)
        staging[3, :size] = torch.tensor([s * self.slot_tokens for s in slots] + [scratch] * pad)
        static["tokens"][:size].copy_(staging[0, :size], non_blocking=True)
        static["positions"][:size].copy_(staging[1, :size], non_blocking=True)
        static["write"][:size].copy_(staging[2, :size], non_blocking=True)
        static["key_start"][:size].copy_(staging[3, :size], non_blocking=True)
        static["key_start"][size] = (self.slots + 1) * self.slot_tokens
        static["used"][:n].copy_(static["positions"][:n] + 1)
        static["used"][n:size].fill_(1)
        graph.replay()
        # A copy: the graph's output buffer is the next replay's too (a caller may keep several steps).
        out = logits[:n].clone()
        # The staging buffer is reused by the next step: wait until this one's copies have left it.
        waited = time.perf_counter()
        torch.cuda.current_stream().synchronize()
        self.replay_wait_s += time.perf_counter() - waited
        return out
