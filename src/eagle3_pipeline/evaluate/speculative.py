"""Greedy chain speculative decoding with the target and the EAGLE-3 drafter, as SGLang serves it.

One request at a time (batch 1), greedy, chain drafting (SGLang's ``--speculative-eagle-topk 1``):

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
   every round yields 1..k+1 tokens; the target's KV cache is cut back to what was accepted;
5. draft extend over the verified rows (aux of each verified position with the token after it),
   and on to 3 until ``max_new_tokens`` or an end-of-sequence token.

This is the same alignment the drafter was trained on (``train/model.py``'s docstring). Every
output token is the target's greedy choice given the tokens before it, so the output equals the
target's own greedy decode token for token; ``outputs_match`` checks that against the reference
engine's plain decode (``ModelRunner.run_batch``).

Accounting. tau (acceptance length) = tokens produced by verify forwards / verify forwards =
1 + mean drafts accepted per round; the prefill and its first token are counted in neither.
SGLang's meta_info ``spec_accept_length`` = completion_tokens / spec_verify_ct counts the
prefill's token on top but not the prefill forward: ``sglang_accept_length`` reports that figure
too (it is tau + 1/rounds per request). Near the budget a round drafts only
``min(k, tokens left - 1)``, so a round never produces tokens past ``max_new_tokens`` and tau stays
1 + mean accepted exactly (SGLang drafts k and drops the excess; the difference is one round per
request). An end-of-sequence token ends the request where it stands, as in SGLang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3_pipeline.train.export import DrafterShape, load_export
from eagle3_pipeline.train.model import DrafterConfig, Eagle3Drafter, rope_cos_sin


class EvaluationError(ValueError):
    """The evaluation cannot run as asked; the message names the file or setting and the fix."""


# -- the target ---------------------------------------------------------------------------------
class TargetModel:
    """The target on the reference engine's ``ModelRunner``: its model loading, device and dtype
    choice, aux-layer forward hooks (checked against ``hidden_states[i + 1]`` at load) and greedy
    decode, used here for cached forwards over a few tokens at a time."""

    def __init__(self, runner):
        self.runner = runner
        self.device = runner.device
        self.aux_layers = list(runner.aux_layers)
        self.eos_token_ids = set(runner.eos_token_ids)

    @classmethod
    def load(cls, model_path: str | Path, aux_layers: list[int], device: str = "auto", dtype: str = "auto"
             ) -> TargetModel:
        """Load the target directory (config.json, weights, tokenizer) with the aux layers hooked."""
        from eagle3_pipeline.engine.batcher import ModelRunner  # noqa: PLC0415 - loads transformers

        return cls(ModelRunner(str(model_path), device=device, dtype=dtype, aux_layers=aux_layers))

    @property
    def tokenizer(self):
        """The target's tokenizer (None when the directory has none)."""
        return self.runner.tokenizer

    def input_embeddings(self) -> torch.Tensor:
        """The target's input embeddings [V, H] (the drafter shares them, as SGLang's ``set_embed`` does)."""
        return self.runner.model.get_input_embeddings().weight

    def new_cache(self):
        """An empty KV cache for one request."""
        return self.runner._new_cache()  # noqa: SLF001 - the engine's own cache type for this model

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read ``token_ids`` at positions start.. into ``cache``: (aux [n, n_aux*H], logits [n, V] float32)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device)[None]
        out, captured = self.runner._run_decoder(  # noqa: SLF001 - the engine's hooked forward
            input_ids=ids, position_ids=positions, cache=cache)
        aux = torch.cat([captured[layer][0] for layer in self.aux_layers], dim=-1)
        return aux, self.runner.lm_head(out.last_hidden_state[0]).float()

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
        """The target's own greedy decode, by the reference engine's plain decode loop (the oracle)."""
        from eagle3_pipeline.engine.batcher import GenerateJob, SamplingConfig  # noqa: PLC0415

        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos)
        job = GenerateJob(rid="evaluate-greedy", input_ids=list(prompt_ids), sampling=sampling, capture=False)
        return self.runner.run_batch([job])[0].output_ids


