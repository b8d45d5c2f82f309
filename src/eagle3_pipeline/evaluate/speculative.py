"""Greedy chain speculative decoding with the target and the EAGLE-3 drafter, as SGLang serves it, batched.

A batch of requests is decoded together, greedy, chain drafting (SGLang's ``--speculative-eagle-topk 1``); each
request follows exactly the steps of a request served alone:

1. prefill: the target reads the prompt x_0..x_{P-1} (its aux states a_0..a_{P-1} taken by the
   reference engine's forward hooks) and picks x_P, the first output token;
2. draft extend: the drafter reads rows t = 0..P-1, each pairing a_t with x_{t+1} at position t
   (its step-0 keys go into the drafter's own KV cache, as SGLang's draft extend writes them);
3. draft: from the last row's output the drafter proposes d_1 (top-1 of its draft vocabulary,
   mapped to a target id by d2t: target = i + d2t[i]); each further step feeds the previous step's
   output hidden state with the token just proposed, one position further, and proposes the next,
   k tokens in all; the steps' keys are dropped afterwards (SGLang frees those slots too);
4. verify: ONE target forward over [last token, d_1..d_k]: the longest prefix of drafts equal to the
   target's own greedy choices is accepted, plus the target's next token after it (the bonus), so
   every round yields 1..k+1 tokens; the rejected drafts' cache slots are masked out for good;
5. draft extend over the verified rows (aux of each verified position with the token after it),
   and on to 3 until ``max_new_tokens`` or an end-of-sequence token.

This is the alignment the drafter was trained on (``train/model.py``'s docstring).

Batching. The requests of a batch share one target forward per round and one drafter forward per
step. Each request keeps its own positions (``position_ids``), and both KV caches (the target's
transformers cache and the drafter's own) carry a validity mask over their slots: a prompt's right
padding and a round's rejected drafts stay in the cache as masked-out slots, so no request ever
attends to another's tokens or to a token it did not accept. A request that finished (end token or
budget) rides along until its batch ends; its rounds are not counted.

The oracle. Every output token is meant to be the target's greedy choice given the tokens before it.
``TargetModel.greedy_reference`` decodes the same prompts by FULL forwards of the whole sequence at
every step, with no KV cache at all, so it shares nothing with the cached path it checks: a cache that
is ignored, misaligned or stale shows up as outputs that differ. Where outputs differ, the two paths'
top-2 logits at the first difference tell a numerical near-tie (each path's choice is the other's
runner-up, both gaps within the dtype's rounding) from a real fault.

The replay. ``replay_chains`` plays the same greedy chain decoding once more without any cache: one
full forward of the target over prompt + reference output gives every aux state, the drafter's
training forward (``forward_ttt``, teacher-forced on those tokens) gives its top-1 at every row and
step, and the rounds are counted from them exactly as ``speculative_generate`` counts its own (a
draft is right while the chain is: its inputs are then the reference's tokens). With exact
arithmetic both give the same rounds; the measured figures falling short of the replay's means the
serving path loses what the drafter can do (a cache, a position or a row misread), while both falling
short of the training's prediction means these prompts are unlike the training data.

Accounting. tau (acceptance length) = tokens produced by verify forwards / verify forwards =
1 + mean drafts accepted per round when no round is cut by an end token (a round that produces an
end token stops there: it may produce fewer than its accepted drafts + 1); the prefill and its first
token are counted in neither. SGLang's meta_info ``spec_accept_length`` = completion_tokens /
spec_verify_ct counts the prefill's token on top but not the prefill forward:
``sglang_accept_length`` reports that figure too. Near the budget a round drafts only
``min(k, tokens left - 1)``, so a round never produces tokens past ``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3_pipeline.evaluate.rounds import AcceptanceStats, Round, answer_rounds, token_counts
from eagle3_pipeline.train.export import DrafterShape, load_export
from eagle3_pipeline.train.kernels import rope_cos_sin
from eagle3_pipeline.train.model import DrafterConfig, Eagle3Drafter

# Prompt tokens (padded) per batch forward of the reference decode and per prefill: bounds the
# activations and KV cache a batch holds at once.
DEFAULT_BATCH_TOKENS = 65536
# Rows x width^2 of a full (prefill or reference) forward per batch: a masked attention materialises
# scores of that many elements per head (an H200 ran out of memory at 200 prompts of up to 2,700
# tokens with no such bound: 118 GiB asked for).
ATTENTION_ELEMENTS = 2**27


class EvaluationError(ValueError):
    """The evaluation cannot run as asked; the message names the file or setting and the fix."""


@dataclass
class Top2:
    """The target's two best tokens where it chose one: (id, logit) each."""

    first_id: int
    first_logit: float
    second_id: int
    second_logit: float


