"""The capture writer: files safetensors reads back bit for bit, atomic, refusing bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3_pipeline.capture.writer import (
    CaptureError,
    incomplete_path,
    read_capture,
    write_capture,
    write_incomplete,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_capture_round_trips_through_safetensors_exactly(tmp_path, dtype):
    torch.manual_seed(0)
    aux, last = torch.randn(7, 3 * 16).to(dtype), torch.randn(7, 16).to(dtype)
    path = write_capture(tmp_path / "cap", "req-1", aux, last, [1, 3, 5], engine="reference")
    loaded = load_file(str(path))
    assert torch.equal(loaded["aux_hidden_states"], aux) and loaded["aux_hidden_states"].dtype == dtype
    assert torch.equal(loaded["last_hidden_states"], last)
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    assert meta["rid"] == "req-1" and meta["num_tokens"] == "7" and json.loads(meta["aux_layer_ids"]) == [1, 3, 5]
    capture = read_capture(path)
    assert capture.num_tokens == 7 and capture.engine == "reference"
    assert (tmp_path / "cap").stat().st_mode & 0o777 == 0o700
    assert [p.name for p in (tmp_path / "cap").iterdir()] == ["req-1.safetensors"]


def test_a_non_contiguous_slice_is_written_as_its_values(tmp_path):
    batch = torch.arange(2 * 5 * 8, dtype=torch.float32).reshape(2, 5, 8)
    last = batch[1, :3]  # a view into a padded batch, as the engines pass it
    aux = torch.cat([batch[0, :3], batch[1, :3]], dim=-1)
    path = write_capture(tmp_path, "r", aux, last, [0, 1], engine="t")
    assert torch.equal(load_file(str(path))["last_hidden_states"], last)


def test_shapes_that_do_not_fit_the_aux_layers_are_refused(tmp_path):
    with pytest.raises(CaptureError, match=r"expected \(4, 3 x 8\)"):
        write_capture(tmp_path, "r", torch.zeros(4, 16), torch.zeros(4, 8), [0, 1, 2], engine="t")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("rid", ["../escape", "", "a/b", ".hidden", "x" * 201])
def test_request_ids_that_could_escape_the_directory_are_refused(tmp_path, rid):
    with pytest.raises(CaptureError, match="cannot name a capture file"):
        write_capture(tmp_path, rid, torch.zeros(1, 8), torch.zeros(1, 8), [0], engine="t")


def test_an_incomplete_record_is_replaced_by_a_later_good_capture(tmp_path):
    write_incomplete(tmp_path, "r", "prefix of 4 tokens was cached", prefix_tokens=4)
    assert json.loads(incomplete_path(tmp_path, "r").read_text())["prefix_tokens"] == 4
    write_capture(tmp_path, "r", torch.zeros(2, 8), torch.zeros(2, 8), [0], engine="t")
    assert not incomplete_path(tmp_path, "r").exists()


def test_a_truncated_file_is_reported_not_loaded(tmp_path):
    path = write_capture(tmp_path, "r", torch.zeros(4, 8), torch.zeros(4, 8), [0], engine="t")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CaptureError, match="not a readable capture file"):
        read_capture(path)


# -- float8 captures (a request id ending in ".f8") ----------------------------------------------
def states_with_every_kind_of_value(tokens: int = 9, hidden: int = 32, n_aux: int = 3):
    """bf16 states with rows of zeros, huge and tiny rows (e4m3 subnormals after scaling), and ties."""
    torch.manual_seed(1)
    aux = (torch.randn(tokens, n_aux * hidden) * torch.logspace(-6, 4, tokens)[:, None]).to(torch.bfloat16)
    aux[0] = 0
    aux[1, :hidden] = torch.linspace(-448, 448, hidden)  # a slice whose scale is 1: exact e4m3 ties
    last = (torch.randn(tokens, hidden) * 3).to(torch.bfloat16)
    last[2, 5] = -1e30
    return aux, last


def test_a_float8_request_gets_its_states_as_a_float8_sample_stores_them_and_its_last_states_unquantized(tmp_path):
    from eagle3_pipeline.capture.writer import FLOAT8_RID_SUFFIX, UNQUANTIZED_LAST  # noqa: PLC0415
    from eagle3_pipeline.extract.storage import FLOAT8, quantize_states  # noqa: PLC0415

    aux, last = states_with_every_kind_of_value()
    rid = "e3x-0-abc-key-0" + FLOAT8_RID_SUFFIX

    path = write_capture(tmp_path, rid, aux, last, [1, 3, 5], engine="reference")

    stored = load_file(str(path))
    expected = quantize_states(aux, last)
    assert set(stored) == {*expected, UNQUANTIZED_LAST}
    for name, tensor in expected.items():  # the bits of the storage's own quantization
        assert stored[name].dtype == tensor.dtype
        assert torch.equal(stored[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert torch.equal(stored[UNQUANTIZED_LAST], last) and stored[UNQUANTIZED_LAST].dtype == torch.bfloat16
    # Bytes a token: (3 + 1) x 32 float8 values, 4 float32 scales, 32 bf16 unquantized last states,
    # against (3 + 1) x 32 x 2 as captured.
    data = sum(t.numel() * t.element_size() for t in stored.values())
    assert data == 9 * (4 * 32 + 4 * 4 + 32 * 2)
    write_capture(tmp_path, "plain", aux, last, [1, 3, 5], "t")
    capture = read_capture(path)
    assert (capture.storage_dtype, capture.num_tokens, capture.rid) == (FLOAT8, 9, rid)
    assert read_capture(tmp_path / "plain.safetensors").storage_dtype is None


def test_states_an_engine_quantized_are_checked_by_their_scales():
    from eagle3_pipeline.extract.storage import Layout, check_quantized_sample, quantize_states  # noqa: PLC0415

    def check(aux, last, tokens=9, drop=None):
        states = quantize_states(aux, last)
        states.pop(drop, None)
        ids = torch.zeros(tokens, dtype=torch.int32)
        return check_quantized_sample({"input_ids": ids, "loss_mask": ids.to(torch.uint8), **states}, layout, tokens)

    aux, last = states_with_every_kind_of_value()
    layout = Layout(n_aux=3, hidden=32, dtype="bfloat16", storage="float8_e4m3")
    assert check(aux, last) is None
    reason, detail = check(aux, last, tokens=8)
    assert reason == "capture_shape" and "expected (8, 96)" in detail
    bad = aux.clone()
    bad[4, 40] = float("nan")
    assert check(bad, last) == ("non_finite", "aux_hidden_states has NaN or inf values (its scales are not finite)")
    bad[4, 40] = float("inf")
    assert check(bad, last)[0] == "non_finite" and "aux_hidden_states has NaN or inf" in check(bad, last)[1]
    assert check(aux, last, drop="last_hidden_scales")[1].startswith("lacks last_hidden_scales")
