"""The reference engine: a real server process, real HTTP, real capture files, a tiny random Llama.

The model (6 layers, hidden 64, vocab 256, 128 positions) and a word-level tokenizer are built
once per session with transformers; the server runs as ``python -m
eagle3_pipeline.engine.reference_server`` on a port it picks itself (logged at start).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import pytest
import torch
from float_rounding import dot_error_bound
from reference_fixtures import (
    API_KEY,
    API_KEY_ENV,
    AUX_LAYERS,
    HIDDEN,
    HIDDEN_ATOL,
    HIDDEN_RTOL,
    START_TIMEOUT_S,
    Server,
    assert_greedy_continuation,
    build_tiny_llama,
    expected_states,
    load_tiny_llama,
    prompt,
)

from eagle3_pipeline.capture.layers import check_aux_layers, default_aux_layers
from eagle3_pipeline.capture.writer import capture_path, read_capture
from eagle3_pipeline.engine.batcher import GenerateJob, ModelRunner, SamplingConfig
from eagle3_pipeline.extract.verify import check_top1


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    return load_tiny_llama(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """A capturing server with an API key, aux layers 0,2,4, batches of up to 8."""
    workdir = tmp_path_factory.mktemp("reference-server")
    srv = Server(
        workdir, tiny_model_dir, "--capture-dir", str(workdir / "captures"),
        "--aux-layers", ",".join(map(str, AUX_LAYERS)), "--max-batch-size", "8", "--batch-wait-ms", "20",
        "--api-key-env", API_KEY_ENV, env={API_KEY_ENV: API_KEY},
    )
    srv.headers = {"Authorization": f"Bearer {API_KEY}"}
    srv.capture_dir = workdir / "captures"
    yield srv
    assert srv.stop() == 0, srv.read_log()


def test_default_aux_layers_follow_eagle3_and_refuse_the_last_layer():
    assert default_aux_layers(61) == [1, 29, 57]  # Kimi-K2.5: SGLang captures before [2, 30, 58]
    assert default_aux_layers(32) == [1, 15, 28]
    assert default_aux_layers(8) == [1, 3, 4]
    # Shallow models: the formula repeats ([1, 2, 2], [1, 1, 0]); three distinct layers instead.
    assert default_aux_layers(6) == [0, 2, 4]
    assert default_aux_layers(4) == [0, 1, 2]
    assert default_aux_layers(3) == [0, 1]
    assert default_aux_layers(2) == [0]
    for layers in range(2, 80):
        chosen = default_aux_layers(layers)
        assert chosen == sorted(set(chosen)) and check_aux_layers(chosen, layers) == chosen
    with pytest.raises(ValueError, match="out of range.*0..4"):
        check_aux_layers([1, 5], 6)
    with pytest.raises(ValueError, match="distinct layer indices in ascending order"):
        check_aux_layers([2, 1], 6)


def test_health_needs_no_key_and_health_generate_runs_the_model(server):
    assert server.call("GET", "/health", headers={"Authorization": ""}) == (200, None)
    assert server.call("GET", "/health_generate", headers={"Authorization": ""}) == (200, None)


def test_model_info_names_the_model(server, tiny_model_dir):
    status, info = server.call("GET", "/model_info")
    assert status == 200
    assert info["model_path"] == str(tiny_model_dir)
    assert info["tokenizer_path"] == str(tiny_model_dir)
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]


def test_server_info_reports_this_engine_truthfully(server, tiny_model_dir):
    status, info = server.call("GET", "/server_info")
    assert status == 200
    assert info["model_path"] == str(tiny_model_dir)
    assert info["disable_radix_cache"] is True
    assert info["chunked_prefill_size"] == -1
    assert info["enable_return_aux_hidden_states"] is True
    assert info["return_aux_hidden_state_layer_ids"] == AUX_LAYERS
    assert info["aux_layers"] == AUX_LAYERS
    assert info["engine"] == "reference"
    assert info["capture_dir"] == str(server.capture_dir)
    assert (info["device"], info["dtype"], info["tp_size"]) == ("cpu", "float32", 1)
    assert (info["host"], info["port"]) == ("127.0.0.1", server.port)
    assert info["max_batch_size"] == 8
    from eagle3_pipeline import __version__

    assert info["version"] == __version__
    assert API_KEY not in json.dumps(info)


def test_generate_captures_exactly_the_prompt_and_matches_the_engines_top1(server, hf_model):
    ids = prompt(9)
    status, out = server.generate({
        "input_ids": ids, "rid": "sample-0001", "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1,
    })
    assert status == 200, out
    meta = out["meta_info"]
    assert meta["id"] == "sample-0001"
    assert (meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]) == (len(ids), 0, 1)
    assert meta["finish_reason"] == {"type": "length", "length": 1}
    # SGLang's layout: one entry per prompt token, the first without a score.
    assert [entry[1] for entry in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0] == [None, ids[0], None]
    assert meta["input_top_logprobs"][0] is None
    assert len(meta["input_top_logprobs"]) == len(ids)

    capture = read_capture(capture_path(server.capture_dir, "sample-0001"))
    assert capture.num_tokens == len(ids)
    assert tuple(capture.aux_hidden_states.shape) == (len(ids), len(AUX_LAYERS) * HIDDEN)
    assert tuple(capture.last_hidden_states.shape) == (len(ids), HIDDEN)
    assert (capture.engine, capture.aux_layer_ids) == ("reference", AUX_LAYERS)

    # Row p's top-1 through lm_head is the engine's own top-1 for position p + 1: the same hidden states, only
    # the two lm_head matmuls may round differently (by ``apart`` at most), so where our two best logits are
    # further apart than twice that the tokens are equal, and elsewhere within 2 * apart of our best.
    engine_top1 = [row[0][1] for row in meta["input_top_logprobs"][1:]] + [meta["output_top_logprobs"][0][0][1]]
    weight = hf_model.lm_head.weight.detach()
    apart = float(2 * dot_error_bound(capture.last_hidden_states, weight).max())
    agreement = check_top1(capture.last_hidden_states, weight, 0, engine_top1, tolerance=2 * apart)
    best, second = (capture.last_hidden_states @ weight.T).topk(2).values.unbind(-1)
    assert agreement.exact >= int((best - second > 2 * apart).sum())
    assert out["output_ids"] == [engine_top1[-1]]

    aux, last, logits = expected_states(hf_model, ids)
    torch.testing.assert_close(capture.aux_hidden_states, aux, rtol=HIDDEN_RTOL, atol=HIDDEN_ATOL)
    torch.testing.assert_close(capture.last_hidden_states, last, rtol=HIDDEN_RTOL, atol=HIDDEN_ATOL)
    expected_lp = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got_lp = torch.tensor([entry[0] for entry in meta["input_token_logprobs"][1:]])
    torch.testing.assert_close(got_lp, expected_lp, rtol=1e-4, atol=1e-4)


def test_text_prompt_without_rid_gets_a_generated_rid_and_a_capture(server, tiny_model_dir):
    status, out = server.generate({"text": "w1 w2 w3 w4", "sampling_params": {"max_new_tokens": 0}})
    assert status == 200, out
    rid = out["meta_info"]["id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["prompt_tokens"] == 4
    assert read_capture(capture_path(server.capture_dir, rid)).num_tokens == 4


def test_greedy_decoding_matches_transformers_generate(server, hf_model):
    ids = prompt(12, offset=30)
    status, out = server.generate({
        "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    })
    assert status == 200, out
    assert len(out["output_ids"]) == 8
    assert_greedy_continuation(hf_model, ids, out["output_ids"])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_concurrent_requests_of_different_lengths_are_all_captured_correctly(server, hf_model):
    lengths = [3, 40, 11, 1, 25, 7, 60, 17]
    prompts = {f"conc-{n}": prompt(n, offset=5 + n) for n in lengths}
    results = {}

    def send(rid):
        results[rid] = server.generate({
            "input_ids": prompts[rid], "rid": rid,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        })

    threads = [threading.Thread(target=send, args=(rid,)) for rid in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for rid, ids in prompts.items():
        status, out = results[rid]
        assert status == 200, out
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        capture = read_capture(capture_path(server.capture_dir, rid))
        assert capture.num_tokens == len(ids), rid
        aux, last, _ = expected_states(hf_model, ids)
        torch.testing.assert_close(capture.aux_hidden_states, aux, rtol=HIDDEN_RTOL, atol=HIDDEN_ATOL)
        torch.testing.assert_close(capture.last_hidden_states, last, rtol=HIDDEN_RTOL, atol=HIDDEN_ATOL)
        assert len(out["output_ids"]) == 3, rid
        assert_greedy_continuation(hf_model, ids, out["output_ids"])


BAD_REQUESTS = [
    (b"{not json", "malformed JSON"),
    (b"", "empty"),
    (b'{"sampling_params": {"max_new_tokens": 1}}', "input_ids"),
    (b'{"text": "w1", "input_ids": [5]}', "not both"),
    (b'{"input_ids": [5, "6"]}', "input_ids[1]"),
    (b'{"input_ids": [5, 1.5]}', "input_ids[1]"),
    (b'{"input_ids": [5, 256]}', "input_ids[1] = 256 is out of the vocabulary"),
    (b'{"input_ids": [-1]}', "input_ids[0] = -1"),
    (b'{"input_ids": []}', "input_ids"),
    (json.dumps({"input_ids": [5] * 128}).encode(), "context length"),
    (json.dumps({"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 40}}).encode(), "max_new_tokens"),
    (b'{"input_ids": [5], "rid": "../escape"}', "rid"),
    (b'{"input_ids": [5], "rid": 7}', "rid"),
    (b'{"input_ids": [5], "sampling_params": {"max_new_token": 1}}', "unknown field `max_new_token`"),
    (b'{"input_ids": [5], "sampling_params": {"repetition_penalty": 1.2}}', "repetition_penalty"),
    (b'{"input_ids": [5], "sampling_params": {"temperature": -1}}', "temperature"),
    (b'{"input_ids": [5, 6], "return_logprob": true, "logprob_start_len": 3}', "logprob_start_len"),
    (b'{"input_ids": [5], "stream": true}', "stream"),
    (b'{"input_ids": [[5], [6]]}', "batch requests"),
    (b"[1, 2]", "JSON object"),
]


@pytest.mark.parametrize(("raw", "named"), BAD_REQUESTS, ids=[named for _, named in BAD_REQUESTS])
def test_bad_request_is_refused_with_the_field_named_and_the_server_keeps_serving(server, raw, named):
    status, out = server.call("POST", "/generate", raw=raw, headers={"Content-Type": "application/json"})
    assert status == 400, out
    assert named in out["error"]["message"], out
    status, out = server.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
    assert status == 200, out


def test_duplicate_in_flight_rid_is_refused(server):
    body = {"input_ids": prompt(4), "rid": "dup-1", "sampling_params": {"max_new_tokens": 120, "ignore_eos": True,
                                                                         "temperature": 0}}
    for _ in range(5):  # the second request must arrive while the first decodes; retry if it did not
        first = []
        thread = threading.Thread(target=lambda results=first: results.append(server.generate(body)))
        thread.start()
        time.sleep(0.05)
        second = server.generate(body)
        thread.join(timeout=60)
        # Either may reach the server first (the thread may not have run yet): one is served, one refused.
        answers = sorted([first[0], second], key=lambda answer: answer[0])
        assert answers[0][0] == 200, answers
        if answers[1][0] == 400:
            out = answers[1][1]
            assert "Duplicate request ID detected: dup-1" in out["error"]["message"]
            assert out["error"]["param"] == "rid"
            return
    pytest.fail("never managed to send a duplicate rid while the first was in flight")


def test_api_key_is_required_except_for_health(server):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert server.call("GET", "/server_info", headers=headers) == (401, {"error": "Unauthorized"})
        status, _ = server.generate({"input_ids": [5]}, headers=headers)
        assert status == 401
    assert server.call("GET", "/health", headers={"Authorization": ""})[0] == 200
    assert server.call("GET", "/server_info", headers={"Authorization": f"bearer {API_KEY}"})[0] == 200


def test_unknown_path_and_method(server):
    assert server.call("GET", "/nope")[0] == 404
    assert server.call("GET", "/generate")[0] == 405


def test_batched_prefill_and_decoding_match_unbatched(tiny_model_dir, hf_model):
    runner = ModelRunner(str(tiny_model_dir), device="cpu", dtype="float32", aux_layers=AUX_LAYERS)

    def job(ids):
        return GenerateJob(rid="x", input_ids=ids, capture=False, return_logprob=True, logprob_start_len=0,
                           sampling=SamplingConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True))

    prompts = [prompt(13), prompt(2, offset=50), prompt(31, offset=9)]
    with torch.inference_mode():
        alone = [runner.prefill([job(ids)])[0][0] for ids in prompts]
        together = runner.prefill([job(ids) for ids in prompts])[0]
    for a, b, ids in zip(alone, together, prompts):
        assert b.aux_hidden_states.shape == (len(ids), len(AUX_LAYERS) * HIDDEN)
        torch.testing.assert_close(a.aux_hidden_states, b.aux_hidden_states, rtol=HIDDEN_RTOL, atol=HIDDEN_ATOL)
        torch.testing.assert_close(a.last_hidden_states, b.last_hidden_states, rtol=HIDDEN_RTOL, atol=HIDDEN_ATOL)
    single = [runner.run_batch([job(ids)])[0] for ids in prompts]
    batched = runner.run_batch([job(ids) for ids in prompts])
    for s, b, ids in zip(single, batched, prompts):
        # Both must be greedy decodes of the model: equal, unless a near tie lets them part (each is then right).
        assert len(s.output_ids) == len(b.output_ids) == 6
        assert_greedy_continuation(hf_model, ids, s.output_ids)
        assert_greedy_continuation(hf_model, ids, b.output_ids)
        assert [t for _, t in s.input_token_logprobs] == [t for _, t in b.input_token_logprobs]


def test_sigterm_finishes_the_request_in_flight_and_exits_zero(tiny_model_dir, tmp_path):
    srv = Server(tmp_path, tiny_model_dir, "--log-level", "debug")
    try:
        status, info = srv.call("GET", "/server_info")
        assert status == 200
        assert info["enable_return_aux_hidden_states"] is False and info["capture_dir"] is None
        result = {}
        body = {"input_ids": prompt(4), "sampling_params": {"max_new_tokens": 100, "temperature": 0,
                                                            "ignore_eos": True}}
        thread = threading.Thread(target=lambda: result.setdefault("r", srv.generate(body)))
        thread.start()
        # In flight: the worker has run its prefill (its debug line); its 100 tokens are still to decode.
        deadline = time.monotonic() + START_TIMEOUT_S
        while "prefill of 1 request(s)" not in srv.read_log():
            assert time.monotonic() < deadline and thread.is_alive(), srv.read_log()
            time.sleep(0.01)
        srv.proc.send_signal(signal.SIGTERM)
        thread.join(timeout=30)
        assert result["r"][0] == 200 and len(result["r"][1]["output_ids"]) == 100
        assert srv.proc.wait(timeout=30) == 0
        assert "stopped:" in srv.read_log()
    finally:
        srv.stop()
