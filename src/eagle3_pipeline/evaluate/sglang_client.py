"""Acceptance measured on a running SGLang server that serves the drafter (``--speculative-algorithm EAGLE3``).

Each held-out prompt goes to ``/generate`` as token ids, greedy (temperature 0). SGLang 0.5.23
puts its per-request speculative counters into ``meta_info`` once the request finishes
(managers/tokenizer_manager.py ``_calculate_spec_decoding_metrics``, when a verify ran):

- ``spec_verify_ct``: verify forwards of the request (managers/scheduler_components/
  batch_result_processor.py adds 1 per verify);
- ``spec_num_correct_drafts``: drafts accepted, the bonus token not included;
- ``spec_correct_drafts_histogram``: entry i = verify forwards that accepted i drafts;
- ``spec_accept_length`` = ``completion_tokens / spec_verify_ct`` (the prefill's first token
  counted, the prefill forward not).

From the histogram the same per-position counts as the reference engine's follow (rounds that
accepted at least j drafts), and tau = (completion_tokens - 1) / spec_verify_ct, the tokens
the verify forwards produced per verify forward, as in ``speculative.py``.
"""

from __future__ import annotations

import time

from eagle3_pipeline.evaluate.speculative import AcceptanceStats, EvaluationError
from eagle3_pipeline.server_client import EngineClient


def add_meta_info(stats: AcceptanceStats, meta: dict, draft_tokens: int) -> None:
    """Count one finished request from its ``meta_info``."""
    completion = int(meta.get("completion_tokens") or 0)
    verify = meta.get("spec_verify_ct")
    stats.requests += 1
    stats.completion_tokens += completion
    if verify is None:
        if completion > 1:
            raise EvaluationError(
                f"meta_info has no spec_verify_ct after {completion} tokens: the server does not run speculative "
                "decoding (was it started with --speculative-algorithm EAGLE3 --speculative-draft-model-path?)")
        return  # finished on the prefill's token: no verify ran
    verify = int(verify)
    histogram = [int(count) for count in meta.get("spec_correct_drafts_histogram") or []]
    if sum(histogram) != verify:
        # No histogram (or a partial one): totals only, the drafts spread as evenly as they can be.
        correct = int(meta.get("spec_num_correct_drafts") or 0)
        histogram = [0] * (draft_tokens + 1)
        if verify:
            base, extra = divmod(correct, verify)
            histogram[min(base, draft_tokens)] += verify - extra
            if extra:
                histogram[min(base + 1, draft_tokens)] += extra
    for accepted, count in enumerate(histogram):
        for _ in range(count):
            stats.add_round(draft_tokens, min(accepted, draft_tokens), 0)
    stats.produced += max(completion - 1, 0)


def measure_sglang(url: str, prompts, max_new_tokens: int, draft_tokens: int, api_key: str | None = None,
                   timeout_s: float = 600.0, progress=None) -> tuple[AcceptanceStats, list[list[int]], float]:
    """(stats, output ids per prompt, wall seconds) of greedy requests, one at a time, to ``url``."""
    client = EngineClient(url, api_key=api_key, timeout_s=timeout_s)
    stats = AcceptanceStats(draft_tokens)
    outputs = []
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        body = {"input_ids": list(prompt.input_ids), "rid": f"eagle3-evaluate-{index}",
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
        answer = client.call("POST", "/generate", body)
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        if not isinstance(meta, dict):
            raise EvaluationError(f"{url}/generate answered without meta_info: {str(answer)[:200]}")
        add_meta_info(stats, meta, draft_tokens)
        outputs.append(list(answer.get("output_ids") or []))
        if progress is not None:
            progress(index + 1, stats)
    return stats, outputs, time.perf_counter() - started
