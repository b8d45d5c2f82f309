"""The reference engine's replicas (``serve-reference --dp-size N``): real processes, real HTTP, real captures.

On the CPU the replicas are N processes on the same cores standing in for N GPUs: what is shown here is the
front (one address, requests spread over the replicas, the rid and key rules, the health of every replica)
and the processes' lives (started together, stopped together, a replica's death ending the server). The
GPU's own figures (tokens/s against one process) are `bench/replicas.py`'s.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
from reference_fixtures import (
    API_KEY,
    API_KEY_ENV,
    AUX_LAYERS,
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

from eagle3_pipeline.capture.writer import capture_path, read_capture
from eagle3_pipeline.engine.replicas import visible_devices

pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    return load_tiny_llama(tiny_model_dir)


def start(workdir, model_dir, *options, env=None):
    srv = Server(workdir, model_dir, "--dp-size", "2", "--device", "cpu", "--api-key-env", API_KEY_ENV, *options,
                 env={API_KEY_ENV: API_KEY, **(env or {})})
    srv.headers = {"Authorization": f"Bearer {API_KEY}"}
    return srv


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def gone_within(pids, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """Two capturing replicas behind one address, with an API key."""
    workdir = tmp_path_factory.mktemp("replicas")
    srv = start(workdir, tiny_model_dir, "--capture-dir", str(workdir / "captures"),
                "--aux-layers", ",".join(map(str, AUX_LAYERS)), "--max-batch-size", "4", "--batch-wait-ms", "20")
    srv.capture_dir = workdir / "captures"
    yield srv
    status, info = srv.call("GET", "/server_info")
    pids = [replica["pid"] for replica in info["replicas"]]
    assert srv.stop() == 0, srv.read_log()  # SIGTERM: the front and both replicas stop, cleanly
    assert gone_within(pids), srv.read_log()


def test_one_address_two_processes_with_the_settings_verified_live(server, tiny_model_dir):
    status, info = server.call("GET", "/server_info")
    assert status == 200
    assert info["dp_size"] == 2 and info["port"] == server.port and info["engine"] == "reference"
    assert info["replicas_per_device"] == 1
    assert info["enable_return_aux_hidden_states"] is True and info["aux_layers"] == AUX_LAYERS
    assert info["capture_dir"] == str(server.capture_dir)
    replicas = info["replicas"]
    assert [r["index"] for r in replicas] == [0, 1]
    pids = {r["pid"] for r in replicas}
    assert len(pids) == 2 and server.proc.pid not in pids and all(alive(pid) for pid in pids)
    assert len({r["port"] for r in replicas}) == 2 and server.port not in {r["port"] for r in replicas}
    assert all(r["device"] == "cpu" and r["visible_device"] is None for r in replicas)
    assert server.call("GET", "/model_info")[1]["model_path"] == str(tiny_model_dir)
    assert server.call("GET", "/health", headers={"Authorization": ""}) == (200, None)
    assert server.call("GET", "/health_generate", headers={"Authorization": ""}) == (200, None)
    # Each replica sits on loopback and wants the key too: nothing reaches a model without it.
    assert "[replica 0/2]" in server.read_log() and "[replica 1/2]" in server.read_log()


def test_concurrent_requests_are_spread_over_the_replicas_and_each_is_right(server, hf_model):
    before = {r["index"]: r["requests_answered"] for r in server.call("GET", "/server_info")[1]["replicas"]}
    prompts = {f"spread-{k}": prompt(6 + 3 * k, offset=k) for k in range(8)}
    results = {}

    def send(rid, ids):
        results[rid] = server.generate({"input_ids": ids, "rid": rid, "return_logprob": True,
                                        "logprob_start_len": 0, "top_logprobs_num": 1,
                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                            "ignore_eos": True}})

    threads = [threading.Thread(target=send, args=item) for item in prompts.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=START_TIMEOUT_S)
    for rid, ids in prompts.items():
        status, out = results[rid]
        assert status == 200, out
        assert len(out["output_ids"]) == 4
        assert_greedy_continuation(hf_model, ids, out["output_ids"])
        capture = read_capture(capture_path(server.capture_dir, rid))  # whichever replica wrote it, it is there
        aux, last, _ = expected_states(hf_model, ids)
        torch.testing.assert_close(capture.aux_hidden_states, aux, rtol=HIDDEN_RTOL, atol=HIDDEN_ATOL)
        torch.testing.assert_close(capture.last_hidden_states, last, rtol=HIDDEN_RTOL, atol=HIDDEN_ATOL)
    after = {r["index"]: r["requests_answered"] for r in server.call("GET", "/server_info")[1]["replicas"]}
    answered = {index: after[index] - before[index] for index in after}  # as each replica counts them itself
    assert sum(answered.values()) == 8 and min(answered.values()) >= 1, answered
    # Each replica's model thread accounts for its time: every request decoded 3 steps after its prefill.
    info = server.call("GET", "/server_info")[1]
    assert info["requests_answered"] == sum(after.values()) and "worker" not in info
    for replica in info["replicas"]:
        worker = replica["worker"]
        assert worker["decode_steps"] >= 3 and worker["mean_decode_batch"] >= 1.0, worker
        # Each figure rounded to the millisecond: the parts may add up to 2 ms past the wall time.
        assert 0 < worker["decode_s"] + worker["prefill_s"] + worker["idle_s"] <= worker["wall_s"] + 0.002, worker
        # Of the decoding: the model thread's CPU time, the waits for replayed steps (none on a CPU), answering.
        assert 0 < worker["decode_cpu_s"] <= worker["decode_s"] + 0.002, worker
        assert 0 <= worker["answer_s"] <= worker["decode_s"] + 0.002, worker
        assert worker["decode_gpu_wait_s"] in (None, 0.0), worker


def test_a_rid_in_flight_on_one_replica_is_refused_on_the_other(server):
    body = {"input_ids": prompt(4), "rid": "dup-replicas", "sampling_params": {"max_new_tokens": 120,
                                                                                "ignore_eos": True, "temperature": 0}}
    for _ in range(5):  # the second must arrive while the first decodes; retry if it did not
        first = []
        thread = threading.Thread(target=lambda results=first: results.append(server.generate(body)))
        thread.start()
        time.sleep(0.05)
        second = server.generate(body)  # the other replica is idle: only the front can know
        thread.join(timeout=60)
        answers = sorted([first[0], second], key=lambda answer: answer[0])
        assert answers[0][0] == 200, answers
        if answers[1][0] == 400:
            assert "Duplicate request ID detected: dup-replicas" in answers[1][1]["error"]["message"]
            assert answers[1][1]["error"]["param"] == "rid"
            return
    pytest.fail("never managed to send a duplicate rid while the first was in flight")


def test_the_key_and_bad_requests_are_answered_as_by_one_engine(server):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        assert server.call("GET", "/server_info", headers=headers) == (401, {"error": "Unauthorized"})
        assert server.generate({"input_ids": [5]}, headers=headers)[0] == 401
    status, out = server.call("POST", "/generate", raw=b"{not json")  # the replica's own message
    assert status == 400 and "malformed JSON body" in out["error"]["message"]
    status, out = server.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 1, "nope": 1}})
    assert status == 400 and "nope" in out["error"]["message"]
    assert server.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 1}})[0] == 200


def test_a_replica_that_dies_stops_the_server_naming_it(tiny_model_dir, tmp_path):
    # Two replicas sharing one device (--replicas-per-device 2), as a small model runs on one GPU.
    srv = start(tmp_path, tiny_model_dir, "--replicas-per-device", "2")
    try:
        info = srv.call("GET", "/server_info")[1]
        assert info["replicas_per_device"] == 2 and info["dp_size"] == 2
        replicas = info["replicas"]
        os.kill(replicas[1]["pid"], signal.SIGKILL)
        assert srv.proc.wait(timeout=60) == 1
        log = srv.read_log()
        assert f"replica 1 (pid {replicas[1]['pid']}, the CPU) exited with status -9: the server stops" in log
        assert gone_within([replicas[0]["pid"]]), log  # the other one is stopped too, not left holding its GPU
    finally:
        srv.stop()


def test_replicas_that_cannot_start_are_named_and_nothing_is_left_running(tiny_model_dir, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the replicas would start")
    # CUDA asked for on a machine without it: the replicas fail as they start; the front names one and exits 2.
    with pytest.raises(AssertionError, match="server exited with 2"):
        Server(tmp_path, tiny_model_dir, "--dp-size", "2", "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": "4,6"})
    log = (tmp_path / "server.log").read_text()
    pids = [int(pid) for pid in re.findall(r"replica \d \(pid (\d+), GPU [46]\)", log)]
    assert re.search(r"cannot start: replica [01] \(pid \d+, GPU [46]\) exited with status \d+ before it was "
                     r"ready", log), log
    assert len(set(pids)) == 2 and gone_within(pids), log
    # More replicas than listed GPUs: refused before anything starts, naming both numbers and the variable.
    with pytest.raises(AssertionError, match="server exited with 2"):
        Server(tmp_path, tiny_model_dir, "--dp-size", "3", "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert "--dp-size 3: CUDA_VISIBLE_DEVICES lists 2 device(s) (0,1); lower --dp-size (sglang_server_dp_size)" \
        in (tmp_path / "server.log").read_text()
    # More replicas a device than replicas: refused, naming the variable.
    with pytest.raises(AssertionError, match="server exited with 2"):
        Server(tmp_path, tiny_model_dir, "--replicas-per-device", "2", "--device", "cpu")
    assert "--replicas-per-device 2: more than the 1 replica(s) of --dp-size (sglang_server_dp_size)" \
        in (tmp_path / "server.log").read_text()


def test_each_replica_sees_its_own_gpu():
    assert visible_devices("cuda", 4, {}) == ["0", "1", "2", "3"]
    assert visible_devices("auto", 2, {"CUDA_VISIBLE_DEVICES": "3, 5,7"}) == ["3", "5"]
    assert visible_devices("cuda", 2, {"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}) == ["GPU-1a2b", "GPU-3c4d"]
    assert visible_devices("cpu", 3, {"CUDA_VISIBLE_DEVICES": "0"}) == [None, None, None]
    with pytest.raises(ValueError, match=r"--dp-size 4: CUDA_VISIBLE_DEVICES lists 2 device\(s\) \(0,1\); lower"):
        visible_devices("cuda", 4, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_replicas_per_device_share_each_gpu_in_order():
    assert visible_devices("cuda", 4, {}, per_device=4) == ["0", "0", "0", "0"]
    assert visible_devices("cuda", 4, {"CUDA_VISIBLE_DEVICES": "3,5"}, per_device=2) == ["3", "3", "5", "5"]
    assert visible_devices("cuda", 3, {"CUDA_VISIBLE_DEVICES": "3,5"}, per_device=2) == ["3", "3", "5"]
    with pytest.raises(ValueError, match=r"--dp-size 6 \(2 a device\): CUDA_VISIBLE_DEVICES lists 2 device\(s\) "
                       r"\(0,1\); lower --dp-size \(sglang_server_dp_size\) to 4 or list 3 devices"):
        visible_devices("cuda", 6, {"CUDA_VISIBLE_DEVICES": "0,1"}, per_device=2)
