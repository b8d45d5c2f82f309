"""The evaluation's SGLang side without SGLang: the launch argv's checks and meta_info's accounting."""

from __future__ import annotations

import pytest

from eagle3_pipeline.evaluate.sglang_client import add_meta_info
from eagle3_pipeline.evaluate.speculative import AcceptanceStats, EvaluationError
from eagle3_pipeline.serve import sglang_command as sc


def test_speculative_launch_is_a_topk_one_chain_on_localhost():
    argv = sc.speculative_launch_argv("py", "/m/target", "/m/drafter", 30100, 2, 4, ["--mem-fraction-static", "0.8"])
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--host"] == "127.0.0.1" and flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--speculative-num-steps"] == "4" and flags["--speculative-num-draft-tokens"] == "5"
    assert flags["--speculative-eagle-topk"] == "1" and flags["--tp-size"] == "2"
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]


@pytest.mark.parametrize("extra", [["--speculative-num-steps", "2"], ["--port=1"], ["--speculative"],
                                   ["--enable-return-aux-hidden-states"], ["-p", "3"], "--port 3"])
def test_speculative_launch_refuses_extras_that_change_what_it_sets(extra):
    with pytest.raises(ValueError):
        sc.speculative_launch_argv("py", "/m/target", "/m/drafter", 30100, extra_args=extra)


def test_meta_info_histogram_gives_the_reference_engines_counts():
    stats = AcceptanceStats(3)
    # 5 verifies accepting 0, 1, 1, 2, 3 drafts yield 7 + 5 tokens, 13 with the prefill's first one
    add_meta_info(stats, {"completion_tokens": 13, "spec_verify_ct": 5, "spec_num_correct_drafts": 7,
                          "spec_correct_drafts_histogram": [1, 2, 1, 1]}, 3)
    assert stats.rounds == 5 and stats.tau == pytest.approx(12 / 5) == pytest.approx(1 + stats.mean_accepted)
    assert stats.sglang_accept_length == pytest.approx(13 / 5)
    assert stats.accepted == [4, 2, 1] and stats.reached == [5, 4, 2]


def test_meta_info_without_speculative_counters_is_refused():
    with pytest.raises(EvaluationError, match="does not run speculative decoding"):
        add_meta_info(AcceptanceStats(3), {"completion_tokens": 12}, 3)
    stats = AcceptanceStats(3)
    add_meta_info(stats, {"completion_tokens": 1}, 3)  # ended on the prefill's token: no verify ran
    assert stats.rounds == 0 and stats.requests == 1
