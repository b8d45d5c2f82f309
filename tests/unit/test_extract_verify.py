"""The checks every captured sample must pass: the engine's answer, the capture, and the top-1.

``meta_info`` dicts are built as SGLang lays them out (see the reference server's docstring:
input top-logprob lists start at ``logprob_start_len``, their first entry is ``None``, and the
last prompt position's top-1 is the first output token's). ``load_lm_head`` reads the real tiny
model, and sharded checkpoints written here with safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from float_rounding import dot_error_bound
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_target import built_tiny_model

from eagle3_pipeline.extract.verify import (
    SampleRejected,
    check_capture,
    check_meta,
    check_top1,
    engine_top1,
    load_lm_head,
)


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The real tiny model in the checkout's cache (built once per checkout)."""
    return built_tiny_model()


def triple(token: int, logprob: float = -0.5) -> list:
    """One SGLang logprob entry: [logprob, token id, text or None]."""
    return [logprob, token, None]


def meta_for(prompt: list[int], predicted: list[int], start: int) -> dict:
    """An SGLang /generate meta_info for ``prompt`` whose top-1 after row p is ``predicted[p]``.

    ``input_top_logprobs`` has one entry per prompt token from ``start``: entry j is about token
    start + j, the top-1 the engine computed at position start + j - 1; entry 0 has none. The
    top-1 at the last prompt position is the first output token's.
    """
    tokens = len(prompt)
    inputs = [None] + [[triple(predicted[start + j - 1])] for j in range(1, tokens - start)]
    return {
        "prompt_tokens": tokens,
        "cached_tokens": 0,
        "input_token_logprobs": [[None, prompt[start], None]]
        + [triple(prompt[start + j]) for j in range(1, tokens - start)],
        "input_top_logprobs": inputs,
        "output_token_logprobs": [triple(predicted[-1])],
        "output_top_logprobs": [[triple(predicted[-1])]],
    }


# -- the engine's top-1 ------------------------------------------------------------------------
def test_engine_top1_from_position_zero_covers_every_row():
    prompt = [5, 6, 7, 8, 9]
    predicted = [11, 12, 13, 14, 15]  # the top-1 after rows 0..4

    assert engine_top1(meta_for(prompt, predicted, 0), len(prompt), 0) == predicted


@pytest.mark.parametrize("start", [1, 3, 4])
def test_engine_top1_from_a_later_start_covers_the_rows_from_there(start):
    prompt = [5, 6, 7, 8, 9]
    predicted = [11, 12, 13, 14, 15]
    meta = meta_for(prompt, predicted, start)
    assert len(meta["input_top_logprobs"]) == len(prompt) - start

    assert engine_top1(meta, len(prompt), start) == predicted[start:]


def test_engine_top1_refuses_lists_of_the_wrong_length():
    prompt, predicted = [5, 6, 7, 8], [1, 2, 3, 4]
    meta = meta_for(prompt, predicted, 0)

    with pytest.raises(SampleRejected) as caught:
        engine_top1(meta, len(prompt), 1)  # the engine answered from 0, we asked from 1
    assert caught.value.reason == "logprobs"
    assert "4 input top-logprob entries (expected 3)" in caught.value.detail
    with pytest.raises(SampleRejected, match="expected 1"):
        engine_top1({**meta, "output_top_logprobs": []}, len(prompt), 0)
    with pytest.raises(SampleRejected, match="0 input top-logprob entries"):
        engine_top1({"output_top_logprobs": meta["output_top_logprobs"]}, len(prompt), 0)


def test_engine_top1_refuses_a_position_without_a_top_logprob():
    prompt, predicted = [5, 6, 7, 8], [1, 2, 3, 4]
    meta = meta_for(prompt, predicted, 0)
    meta["input_top_logprobs"][2] = None

    with pytest.raises(SampleRejected, match="no input top logprob for token 2") as caught:
        engine_top1(meta, len(prompt), 0)
    assert caught.value.reason == "logprobs"


# -- the engine's counts -----------------------------------------------------------------------
def test_check_meta_passes_a_whole_uncached_prefill():
    check_meta({"prompt_tokens": 12, "cached_tokens": 0}, 12)
    check_meta({"prompt_tokens": 12}, 12)  # no cached_tokens field: nothing was cached


def test_check_meta_refuses_a_prompt_of_another_length():
    with pytest.raises(SampleRejected) as caught:
        check_meta({"prompt_tokens": 11, "cached_tokens": 0}, 12)
    assert caught.value.reason == "prompt_tokens"
    assert caught.value.detail == "the engine counted 11 prompt tokens, 12 were sent"
    with pytest.raises(SampleRejected, match="counted None prompt tokens"):
        check_meta({}, 12)