def _top2_rows(values: torch.Tensor, ids: torch.Tensor) -> list[Top2]:
    """Top2 records of [n, 2] value and id tensors (one host copy)."""
    return [Top2(int(i[0]), float(v[0]), int(i[1]), float(v[1])) for v, i in zip(values.tolist(), ids.tolist())]


# -- the target ---------------------------------------------------------------------------------
@dataclass
class TargetCache:
    """A batch's KV cache on the target and which of its slots hold tokens each request may attend to."""

    cache: object  # the engine's transformers cache
    valid: torch.Tensor  # [B, L] long: 1 for a slot of the request's own accepted tokens

    def drop(self, keep: torch.Tensor) -> None:
        """Mask out the last ``keep.shape[1]`` slots where ``keep`` [B, n] is False (rejected drafts)."""
        n = keep.shape[1]
        self.valid[:, -n:] = self.valid[:, -n:] * keep.to(self.valid.dtype)

    def release(self) -> None:
        """Nothing held beyond this object."""


@dataclass
class SlotRows:
    """A batch's rows in the engine's slot cache (``engine/slots.py``), row ``b`` in ``slots[b]``.

    A read writes each row's keys at the positions it reads and attends to the keys up to there, so the
    next round's read overwrites a round's rejected drafts: nothing needs masking.
    """

    decoder: object  # engine/slots.py's SlotDecoder
    slots: list[int]

    def drop(self, keep: torch.Tensor) -> None:
        """Nothing to mask (see the class docstring)."""

    def release(self) -> None:
        """Give the slots back."""
        self.decoder.release(self.slots)
        self.slots = []


