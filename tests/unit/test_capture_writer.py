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