def test_check_meta_refuses_cached_tokens_and_says_to_turn_the_radix_cache_off():
    with pytest.raises(SampleRejected) as caught:
        check_meta({"prompt_tokens": 12, "cached_tokens": 8}, 12)
    assert caught.value.reason == "cached_tokens"
    assert "8 of 12 tokens came from the prefix cache" in caught.value.detail
    assert "radix cache off" in caught.value.detail


# -- the capture -------------------------------------------------------------------------------
def capture(tokens=6, n_aux=3, hidden=4, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(tokens, n_aux * hidden).to(dtype), torch.randn(tokens, hidden).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_capture_passes_finite_states_of_the_right_shapes(dtype):
    aux, last = capture(dtype=dtype)
    check_capture(aux, last, tokens=6, n_aux=3, hidden=4)


@pytest.mark.parametrize(("tokens", "n_aux", "hidden"), [(5, 3, 4), (7, 3, 4), (6, 2, 4), (6, 3, 6)])
def test_check_capture_refuses_other_shapes(tokens, n_aux, hidden):
    aux, last = capture()
    with pytest.raises(SampleRejected) as caught:
        check_capture(aux, last, tokens, n_aux, hidden)
    assert caught.value.reason == "capture_shape"
    assert "capture is aux (6, 12) and last (6, 4)" in caught.value.detail


@pytest.mark.parametrize(("name", "value"), [("aux", float("nan")), ("last", float("inf")),
                                             ("last", float("-inf")), ("aux", float("nan"))])
def test_check_capture_refuses_non_finite_values_naming_the_tensor_and_where(name, value):
    aux, last = capture()
    (aux if name == "aux" else last)[4, 1] = value

    with pytest.raises(SampleRejected) as caught:
        check_capture(aux, last, 6, 3, 4)

    assert caught.value.reason == "non_finite"
    tensor = "aux_hidden_states" if name == "aux" else "last_hidden_states"
    assert caught.value.detail == f"{tensor} has 1 NaN/inf values, first at [4, 1]"


def test_check_capture_refuses_mixed_or_integer_dtypes():
    aux, last = capture()
    with pytest.raises(SampleRejected) as caught:
        check_capture(aux, last.to(torch.bfloat16), 6, 3, 4)
    assert caught.value.reason == "capture_dtype"
    with pytest.raises(SampleRejected, match="capture_dtype"):
        check_capture(aux.to(torch.int32), last.to(torch.int32), 6, 3, 4)


# -- the top-1 through lm_head -----------------------------------------------------------------
def identity_head(vocab=8):
    """lm_head = identity, so a row's logits are the row itself (hidden = vocab)."""
    return torch.eye(vocab)


def rows_with_best(best: list[int], vocab=8, lead=1.0):
    """Rows whose logit ``best[p]`` leads the others by ``lead``."""
    rows = torch.zeros(len(best), vocab)
    for p, token in enumerate(best):
        rows[p, token] = lead
    return rows


def test_check_top1_passes_an_exact_match_from_any_start():
    best = [3, 1, 4, 1, 5]
    last = rows_with_best(best)

    agreement = check_top1(last, identity_head(), 0, best, tolerance=0.05)
    assert (agreement.checked, agreement.exact, agreement.near_ties) == (5, 5, 0)

    agreement = check_top1(last, identity_head(), 2, best[2:], tolerance=0.05)
    assert (agreement.checked, agreement.exact, agreement.near_ties) == (3, 3, 0)


def test_check_top1_accepts_a_near_tie_within_the_tolerance():
    best = [3, 1, 4]
    last = rows_with_best(best)
    last[1, 6] = 0.97  # the engine's pick at row 1, 0.03 below ours: bf16 kernels may order it first
    expected = [3, 6, 4]

    agreement = check_top1(last, identity_head(), 0, expected, tolerance=0.05)

    assert (agreement.checked, agreement.exact, agreement.near_ties) == (3, 2, 1)


def test_check_top1_rejects_a_mismatch_beyond_the_tolerance_naming_the_position():
    best = [3, 1, 4, 1]
    last = rows_with_best(best)
    last[3, 6] = 0.8  # 0.2 below our best
    expected = [3, 1, 4, 6]

    with pytest.raises(SampleRejected) as caught:
        check_top1(last, identity_head(), 0, expected, tolerance=0.05)
    assert caught.value.reason == "top1_mismatch"
    assert caught.value.detail.startswith(
        "1 of 4 checked positions disagree with the engine; first at position 3: lm_head(last_hidden_states) "
        "ranks token 1 first, the engine token 6 (0.2 below ours)"
    )

    with pytest.raises(SampleRejected, match="first at position 3"):
        check_top1(last, identity_head(), 2, expected[2:], tolerance=0.05)
    assert check_top1(last, identity_head(), 0, expected, tolerance=0.25).near_ties == 1


def test_check_top1_against_the_tiny_models_own_forward(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, local_files_only=True).eval()
    ids = torch.tensor([[1, 5, 200, 201, 202, 203, 2]])
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
    last = out.hidden_states[-1][0]
    top1 = out.logits[0].argmax(-1).tolist()
    lm_head = load_lm_head(tiny_model)

    # transformers' lm_head and check_top1's matmul may sum the hidden size's products in different orders:
    # each of their logits is within float32's rounding of the exact one, so they differ by at most
    # ``apart``. Where transformers' two best logits are further apart than twice that, both must pick the
    # same token; elsewhere a swap is a near tie, which check_top1 accepts within 2 * apart of its best.
    apart = float(2 * dot_error_bound(last, lm_head).max())
    agreement = check_top1(last, lm_head, 0, top1, tolerance=2 * apart)
    best, second = out.logits[0].topk(2).values.unbind(-1)
    assert agreement.checked == len(top1)
    assert agreement.exact >= int((best - second > 2 * apart).sum()) > 0
    shifted = top1[1:] + top1[:1]  # the capture of another request (or rows off by one)
    with pytest.raises(SampleRejected, match="top1_mismatch"):
        check_top1(last, lm_head, 0, shifted, tolerance=0.05)


# -- reading lm_head ---------------------------------------------------------------------------
def test_load_lm_head_reads_the_tiny_models_untied_output_embedding(tiny_model):
    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as handle:
        stored = handle.get_tensor("lm_head.weight")
        embedding = handle.get_tensor("model.embed_tokens.weight")
    config = json.loads((tiny_model / "config.json").read_text())

    weight = load_lm_head(tiny_model)

    assert weight.shape == (config["vocab_size"], config["hidden_size"])
    assert weight.dtype == torch.float32
    assert torch.equal(weight, stored.float())
    assert not torch.equal(weight, embedding.float()), "untied: lm_head is not the input embedding"


def write_sharded(path: Path, config: dict, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    """A model directory with config.json, the shards and model.safetensors.index.json."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(path / name))
        weight_map.update({tensor: name for tensor in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def test_load_lm_head_of_a_sharded_tied_model_is_its_input_embedding(tmp_path):
    torch.manual_seed(0)
    embedding = torch.randn(16, 4).to(torch.bfloat16)
    model = write_sharded(
        tmp_path / "tied",
        {"hidden_size": 4, "vocab_size": 16, "tie_word_embeddings": True},
        {
            "model-00001-of-00002.safetensors": {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4)},
            "model-00002-of-00002.safetensors": {"model.embed_tokens.weight": embedding,
                                                 "model.norm.weight": torch.ones(4)},
        },
    )

    weight = load_lm_head(model)

    assert weight.dtype == torch.float32, "on the CPU the head is float32, to compare exactly"
    assert torch.equal(weight, embedding.float())


def test_load_lm_head_of_a_sharded_multimodal_model_finds_the_language_models_head(tmp_path):
    head = torch.randn(16, 4)
    model = write_sharded(
        tmp_path / "vl",
        {"text_config": {"hidden_size": 4, "vocab_size": 16}, "architectures": ["SomeVLM"]},
        {
            "model-00001-of-00002.safetensors": {"language_model.model.embed_tokens.weight": torch.randn(16, 4)},
            "model-00002-of-00002.safetensors": {"language_model.lm_head.weight": head},
        },
    )

    assert torch.equal(load_lm_head(model), head)


def test_load_lm_head_refuses_an_untied_model_without_a_head(tmp_path):
    model = write_sharded(
        tmp_path / "headless",
        {"hidden_size": 4, "vocab_size": 16, "tie_word_embeddings": False},
        {"model-00001-of-00001.safetensors": {"model.embed_tokens.weight": torch.randn(16, 4)}},
    )
    with pytest.raises(ValueError, match="expected one lm_head weight among the tensors, found none"):
        load_lm_head(model)


def test_load_lm_head_says_when_there_are_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4, "vocab_size": 16}))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_lm_head(tmp_path)


def test_check_top1_allows_bf16_rounding_of_large_logits():
    # Logits near 40: bf16 rounds them in steps of 0.25, so an engine computing them in bf16
    # cannot order two tokens 0.2 apart; fp32 captures get only the fixed tolerance.
    best = [3, 1]
    last = rows_with_best(best, lead=40.0)
    last[1, 6] = 39.8
    expected = [3, 6]

    agreement = check_top1(last.to(torch.bfloat16).float().to(torch.bfloat16), identity_head(), 0, expected,
                           tolerance=0.05)
    assert (agreement.exact, agreement.near_ties) == (1, 1)
    with pytest.raises(SampleRejected, match="top1_mismatch"):
        check_top1(last, identity_head(), 0, expected, tolerance=0.05)


def test_check_top1_rejects_an_engine_token_beyond_lm_head():
    with pytest.raises(SampleRejected, match="beyond lm_head's 8 rows"):
        check_top1(rows_with_best([3, 1]), identity_head(), 0, [3, 9], tolerance=0.05)
