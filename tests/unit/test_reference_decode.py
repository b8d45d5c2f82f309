"""The reference engine's decode: batched, vectorized, continuous, and equal to greedy decoding by full forwards.

The yardstick is the slowest decode there is: for every new token, one forward over the whole
sequence so far, no KV cache, on the embedded tiny model in float32. The engine's output must
equal it token for token. Where the two differ, the full forward's best two logits must be a
near-tie (within ``NEAR_TIE`` logits, far below any real margin and far above float32 kernel
noise); the comparison ends there, since the continuations then legitimately part.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_target import built_tiny_model

from eagle3_pipeline.engine.batcher import BatchWorker, GenerateJob, ModelRunner, SamplingConfig

NEAR_TIE = 1e-3
START_TIMEOUT_S = 120.0
QUESTIONS = [
    "What does os.path.join do?", "Explain the Python module json.", "What is collections.OrderedDict?",
    "How do I call shutil.copy?", "What is the class threading.Event used for?", "Explain itertools.chain.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Torch on one thread in this process while these tests run: the many small full forwards of the
    yardstick are several times slower when two threads contend with the test's server process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return built_tiny_model()


@pytest.fixture(scope="module")
def runner(tiny_model) -> ModelRunner:
    return ModelRunner(str(tiny_model), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def prompts(runner) -> list[list[int]]:
    """Chat prompts of different lengths (a system turn on some), as the regeneration sends them."""
    out = []
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": question}]
        if i % 2:
            messages.insert(0, {"role": "system", "content": "You answer questions about Python briefly."})
        out.append(list(runner.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)))
    assert len({len(p) for p in out}) > 3, "the prompts should differ in length"
    return out


def full_forward_greedy(runner: ModelRunner, ids: list[int], budget: int,
                        ignore_eos: bool = False) -> tuple[list[int], list[float]]:
    """Greedy tokens by one full forward per token (no cache), and the top-1 margin at each step."""
    tokens, margins = [], []
    sequence = list(ids)
    with torch.inference_mode():
        for _ in range(budget):
            logits = runner.model(input_ids=torch.tensor([sequence]), use_cache=False).logits[0, -1].float()
            best = logits.topk(2)
            token = int(best.indices[0])
            tokens.append(token)
            margins.append(float(best.values[0] - best.values[1]))
            sequence.append(token)
            if token in runner.eos_token_ids and not ignore_eos:
                break
    return tokens, margins


def assert_same_greedy(got: list[int], want: list[int], margins: list[float], what: str) -> None:
    for step, (ours, theirs) in enumerate(zip(got, want)):
        if ours != theirs:
            assert margins[step] < NEAR_TIE, (
                f"{what}: token {step} is {ours}, the full forward's is {theirs} with a margin of {margins[step]:.3g}"
            )
            return
    assert len(got) == len(want), f"{what}: {len(got)} tokens, the full forward stops after {len(want)}"


def greedy_job(ids: list[int], budget: int, **kwargs) -> GenerateJob:
    return GenerateJob(rid="t", input_ids=ids, capture=False,
                       sampling=SamplingConfig(max_new_tokens=budget, temperature=0.0), **kwargs)


def test_a_batch_whose_rows_end_at_different_steps_equals_full_forward_greedy(runner, prompts):
    budgets = [40, 3, 25, 1, 12, 33]
    outcomes = runner.run_batch([greedy_job(ids, n) for ids, n in zip(prompts, budgets)])
    for i, (ids, n, outcome) in enumerate(zip(prompts, budgets, outcomes)):
        want, margins = full_forward_greedy(runner, ids, n)
        assert_same_greedy(outcome.output_ids, want, margins, f"prompt {i}")
        ended = "stop" if want[-1] in runner.eos_token_ids else "length"
        assert outcome.finish_reason["type"] == ended


def test_rows_that_join_a_running_decode_equal_full_forward_greedy(runner, prompts):
    # The first rows decode their whole budget (ignore_eos): whatever a model answers, they are still running
    # 8 tokens in, when the others join. The joining rows end wherever the model ends them.
    first = [greedy_job(ids, 30) for ids in prompts[:2]]
    for job in first:
        job.sampling.ignore_eos = True
    batch, finished = runner.start(first)
    assert not finished
    for _ in range(7):
        finished += runner.step(batch)
    assert not finished and runner.can_merge(batch)
    joining, more = runner.start([greedy_job(ids, 30) for ids in prompts[2:]])
    batch = runner.merge(batch, joining)
    rows = {id(row.job): row for row in (*batch.rows, *finished, *more)}
    jobs = [row.job for row in batch.rows]
    while batch.rows:
        runner.step(batch)
    assert len(jobs) == len(prompts) - len(finished) - len(more)
    for job in jobs:
        want, margins = full_forward_greedy(runner, job.input_ids, 30, ignore_eos=job.sampling.ignore_eos)
        assert_same_greedy(rows[id(job)].outcome.output_ids, want, margins, f"prompt of {len(job.input_ids)} tokens")


def test_logprobs_of_a_batched_decode_are_each_rows_own(runner, prompts):
    jobs = [greedy_job(ids, 5, return_logprob=True, top_logprobs_num=k) for ids, k in zip(prompts[:3], (0, 1, 3))]
    for job in jobs:
        job.sampling.ignore_eos = True
    outcomes = runner.run_batch(jobs)
    for job, outcome in zip(jobs, outcomes):
        sequence = list(job.input_ids)
        for step, token in enumerate(outcome.output_ids):
            with torch.inference_mode():
                logprobs = runner.model(input_ids=torch.tensor([sequence])).logits[0, -1].float().log_softmax(-1)
            value, chosen = outcome.output_token_logprobs[step]
            assert chosen == token and value == pytest.approx(float(logprobs[token]), abs=1e-4)
            if job.top_logprobs_num:
                top = logprobs.topk(job.top_logprobs_num).indices.tolist()
                assert [t for _, t in outcome.output_top_logprobs[step]] == top
            else:
                assert outcome.output_top_logprobs is None
            sequence.append(token)


FIRST_BUDGET = 320  # tokens of the request the others join


def test_concurrent_generate_requests_equal_full_forward_greedy_and_join_the_running_decode(
    tiny_model, runner, prompts, tmp_path
):
    log_file = tmp_path / "server.log"
    command = [sys.executable, "-m", "eagle3_pipeline.engine.reference_server", "--model-path", str(tiny_model),
               "--port", "0", "--device", "cpu", "--dtype", "float32", "--max-batch-size", "16",
               "--log-file", str(log_file), "--log-level", "debug"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        port = None
        while port is None:
            assert proc.poll() is None, log_file.read_text() if log_file.exists() else "no log"
            assert time.monotonic() < deadline, "the server did not start"
            match = re.search(r"serving http://[\d.]+:(\d+)", log_file.read_text() if log_file.exists() else "")
            port = int(match.group(1)) if match else time.sleep(0.1)
        results: dict[int, dict] = {}

        def send(i: int, budget: int, ignore_eos: bool = False) -> None:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            body = {"input_ids": prompts[i],
                    "sampling_params": {"max_new_tokens": budget, "temperature": 0, "ignore_eos": ignore_eos}}
            connection.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            results[i] = {"status": response.status, **json.loads(response.read())}
            connection.close()

        # The first request decodes its whole budget, end token or not (the tiny model is built on each
        # machine: where its answer ends early, 80 tokens were over before the others came). The others
        # are sent once its prefill is logged: they arrive while it decodes its 320 tokens, and join it.
        first = threading.Thread(target=send, args=(0, FIRST_BUDGET, True))
        first.start()
        while "prefill of 1 request(s)" not in log_file.read_text():
            assert first.is_alive() and time.monotonic() < deadline + START_TIMEOUT_S, log_file.read_text()
            time.sleep(0.01)
        others = [threading.Thread(target=send, args=(i, 24)) for i in range(1, len(prompts))]
        for thread in others:
            thread.start()
        for thread in [first, *others]:
            thread.join(timeout=120)
        for i, ids in enumerate(prompts):
            assert results[i]["status"] == 200, results[i]
            want, margins = full_forward_greedy(runner, ids, FIRST_BUDGET if i == 0 else 24, ignore_eos=i == 0)
            assert_same_greedy(results[i]["output_ids"], want, margins, f"request {i}")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    stopped = re.search(r"(\d+) request\(s\) served in (\d+) batch\(es\), (\d+) of them joined a running decode",
                        log_file.read_text())
    assert stopped and int(stopped.group(1)) == len(prompts)
    if int(stopped.group(3)) == 0:
        pytest.fail(f"no request joined the running decode: {stopped.group(0)}")


# -- the slot cache (engine/slots.py) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slotted(tiny_model) -> ModelRunner:
    """A second runner of the tiny model whose decode goes over a slot cache of 4 slots."""
    runner = ModelRunner(str(tiny_model), device="cpu", dtype="float32")
    assert runner.enable_slots(4, 256, graphs=False), runner.decode_path
    return runner


def test_slot_decoding_equals_full_forward_greedy_and_gives_every_slot_back(slotted, prompts):
    budgets = [40, 3, 25, 1]
    outcomes = slotted.run_batch([greedy_job(ids, n) for ids, n in zip(prompts, budgets)])
    for i, (ids, n, outcome) in enumerate(zip(prompts, budgets, outcomes)):
        want, margins = full_forward_greedy(slotted, ids, n)
        assert_same_greedy(outcome.output_ids, want, margins, f"prompt {i}")
    assert slotted.slot_decoder.free_slots == 4


def test_rows_that_join_a_slotted_decode_in_freed_slots_equal_full_forward_greedy(slotted, prompts):
    # The first rows decode their whole budgets (ignore_eos), whatever a model answers: the 2-token row ends at
    # its second token, the others still run when the joining rows (ended wherever the model ends them) come.
    first = [greedy_job(ids, n) for ids, n in zip(prompts[:3], (30, 2, 30))]
    for job in first:
        job.sampling.ignore_eos = True
    batch, finished = slotted.start(first)
    assert batch.slotted and not finished
    for _ in range(4):  # the 2-token row ends and gives its slot back
        finished += slotted.step(batch)
    assert [len(row.outcome.output_ids) for row in finished] == [2]
    assert slotted.slot_decoder.free_slots == 2
    joining, more = slotted.start([greedy_job(ids, 30) for ids in prompts[3:5]])
    assert slotted.can_merge(batch, joining)
    batch = slotted.merge(batch, joining)
    rows = {id(row.job): row for row in (*batch.rows, *finished, *more)}
    jobs = [row.job for row in batch.rows]
    while batch.rows:
        slotted.step(batch)
    for job in jobs:
        want, margins = full_forward_greedy(slotted, job.input_ids, 30, ignore_eos=job.sampling.ignore_eos)
        assert_same_greedy(rows[id(job)].outcome.output_ids, want, margins, f"prompt of {len(job.input_ids)} tokens")
    assert slotted.slot_decoder.free_slots == 4


def test_requests_beyond_the_free_slots_wait_for_one_and_only_those_a_slot_cannot_take_decode_on_transformers(
        slotted, prompts):
    """Six requests for four slots: two wait until slots free up, then decode over slots too (the transformers path
    decodes many times slower, and slowed every step that ran both). Only the request asking for logprobs and the one
    longer than a slot take the transformers path. Every answer is the full forwards' greedy one; every slot comes
    back."""
    jobs = [greedy_job(ids, 12) for ids in prompts]  # 6 requests, 4 slots
    jobs.append(greedy_job(prompts[0], 5, return_logprob=True))
    jobs.append(greedy_job(prompts[1], 300))  # longer than a slot's 256 tokens
    batches, waiting = slotted.groups(jobs)
    assert [len(group) for group in batches] == [4, 2] and waiting == jobs[4:6]
    assert all(slotted.slot_ready(job) for job in batches[0]) and batches[1] == jobs[-2:]
    prefilled = []  # the transformers path's prefills, as the worker calls them
    real_prefill = slotted.prefill

    def spy(batch_jobs):
        prefilled.extend(job.input_ids for job in batch_jobs)
        return real_prefill(batch_jobs)

    slotted.prefill = spy
    worker = BatchWorker(slotted, max_batch_size=8).start()
    try:
        futures = [worker.submit(job) for job in jobs]
        outcomes = [future.result(timeout=300) for future in futures]
    finally:
        worker.stop()
        del slotted.prefill
    for job, outcome in zip(jobs, outcomes):
        want, margins = full_forward_greedy(slotted, job.input_ids, job.sampling.max_new_tokens)
        assert_same_greedy(outcome.output_ids, want, margins, f"prompt of {len(job.input_ids)} tokens")
    logprobs = outcomes[-2].output_token_logprobs
    assert logprobs and len(logprobs) == len(outcomes[-2].output_ids)
    assert sorted(prefilled) == sorted(job.input_ids for job in jobs[-2:])  # no slot-ready request among them
    stats = worker.stats()
    assert stats["slot_waits"] >= 2 and stats["waiting_for_slot"] == 0, stats
    assert sum(job.waited_for_slot for job in jobs[:6]) == stats["slot_waits"]
    assert slotted.slot_decoder.free_slots == 4


def small_model(tmp_path: Path, kind: str) -> Path:
    """A 2-layer model of another architecture with random weights."""
    import transformers

    shape = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    extra = {"Gemma": {"head_dim": 16}, "Qwen3": {"head_dim": 16},
             # Granite's multipliers, but logits as lm_head gives them (the engine refuses scaled logits)
             "Granite": {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "logits_scaling": 1.0}}[kind]
    config = getattr(transformers, f"{kind}Config")(**shape, **extra)
    torch.manual_seed(0)
    getattr(transformers, f"{kind}ForCausalLM")(config).save_pretrained(tmp_path / kind)
    return tmp_path / kind


@pytest.mark.parametrize("kind", ["Gemma", "Qwen3"])
def test_other_llama_style_architectures_decode_over_slots_as_their_full_forwards(tmp_path, kind):
    """Gemma (embeddings scaled, norms of 1 + w, both inside its modules) and Qwen3 (per-head q/k norms)."""
    runner = ModelRunner(str(small_model(tmp_path, kind)), device="cpu", dtype="float32", aux_layers=[0])
    assert runner.enable_slots(4, 128, graphs=False), runner.decode_path
    ids = [list(range(3 + i, 20 + 3 * i)) for i in range(3)]
    for prompt, outcome in zip(ids, runner.run_batch([greedy_job(prompt, 9) for prompt in ids])):
        want, margins = full_forward_greedy(runner, prompt, 9)
        assert_same_greedy(outcome.output_ids, want, margins, f"{kind}, prompt of {len(prompt)} tokens")


def test_a_model_the_slot_path_does_not_reproduce_keeps_the_transformers_path_and_says_why(tmp_path):
    """Granite multiplies its embeddings and each layer's residual branch inside the decoder's and the
    layers' forwards, which the slot path's layer loop does not: its modules have Llama's names, so only
    the start-up check against full forwards can tell."""
    runner = ModelRunner(str(small_model(tmp_path, "Granite")), device="cpu", dtype="float32", aux_layers=[0])
    assert not runner.enable_slots(4, 128, graphs=False)
    assert runner.slot_decoder is None
    assert "differ from a full forward" in runner.decode_path, runner.decode_path
    prompt = list(range(3, 20))
    outcome = runner.run_batch([greedy_job(prompt, 4)])[0]
    want, margins = full_forward_greedy(runner, prompt, 4)
    assert_same_greedy(outcome.output_ids, want, margins, "Granite on the transformers path")