def crop_cache(cache, remove: int) -> None:
    """Drop the last ``remove`` positions of a transformers cache.

    Every layer holding keys is cut; layers that hold none are left alone (transformers 5.17's
    ``DynamicCache.crop`` fails on those with "'NoneType' object is not subscriptable"; 5.24's
    does not). Caches without per-layer keys fall back to their own ``crop``.
    """
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        cache.crop(-remove)
        return
    for layer in layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[..., : layer.keys.shape[-2] - remove, :]
        layer.values = layer.values[..., : layer.values.shape[-2] - remove, :]


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
        hidden_act=config.get("hidden_act", "silu"),
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
    """The drafter with its own KV cache, serving-style: ``extend`` over verified rows, ``propose`` k drafts."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.keys: torch.Tensor | None = None  # [1, kv_heads, L, hd]: the committed (extend) rows' keys
        self.values: torch.Tensor | None = None
        self.last_hidden: torch.Tensor | None = None  # [H] output of the last extend row
        self.last_position = -1
        d2t = drafter.d2t
        self.draft_to_target = d2t + torch.arange(d2t.numel(), device=d2t.device)  # [D] target ids

    def reset(self) -> None:
        """Forget the request (a new prompt starts with ``extend`` at position 0)."""
        self.keys = self.values = self.last_hidden = None
        self.last_position = -1

    def _layer(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One pass of the midlayer over n rows (hidden [n, H], tokens and positions [n]): output [n, H].

        The rows attend to the cached keys and causally among themselves; their keys are appended
        to the cache (``propose`` cuts its steps' keys off again).
        """
        drafter = self.drafter
        layer, attn = drafter.midlayer, drafter.midlayer.self_attn
        embeds = drafter.embed_tokens(token_ids).to(hidden.dtype)[None]  # [1, n, H]
        x = layer.attention_input(embeds, hidden[None])  # [1, n, 2H]
        cos, sin = rope_cos_sin(drafter.inv_freq, positions[None])
        q, k, v = attn.project(x, cos, sin)  # [1, heads, n, hd], [1, kv, n, hd] x2
        keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        values = v if self.values is None else torch.cat([self.values, v], dim=2)
        rows, past = token_ids.numel(), keys.shape[2] - token_ids.numel()
        mask = None
        if rows > 1:
            mask = torch.ones(rows, past + rows, dtype=torch.bool, device=hidden.device).tril(diagonal=past)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=attn.kv_heads != attn.heads)
        out = out.transpose(1, 2).reshape(1, rows, attn.heads * attn.head_dim)
        self.keys, self.values = keys, values
        return layer.finish(hidden[None], out)[0]

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor, token_ids: list[int], start: int) -> None:
        """Rows start..start+n-1: aux [n, n_aux*H_t] of each verified position with the token after it."""
        fc = self.drafter.fc.weight
        hidden = self.drafter.fc(aux.to(device=fc.device, dtype=fc.dtype))  # [n, H]
        ids = torch.tensor(token_ids, dtype=torch.long, device=fc.device)
        positions = torch.arange(start, start + len(token_ids), device=fc.device)
        self.last_hidden = self._layer(hidden, ids, positions)[-1]
        self.last_position = start + len(token_ids) - 1

    @torch.inference_mode()
    def propose(self, count: int) -> list[int]:
        """``count`` chain drafts (target ids) from the last extend row; the steps' keys are dropped after."""
        if self.last_hidden is None:
            raise RuntimeError("propose() before extend(): the drafter has read no verified rows")
        committed = self.keys.shape[2]
        hidden, drafts = self.last_hidden, []
        for step in range(count):
            token = self.draft_to_target[self.drafter.logits(hidden).argmax()]
            drafts.append(int(token))
            if step + 1 < count:
                position = torch.tensor([self.last_position + step + 1], device=hidden.device)
                hidden = self._layer(hidden[None], token.view(1), position)[0]
        self.keys, self.values = self.keys[:, :, :committed], self.values[:, :, :committed]
        return drafts


# -- the decoding loop --------------------------------------------------------------------------
@dataclass
class Round:
    """One verify forward: drafts proposed, drafts accepted, tokens it added to the output."""

    drafted: int
    accepted: int
    produced: int


@dataclass
class SpeculativeOutput:
    """One request's speculative decode."""

    output_ids: list[int]
    rounds: list[Round]
    wall_s: float