class TargetModel:
    """The target on the reference engine's ``ModelRunner``: its model loading, device and dtype choice,
    aux-layer forward hooks (checked at load against ``hidden_states[i + 1]``, and its cached forwards
    against full ones), used here for batched cached forwards and for full-forward greedy decoding."""

    def __init__(self, runner, decode: str = "slots"):
        self.runner = runner
        self.device = runner.device
        self.dtype_name = runner.dtype_name
        self.aux_layers = list(runner.aux_layers)
        self.eos_token_ids = set(runner.eos_token_ids)
        self.slots = decode == "slots"  # the engine's slot cache for the batches that fit it

    def reserve(self, max_new_tokens: int, draft_tokens: int) -> int:
        """KV-cache positions a request's decode adds to its prompt's, at most: over the slot cache a round's
        rejected drafts are overwritten by the next (``max_new_tokens`` + a round's drafts and its token); in
        transformers' cache they stay, masked, so every round may add ``draft_tokens`` + 1."""
        if self.slots:
            return max_new_tokens + draft_tokens + 1
        return max_new_tokens * (draft_tokens + 1)

    @classmethod
    def load(cls, model_path: str | Path, aux_layers: list[int], device: str = "auto", dtype: str = "auto",
             decode: str = "slots") -> TargetModel:
        """Load the target directory (config.json, weights, tokenizer) with the aux layers hooked. ``decode``
        ``slots``: the speculative decoding reads the target over the engine's slot cache (flash attention per
        request, no padding, nothing masked) when the model passes the engine's check; ``transformers``: over
        transformers' own cache, with masks."""
        from eagle3_pipeline.engine.batcher import ModelRunner  # noqa: PLC0415 - loads transformers

        return cls(ModelRunner(str(model_path), device=device, dtype=dtype, aux_layers=aux_layers), decode)

    def _slot_decoder(self, rows: int, tokens: int):
        """The engine's slot cache with ``rows`` slots of ``tokens`` (made, or remade larger), or None: then
        transformers' cache (slots off, the model failed the engine's check, or a longer context than it has)."""
        runner = self.runner
        decoder = runner.slot_decoder
        if not self.slots:
            return None
        if decoder is None or decoder.slots < rows or decoder.slot_tokens < tokens:
            tokens = -(-tokens // 256) * 256  # rounded up: fewer remakes as the batches grow
            if tokens > runner.context_length:
                return None
            runner.slot_decoder = decoder = None  # the old cache's memory goes before the new one is taken
            if not runner.enable_slots(rows, tokens, graphs=False):
                self.slots = False
                return None
            decoder = runner.slot_decoder
        return decoder

    @property
    def tokenizer(self):
        """The target's tokenizer (None when the directory has none)."""
        return self.runner.tokenizer

    def input_embeddings(self) -> torch.Tensor:
        """The target's input embeddings [V, H] (the drafter shares them, as SGLang's ``set_embed`` does)."""
        return self.runner.model.get_input_embeddings().weight

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None):
        """One decoder forward: (aux [B, n, n_aux*H], last hidden states [B, n, H])."""
        out, captured = self.runner._run_decoder(  # noqa: SLF001 - the engine's hooked forward
            input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache)
        aux = torch.cat([captured[layer] for layer in self.aux_layers], dim=-1)
        return aux, out.last_hidden_state

    def _top2(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two best (logit, id) of lm_head(hidden) [.., H]: values and ids [.., 2] (``_top2_of``)."""
        return self._top2_of(self.runner.lm_head(hidden).float())

    @staticmethod
    def _top2_of(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two best (logit, id) of logits [.., V]: values and ids [.., 2].

        The first is ``argmax`` (the lowest id among exact ties, as the engine's greedy decode picks);
        ``topk`` alone orders exact ties arbitrarily."""
        top = logits.topk(2, dim=-1)
        first = logits.argmax(dim=-1, keepdim=True)
        second = torch.where(top.indices[..., :1] == first, top.indices[..., 1:], top.indices[..., :1])
        ids = torch.cat([first, second], dim=-1)
        return logits.gather(-1, ids), ids

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], room: int = 0) -> tuple[TargetCache | SlotRows, torch.Tensor,
                                                                       list[Top2]]:
        """Read the prompts into a new cache, each with ``room`` more tokens to come: (the batch's cache, aux
        [B, W, n_aux*H] right-padded to the longest prompt, top-2 after each prompt). Over the engine's slot
        cache when it can hold them (``_slot_decoder``), else right-padded into transformers' cache."""
        lengths = [len(prompt) for prompt in prompts]
        width = max(lengths)
        decoder = self._slot_decoder(len(prompts), width + room)
        if decoder is not None:
            state = SlotRows(decoder, decoder.take(len(prompts)))
            logits, packed = decoder.prefill(state.slots, prompts, self.aux_layers)
            rows = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lengths)).to(self.device)
            columns = torch.cat([torch.arange(length) for length in lengths]).to(self.device)
            aux = packed.new_zeros((len(prompts), width, packed.shape[-1]))
            aux[rows, columns] = packed
            values, top_ids = self._top2_of(logits)
            return state, aux, _top2_rows(values, top_ids)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        valid = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            ids[b, : lengths[b]] = torch.tensor(prompt, dtype=torch.long)
            valid[b, : lengths[b]] = 1
        ids, valid = ids.to(self.device), valid.to(self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        state = TargetCache(self.runner._new_cache(), valid)  # noqa: SLF001 - the engine's cache type
        aux, last = self._forward(ids, positions, valid, state.cache)
        ends = torch.tensor(lengths, device=self.device) - 1
        values, top_ids = self._top2(last[torch.arange(len(prompts), device=self.device), ends])
        return state, aux, _top2_rows(values, top_ids)

    @torch.inference_mode()
    def extend(self, state: TargetCache | SlotRows, ids: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read ids [B, n] at positions [B, n] into the cache: (aux [B, n, n_aux*H], top-2 values and ids [B, n, 2]).

        In transformers' cache the new slots are valid until ``state.drop`` masks the rejected ones out.
        """
        if isinstance(state, SlotRows):
            logits, aux = state.decoder.extend(state.slots, ids, positions, self.aux_layers)
            values, top_ids = self._top2_of(logits)
            return aux, values, top_ids
        state.valid = torch.cat([state.valid, torch.ones_like(ids)], dim=1)
        aux, last = self._forward(ids, positions, state.valid, state.cache)
        values, top_ids = self._top2(last)
        return aux, values, top_ids

    @torch.inference_mode()
    def next_token_logits(self, sequence: list[int]) -> torch.Tensor:
        """The target's logits [V] (float32) after ``sequence``, by a full forward without any cache."""
        out, _ = self.runner._run_decoder(  # noqa: SLF001 - the engine's forward
            input_ids=torch.tensor([sequence], device=self.device))
        return self.runner.lm_head(out.last_hidden_state[0, -1]).float()

    @torch.inference_mode()
    def full_states(self, sequence: list[int]) -> torch.Tensor:
        """The aux states [T, n_aux*H] of ``sequence`` by one full forward, no cache (the replay's input)."""
        ids = torch.tensor([sequence], device=self.device)
        aux, _ = self._forward(ids, torch.arange(len(sequence), device=self.device)[None], torch.ones_like(ids))
        return aux[0]

    @torch.inference_mode()
    def greedy_reference(self, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = False,
                         batch_tokens: int = DEFAULT_BATCH_TOKENS) -> list[tuple[list[int], list[Top2]]]:
        """The target's greedy decode of each prompt by a FULL forward of the whole sequence per token, no cache.

        Independent of the cached path on purpose (see the module docstring). Returns per prompt the output
        ids and the top-2 at each output token. Requests are batched up to ``batch_tokens`` padded tokens.
        """
        stops = set() if ignore_eos else self.eos_token_ids
        sequences = [list(prompt) for prompt in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        tops: list[list[Top2]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            if not active:
                break
            for chunk in _chunks(sorted(active, key=lambda b: len(sequences[b])), [len(s) for s in sequences],
                                 batch_tokens):
                width = max(len(sequences[b]) for b in chunk)
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, b in enumerate(chunk):
                    ids[row, : len(sequences[b])] = torch.tensor(sequences[b])
                    mask[row, : len(sequences[b])] = 1
                ids, mask = ids.to(self.device), mask.to(self.device)
                out, _ = self.runner._run_decoder(input_ids=ids, attention_mask=mask)  # noqa: SLF001
                ends = mask.sum(1) - 1
                values, top_ids = self._top2(out.last_hidden_state[torch.arange(len(chunk), device=self.device), ends])
                for row, top in zip(chunk, _top2_rows(values, top_ids)):
                    sequences[row].append(top.first_id)
                    outputs[row].append(top.first_id)
                    tops[row].append(top)
            active = [b for b in active if outputs[b][-1] not in stops and len(outputs[b]) < max_new_tokens]
        return list(zip(outputs, tops))


def judge_mismatches(target: TargetModel, prompts: list[list[int]], mismatches: list[Mismatch | None]) -> None:
    """Settle each mismatch's ``gap`` and ``near_tie`` by the target's full forward of the tokens before it
    (one forward per mismatch: they are few, or the run is failing anyway)."""
    share = NEAR_TIE_RELATIVE.get(target.dtype_name, NEAR_TIE_RELATIVE["bfloat16"])
    for prompt, mismatch in zip(prompts, mismatches):
        if mismatch is None or mismatch.reference is None or mismatch.ours_token is None:
            continue
        logits = target.next_token_logits([*prompt, *mismatch.context])
        mismatch.gap = float(logits[mismatch.reference.first_id] - logits[mismatch.ours_token])
        mismatch.near_tie = mismatch.gap <= share * max(float(logits.max().abs()), 1.0)


def _chunks(order: list[int], lengths: list[int], batch_tokens: int, forward_lengths: list[int] | None = None
            ) -> list[list[int]]:
    """Consecutive groups of ``order`` whose padded size (rows x longest of ``lengths``) stays within
    ``batch_tokens`` and whose attention over a full forward (rows x longest of ``forward_lengths``, squared)
    stays within ``ATTENTION_ELEMENTS``: a masked forward materialises scores of that size per head."""
    forward_lengths = forward_lengths or lengths
    groups: list[list[int]] = []
    current: list[int] = []
    longest = widest = 0
    for index in order:
        wider = max(longest, lengths[index])
        wider_forward = max(widest, forward_lengths[index])
        if current and (wider * (len(current) + 1) > batch_tokens
                        or wider_forward ** 2 * (len(current) + 1) > ATTENTION_ELEMENTS):
            groups.append(current)
            current, wider, wider_forward = [], lengths[index], forward_lengths[index]
        current.append(index)
        longest, widest = wider, wider_forward
    if current:
        groups.append(current)
    return groups


def batches_by_tokens(prompts: list[list[int]], batch_tokens: int, reserve: int = 0) -> list[list[int]]:
    """Indices of ``prompts`` in batches of similar length (sorted), each within ``batch_tokens`` padded tokens
    counting ``reserve`` more per request (the KV-cache slots its decode adds), and its prefill's attention
    within ``ATTENTION_ELEMENTS``."""
    lengths = [len(prompt) + reserve for prompt in prompts]
    return _chunks(sorted(range(len(prompts)), key=lambda b: lengths[b]), lengths, batch_tokens,
                   [len(prompt) for prompt in prompts])


# -- the drafter --------------------------------------------------------------------------------
def drafter_config(config: dict) -> DrafterConfig:
    """The ``DrafterConfig`` of an export's config.json (checked by the exporter's own ``DrafterShape``)."""
    shape = DrafterShape.from_config(config)
    aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return DrafterConfig(
        hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size, target_hidden_size=shape.target_hidden_size,
        num_aux_hidden_states=len(aux) if aux else shape.num_aux_hidden_states, vocab_size=shape.vocab_size,
        draft_vocab_size=shape.draft_vocab_size, rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta,
        rope_scaling=shape.rope_scaling, max_position_embeddings=shape.max_position_embeddings,
        hidden_act=config.get("hidden_act", "silu"), **shape.variant_flags, **shape.layout_fields,
    )  # fmt: skip


def drafter_aux_layers(config: dict) -> list[int]:
    """The aux layers (0-based, output of that layer) the drafter was trained on, from its config."""
    ours = (config.get("eagle3_pipeline") or {}).get("aux_layers")
    theirs = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = ours if ours is not None else theirs
    if not layers:
        raise EvaluationError("the drafter's config.json names no aux layers (eagle_config."
                              "eagle_aux_hidden_state_layer_ids); it was not exported by eagle3-pipeline train")
    return [int(layer) for layer in layers]


def load_drafter(drafter_dir: str | Path, target_embeddings: torch.Tensor | None = None,
                 device: torch.device | str = "cpu") -> tuple[Eagle3Drafter, dict]:
    """The exported drafter (``load_export`` checks its files) with the target's embeddings; (model, config)."""
    state, config = load_export(drafter_dir)
    drafter = Eagle3Drafter(drafter_config(config), state["d2t"], state["t2d"])
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    # embed_tokens is the target's (SGLang shares it) unless the export carries one of its own.
    if [name for name in missing if name != "embed_tokens.weight"] or unexpected:
        raise EvaluationError(f"{drafter_dir}: weights do not fit the drafter (missing {missing}, "
                              f"unexpected {unexpected})")
    if "embed_tokens.weight" not in state:
        if target_embeddings is None:
            raise EvaluationError(f"{drafter_dir}: the export has no embed_tokens and no target embeddings were "
                                  "given")
        drafter.load_target_embeddings(target_embeddings.detach().float().cpu())
    return drafter.to(device).eval(), config


class EagleProposer:
    """The drafter with its own KV cache, serving-style, for a batch: ``extend`` over verified rows, ``propose``
    k drafts per request."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.device = drafter.fc.weight.device
        d2t = drafter.d2t
        self.draft_to_target = d2t + torch.arange(d2t.numel(), device=d2t.device)  # [D] target ids
        self.reset(1)

    def reset(self, batch_size: int) -> None:
        """Forget every request: a new batch of ``batch_size`` starts with ``extend`` at position 0."""
        self.keys: torch.Tensor | None = None  # [B, kv_heads, L, hd]: the committed (extend) rows' keys
        self.values: torch.Tensor | None = None
        self.key_valid: torch.Tensor | None = None  # [B, L] bool
        hidden_size = self.drafter.config.hidden_size
        self.last_hidden = torch.zeros((batch_size, hidden_size), device=self.device)  # output of the last row
        self.last_position = torch.full((batch_size,), -1, dtype=torch.long, device=self.device)
        self.extended = torch.zeros(batch_size, dtype=torch.bool, device=self.device)

    def _layer(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:
        """One pass of the midlayer over n rows per request (hidden [B, n, H], tokens, positions and valid [B, n]);
        what each row carries to the next step (``Eagle3Drafter.carry``).

        Each row attends to its request's valid cached keys and causally to the valid new rows before it (and
        always to itself); the rows' keys are appended to the cache, marked by ``valid``.
        """
        drafter = self.drafter
        layer, attn = drafter.midlayer, drafter.midlayer.self_attn
        embeds = drafter.embed_tokens(token_ids).to(hidden.dtype)  # [B, n, H]
        x = layer.attention_input(embeds, hidden)  # [B, n, 2H]
        cos, sin = rope_cos_sin(drafter.inv_freq, positions)
        q, k, v = attn.project(x, cos, sin)  # [B, heads, n, hd], [B, kv, n, hd] x2
        keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        values = v if self.values is None else torch.cat([self.values, v], dim=2)
        key_valid = valid if self.key_valid is None else torch.cat([self.key_valid, valid], dim=1)
        rows, past = token_ids.shape[1], keys.shape[2] - token_ids.shape[1]
        index = torch.arange(past + rows, device=hidden.device)
        query = torch.arange(rows, device=hidden.device)[:, None] + past
        causal = index[None, :] <= query  # [n, L]
        mask = (key_valid[:, None, :] & causal[None]) | (index[None, :] == query)[None]  # [B, n, L]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None],
                                             enable_gqa=attn.kv_heads != attn.heads, scale=attn.scale)
        out = out.transpose(1, 2).reshape(hidden.shape[0], rows, attn.out_width)
        self.keys, self.values, self.key_valid = keys, values, key_valid
        return drafter.carry(layer.finish(hidden, out))

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor) -> None:
        """Rows of verified positions: aux [B, n, n_aux*H_t] of each with the token after it [B, n] at positions
        [B, n]; ``valid`` [B, n] says which rows a request really has (the rest is padding)."""
        fc = self.drafter.fc.weight
        hidden = self.drafter.fuse_aux(aux.to(device=fc.device, dtype=fc.dtype))  # [B, n, H]
        valid = valid.to(fc.device)
        out = self._layer(hidden, token_ids.to(fc.device), positions.to(fc.device), valid)
        has = valid.any(dim=1)
        last = (valid.long() * torch.arange(valid.shape[1], device=fc.device)).argmax(dim=1)  # last valid row
        rows = torch.arange(valid.shape[0], device=fc.device)
        self.last_hidden = torch.where(has[:, None], out[rows, last], self.last_hidden)
        self.last_position = torch.where(has, positions.to(fc.device)[rows, last], self.last_position)
        self.extended |= has

    @torch.inference_mode()
    def propose(self, count: int) -> torch.Tensor:
        """``count`` chain drafts per request (target ids [B, count]); the steps' keys are dropped after."""
        if not bool(self.extended.all()):
            raise RuntimeError("propose() before extend(): the drafter has read no verified rows of some request")
        committed = self.keys.shape[2]
        hidden, drafts = self.last_hidden, []
        every = torch.ones((hidden.shape[0], 1), dtype=torch.bool, device=hidden.device)
        for step in range(count):
            token = self.draft_to_target[self.drafter.logits(hidden).argmax(dim=-1)]  # [B]
            drafts.append(token)
            if step + 1 < count:
                position = (self.last_position + step + 1)[:, None]
                hidden = self._layer(hidden[:, None], token[:, None], position, every)[:, 0]
        self.keys, self.values = self.keys[:, :, :committed], self.values[:, :, :committed]
        self.key_valid = self.key_valid[:, :committed]
        return torch.stack(drafts, dim=1) if drafts else torch.zeros((hidden.shape[0], 0), dtype=torch.long,
                                                                    device=hidden.device)


# -- the oracle's verdict ---------------------------------------------------------------------------
# A difference between the speculative output and the full-forward reference is a numerical near-tie
# when, in the target's own full forward at that token, the token the speculative path chose scores
# within this share of the top logit's size below the target's choice: a few units of the last place
# of bf16/fp16 (8 and 11 significant bits) after the rounding of dozens of layers computed in another
# order (a batched, cached forward against a full one), and far below that in float32. A cache that
# is ignored or misaligned picks tokens far from the top.
NEAR_TIE_RELATIVE = {"float32": 1e-4, "bfloat16": 2.0**-5, "float16": 2.0**-8}


@dataclass
class Mismatch:
    """Where a speculative output first differs from the target's full-forward greedy decode, and why."""

    first_difference: int
    ours: Top2 | None  # the speculative path's top-2 at that token (None: its output ended before)
    reference: Top2 | None  # the full forwards' top-2 there
    ours_token: int | None = None
    context: list[int] = field(default_factory=list)  # the output tokens before the difference (both agree)
    gap: float | None = None  # full forward: logit of the target's choice - logit of ours
    near_tie: bool = False

    def as_dict(self) -> dict:
        """For evaluation.json."""
        return {"first_difference": self.first_difference, "near_tie": self.near_tie, "ours_token": self.ours_token,
                "logit_gap": self.gap, "ours": None if self.ours is None else self.ours.__dict__,
                "reference": None if self.reference is None else self.reference.__dict__,
                "reference_gap": None if self.reference is None
                else self.reference.first_logit - self.reference.second_logit}


def compare_with_reference(ours: SpeculativeOutput, reference: tuple[list[int], list[Top2]]) -> Mismatch | None:
    """None when the speculative output equals the reference decode token for token, else the first difference
    (its ``gap`` and ``near_tie`` are settled by ``TargetModel.judge_mismatches``)."""
    ids, tops = reference
    if ours.output_ids == ids:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours.output_ids, ids)) if a != b), min(len(ids), len(ours.output_ids)))
    return Mismatch(at, ours.top2[at] if at < len(ours.top2) else None, tops[at] if at < len(tops) else None,
                    ours.output_ids[at] if at < len(ours.output_ids) else None, list(ids[:at]))


# -- the decoding loop --------------------------------------------------------------------------
@dataclass
class SpeculativeOutput:
    """One request's speculative decode: its tokens, its rounds, and the target's top-2 at each token."""

    output_ids: list[int]
    rounds: list[Round]
    top2: list[Top2] = field(default_factory=list)


@torch.inference_mode()
def speculative_generate(target: TargetModel, proposer, prompts: list[list[int]], max_new_tokens: int,
                         draft_tokens: int, ignore_eos: bool = False) -> list[SpeculativeOutput]:
    """Greedy chain speculative decoding of a batch of prompts (see the module docstring).

    ``proposer`` has ``reset(batch_size)``, ``extend(aux, token_ids, positions, valid)`` (all [B, n]) and
    ``propose(k) -> target ids [B, k]`` (``EagleProposer``; tests give others, e.g. a perfect oracle).
    ``draft_tokens`` 0: the target decodes alone over the same engine, one token per forward (``proposer`` is
    not called; None will do): the speed drafting is compared with.
    """
    if not prompts or any(not prompt for prompt in prompts):
        raise EvaluationError("an empty prompt: nothing to decode from")
    if max_new_tokens < 1 or draft_tokens < 0:
        raise EvaluationError(f"max_new_tokens ({max_new_tokens}) must be >= 1 and draft_tokens ({draft_tokens}) "
                              ">= 0")
    device = target.device
    stops = set() if ignore_eos else target.eos_token_ids
    batch = len(prompts)
    lengths = [len(prompt) for prompt in prompts]
    state, aux, tops = target.prefill(prompts, room=target.reserve(max_new_tokens, draft_tokens))
    try:
        results = [SpeculativeOutput([top.first_id], [], [top]) for top in tops]
        active = [not (r.output_ids[0] in stops or max_new_tokens <= 1) for r in results]
        # Draft extend over the prompt: a_t paired with x_{t+1} (the prompt's next token, then the first output).
        width = max(lengths)
        tokens = torch.zeros((batch, width), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            tokens[b, : lengths[b]] = torch.tensor([*prompt[1:], results[b].output_ids[0]])
        positions = torch.arange(width, device=device).expand(batch, width)
        drafting = draft_tokens > 0
        if drafting:
            proposer.reset(batch)
            proposer.extend(aux, tokens.to(device), positions,
                            positions < torch.tensor(lengths, device=device)[:, None])
        next_position = torch.tensor(lengths, device=device)  # where each request's last output token goes
        last_token = torch.tensor([r.output_ids[0] for r in results], device=device)
        while any(active):
            counts = [min(draft_tokens, max_new_tokens - len(r.output_ids) - 1) if on else 0
                      for r, on in zip(results, active)]
            drafted = max(counts)
            drafts = proposer.propose(drafted) if drafted else torch.zeros((batch, 0), dtype=torch.long, device=device)
            ids = torch.cat([last_token[:, None], drafts.to(device)], dim=1)  # [B, 1 + drafted]
            steps = torch.arange(drafted + 1, device=device)
            aux, values, top_ids = target.extend(state, ids, next_position[:, None] + steps)
            choices = top_ids[..., 0]  # the target's greedy token after each of those
            leading = (drafts.to(device) == choices[:, :drafted]).long().cumprod(dim=1).sum(dim=1)
            accepted = torch.minimum(leading, torch.tensor(counts, device=device))
            host_accepted, host_choices = accepted.tolist(), choices.tolist()
            host_values, host_ids = values.tolist(), top_ids.tolist()
            extend_valid = torch.zeros((batch, drafted + 1), dtype=torch.bool)
            for b, result in enumerate(results):
                if not active[b]:
                    continue
                taken = host_accepted[b]
                new = host_choices[b][: taken + 1]  # the accepted drafts (equal to the target's choices) and the bonus
                finished = False
                for index, token in enumerate(new):
                    if token in stops:
                        new, finished = new[: index + 1], True
                        break
                result.rounds.append(Round(drafted=counts[b], accepted=taken, produced=len(new)))
                result.output_ids += new
                result.top2 += [Top2(host_ids[b][j][0], host_values[b][j][0], host_ids[b][j][1], host_values[b][j][1])
                                for j in range(len(new))]
                active[b] = not (finished or len(result.output_ids) >= max_new_tokens)
                if active[b]:
                    extend_valid[b, : taken + 1] = True
            state.drop(steps[None, :] <= accepted[:, None])  # the rejected drafts' slots
            # Draft extend over the verified rows: the aux of each with the token after it, which is the target's
            # choice there (an accepted draft equals it; the last one is the bonus).
            if drafting and any(active):
                proposer.extend(aux, choices, next_position[:, None] + steps, extend_valid.to(device))
            # A finished request stays where it is (it rides along, reading at the same positions each round):
            # its reads stay within the room its prefill asked for.
            next_position = next_position + (accepted + 1) * torch.tensor(active, device=device)
            last_token = choices.gather(1, accepted[:, None])[:, 0]
        return results
    finally:
        state.release()  # the batch's slots of the engine's cache


@dataclass
class Replay:
    """``replay_chains``'s result: the rounds per chain length, and the drafter's per-token score over the same
    tokens (``rounds.token_counts``: every output token as a round's start, the training's conditional acc_k)."""

    chains: dict[int, AcceptanceStats]
    token_hits: list[int]
    token_tried: list[int]

    def per_token(self) -> dict:
        """The per-token score for evaluation.json: conditional acc_k and the rows it counts."""
        return {"cond_acc_k": [h / t if t else 0.0 for h, t in zip(self.token_hits, self.token_tried)],
                "rows": self.token_tried[0] if self.token_tried else 0}


@torch.inference_mode()
def replay_chains(target: TargetModel, drafter: Eagle3Drafter, prompts: list[list[int]],
                  reference: list[tuple[list[int], list[Top2]]], chains: list[int], max_new_tokens: int) -> Replay:
    """The rounds greedy chain speculative decoding of ``prompts`` yields when every state comes from full
    forwards (the module docstring's replay), counted per chain length as ``speculative_generate``'s are, and
    the drafter's per-token score over the same output tokens.

    ``reference``: the target's greedy decode of each prompt by full forwards (``greedy_reference``), with the
    same ``max_new_tokens`` (it ends at the end token unless decoded with ``ignore_eos``). A round that reaches
    the end token counts the drafts up to it (the cached decode may also count drafts after it that the target
    happened to choose: a few rounds).
    """
    device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    draft_to_target = drafter.d2t + torch.arange(drafter.d2t.numel(), device=drafter.d2t.device)
    steps_needed = max(chains)
    result = Replay({chain: AcceptanceStats(chain) for chain in chains}, [0] * steps_needed, [0] * steps_needed)
    for prompt, (decoded, _) in zip(prompts, reference):
        output = decoded[:max_new_tokens]
        sequence = [*prompt, *output]
        aux = target.full_states(sequence).to(device=device, dtype=dtype)
        ids = torch.tensor([sequence], device=device)
        steps = drafter.forward_ttt(ids, aux[None], ttt_length=steps_needed)
        predicted = [draft_to_target[logits[0].argmax(-1)].tolist() for logits in steps]  # [step][row]
        leads = replay_leads(len(prompt), output, predicted)
        for chain in chains:
            result.chains[chain].add_walk(answer_rounds(leads, len(output), chain, max_new_tokens))
        hits, tried = token_counts(leads, len(output), steps_needed)
        result.token_hits = [a + b for a, b in zip(result.token_hits, hits)]
        result.token_tried = [a + b for a, b in zip(result.token_tried, tried)]
    return result


def replay_leads(length: int, output: list[int], predicted: list[list[int]]) -> list[int]:
    """Per output token o_i (i = 1..len-1): drafts right in a row from o_i on (``rounds.answer_rounds``'s
    ``leads``). ``length``: the prompt's. The round proposing o_i drafts from row ``length + i - 2`` (the aux
    state there paired with o_{i-1}); step k of that row proposes o_{i+k}."""
    leads = []
    for i in range(1, len(output)):
        anchor, lead = length + i - 2, 0
        while lead < len(predicted) and i + lead < len(output) and predicted[lead][anchor] == output[i + lead]:
            lead += 1
        leads.append(lead)
    return leads