def speculative_generate(target: TargetModel, proposer, prompt_ids: list[int], max_new_tokens: int,
                         draft_tokens: int, ignore_eos: bool = False) -> SpeculativeOutput:
    """Greedy chain speculative decoding of one prompt (see the module docstring).

    ``proposer`` has ``reset()``, ``extend(aux, token_ids, start)`` and ``propose(k) -> [target ids]``
    (``EagleProposer``; tests give others, e.g. a perfect oracle).
    """
    if not prompt_ids:
        raise EvaluationError("an empty prompt: nothing to decode from")
    if max_new_tokens < 1 or draft_tokens < 1:
        raise EvaluationError(f"max_new_tokens ({max_new_tokens}) and draft_tokens ({draft_tokens}) must be >= 1")
    started = time.perf_counter()
    stops = set() if ignore_eos else target.eos_token_ids
    cache = target.new_cache()
    proposer.reset()
    aux, logits = target.forward(list(prompt_ids), cache, 0)
    output = [int(logits[-1].argmax())]
    rounds: list[Round] = []
    finished = output[0] in stops or len(output) >= max_new_tokens
    if not finished:
        proposer.extend(aux, list(prompt_ids[1:]) + output, 0)
    while not finished:
        count = min(draft_tokens, max_new_tokens - len(output) - 1)
        drafts = proposer.propose(count) if count > 0 else []
        base = len(prompt_ids) + len(output) - 1  # position of the last output token, not yet in the cache
        aux, logits = target.forward([output[-1], *drafts], cache, base)
        choices = logits.argmax(-1).tolist()  # the target's greedy token after each of those
        accepted = 0
        while accepted < count and drafts[accepted] == choices[accepted]:
            accepted += 1
        if accepted < count:
            crop_cache(cache, count - accepted)  # the rejected drafts' keys
        new = [*drafts[:accepted], choices[accepted]]
        for index, token in enumerate(new):
            if token in stops:
                new, finished = new[: index + 1], True
                break
        rounds.append(Round(drafted=count, accepted=accepted, produced=len(new)))
        output += new
        finished = finished or len(output) >= max_new_tokens
        if not finished:
            proposer.extend(aux[: accepted + 1], new, base)
    return SpeculativeOutput(output_ids=output, rounds=rounds, wall_s=time.perf_counter() - started)


@dataclass
class AcceptanceStats:
    """Acceptance summed over requests and rounds.

    Per draft position j (0-based): ``reached[j]`` rounds drafted j with all earlier drafts
    accepted, ``accepted[j]`` rounds accepted draft j.
    """

    draft_tokens: int
    rounds: int = 0
    produced: int = 0  # tokens from verify forwards
    completion_tokens: int = 0  # every output token, the prefill's first one included
    requests: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reached = self.reached or [0] * self.draft_tokens
        self.accepted = self.accepted or [0] * self.draft_tokens

    def add_round(self, drafted: int, accepted: int, produced: int) -> None:
        """Count one verify forward."""
        self.rounds += 1
        self.produced += produced
        for position in range(min(accepted + 1, drafted)):
            self.reached[position] += 1
        for position in range(accepted):
            self.accepted[position] += 1

    def add(self, result: SpeculativeOutput) -> None:
        """Count one request."""
        self.requests += 1
        self.completion_tokens += len(result.output_ids)
        for one in result.rounds:
            self.add_round(one.drafted, one.accepted, one.produced)

    @property
    def tau(self) -> float:
        """Tokens produced per verify forward (1 + mean drafts accepted when no round is cut by an end token)."""
        return self.produced / self.rounds if self.rounds else 0.0

    @property
    def sglang_accept_length(self) -> float:
        """SGLang's spec_accept_length over all requests: completion tokens / verify forwards."""
        return self.completion_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per verify forward."""
        return sum(self.accepted) / self.rounds if self.rounds else 0.0

    @property
    def accepted_per_position(self) -> list[float]:
        """Share of rounds whose draft j was accepted (they sum to the mean accepted per round)."""
        return [a / self.rounds if self.rounds else 0.0 for a in self.accepted]

    @property
    def conditional_acceptance(self) -> list[float]:
        """Draft j accepted among rounds that reached it (every earlier draft accepted): the measured
        counterpart of training's conditional acc_k."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def as_dict(self) -> dict:
        """The figures for evaluation.json."""
        return {
            "tau": self.tau, "sglang_accept_length": self.sglang_accept_length, "mean_accepted": self.mean_accepted,
            "accepted_per_position": self.accepted_per_position,
            "conditional_acceptance_per_position": self.conditional_acceptance,
            "target_forwards": self.rounds, "tokens_from_verify": self.produced,
            "tokens_generated": self.completion_tokens, "requests": self.requests,
        }  # fmt: skip
