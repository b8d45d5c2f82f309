"""The run's report (eagle3_pipeline.report): inputs read forgivingly, values escaped, secrets
dropped, the directory written whole and only when its inputs change."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from report_fixtures import HOSTILE, HOSTILE_ATTR, SECRET, make_run, tiny_png

from eagle3_pipeline.cli import main as cli_main
from eagle3_pipeline.report import build as build_module
from eagle3_pipeline.report.inputs import (
    drop_secrets,
    measured_rates,
    read_inputs,
    read_settings,
)
from eagle3_pipeline.report.render import serving_argv
from eagle3_pipeline.serve.sglang_command import speculative_launch_argv

SECTION_IDS = ['id="settings"', 'id="gpu-reset"', 'id="extraction"', 'id="training"', 'id="acceptance"',
               'id="drafter"']


def report(out: Path, *extra: str) -> int:
    return cli_main(["report", "--output-dir", str(out), *extra])


def state(out: Path) -> dict:
    return json.loads((out / "report" / "report.json").read_text())


def all_report_text(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (out / "report").iterdir() if p.suffix != ".png")


# -- pieces -------------------------------------------------------------------------------
def test_secrets_are_dropped_at_any_depth_and_look_alike_names_kept():
    values, withheld = drop_secrets({
        "sglang_server_api_key": "k", "hf_token": "t", "eagle_training_batch_tokens": 512,
        "env": {"AWS_SECRET_ACCESS_KEY": "s", "DB_PASSWORD": "p", "PATH": "/bin"},
        "hosts": [{"apiKey": "x", "name": "a"}], "num_draft_tokens": 4,
    })
    assert values == {"eagle_training_batch_tokens": 512, "env": {"PATH": "/bin"}, "hosts": [{"name": "a"}],
                      "num_draft_tokens": 4}
    assert sorted(withheld) == ["env.AWS_SECRET_ACCESS_KEY", "env.DB_PASSWORD", "hf_token", "hosts.0.apiKey",
                                "sglang_server_api_key"]


def test_camel_case_api_key_is_dropped_too():
    _, withheld = drop_secrets({"apikey": 1, "api-key": 2, "ApiKey": 3})
    assert sorted(withheld) == ["ApiKey", "api-key", "apikey"]


def test_measured_rates_are_taken_as_the_evaluation_writes_them():
    assert measured_rates([0.5, 0.3, 0.1], 100, tau=1.85) == ([0.5, 0.3, 0.1], None)
    assert measured_rates([0.2, 0.1]) == ([0.2, 0.1], None)


def test_measured_counts_are_divided_by_the_target_forwards_else_scaled_to_tau():
    rates, note = measured_rates([50, 30, 10], 100, tau=1.9)
    assert rates == pytest.approx([0.5, 0.3, 0.1]) and "target_forwards" in note
    rates, note = measured_rates([50, 30, 10], None, tau=1.9)
    assert rates == pytest.approx([0.5, 0.3, 0.1]) and "tau - 1" in note


def test_measured_list_that_cannot_be_read_is_not_shown():
    assert measured_rates([1, -1], tau=1.5)[0] is None
    assert measured_rates([5, 3])[0] is None
    assert measured_rates(["x"], tau=1.5)[0] is None
    assert measured_rates("0.5", tau=1.5) == (None, None)


def test_serving_command_is_the_projects_speculative_launch_with_the_measured_chain(tmp_path):
    out = make_run(tmp_path / "run")
    settings = read_settings(str(out / "settings.json"))
    inputs = read_inputs(out, settings, out / "gpu_reset", out / "data", out / "drafter-run", out / "evaluation")
    argv = serving_argv(inputs)
    assert argv == speculative_launch_argv("python", "/models/target", str(out / "drafter-run" / "drafter"), 30000,
                                           tp_size=2, num_steps=3, host="127.0.0.1")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    for flag, value in (("--speculative-algorithm", "EAGLE3"), ("--speculative-eagle-topk", "1"),
                        ("--speculative-num-draft-tokens", "4"), ("--port", "30000")):
        assert argv[argv.index(flag) + 1] == value


def test_simulated_acceptance_is_the_running_product_of_the_held_out_conditional_accuracies(tmp_path):
    out = make_run(tmp_path / "run")
    inputs = read_inputs(out, read_settings(None), out / "gpu_reset", out / "data", out / "drafter-run",
                         out / "evaluation")
    acceptance = inputs.acceptance
    assert acceptance.simulated_rates == pytest.approx([0.6, 0.3, 0.12])
    assert acceptance.simulated_source == "held-out evaluation at step 6"
    assert acceptance.simulated_tau == pytest.approx(2.02)
    assert acceptance.measured_tau == 1.9 and acceptance.reason is None
    # The torn last line of metrics.jsonl is skipped, as train.charts reads it.
    assert inputs.training.metrics.skipped_lines == 1
    assert inputs.target_model_path == "/models/target"


# -- the whole report ---------------------------------------------------------------------
def test_report_shows_every_section_with_figures_and_escapes_every_value(tmp_path, capsys):
    out = make_run(tmp_path / "run", hostile=True)
    assert report(out, "--settings-json", str(out / "settings.json")) == 0
    assert capsys.readouterr().out.strip() == f"report: {out / 'report' / 'index.html'} (written)"
    page = (out / "report" / "index.html").read_text()
    for section in SECTION_IDS:
        assert section in page
    assert sorted(p.name for p in (out / "report").glob("*.png")) == [
        "acc_per_position.png", "acceptance_length.png", "acceptance_measured_vs_simulated.png", "loss.png"]
    for name in ("loss.png", "acc_per_position.png", "acceptance_length.png", "acceptance_measured_vs_simulated.png"):
        assert f'<img src="{name}"' in page
    assert HOSTILE not in page and HOSTILE_ATTR not in page and "<script" not in page
    assert "&lt;script&gt;window.__pwned = true&lt;/script&gt;" in page
    assert "Content-Security-Policy" in page and "http://" not in page and "https://" not in page
    # Figures from each input.
    assert "first signal to verified free: 1.21 s" in page and "SIGTERM" in page
    assert "12.00 kB (12,000 bytes)" in page and "top1_mismatch" in page and "150.0" in page
    assert "1.900" in page and "2.020" in page
    assert "--speculative-draft-model-path" in page and str(out / "drafter-run" / "drafter") in page


def test_secrets_never_reach_the_report_directory(tmp_path):
    out = make_run(tmp_path / "run")
    assert report(out, "--settings-json", str(out / "settings.json"), "--json") == 0
    text = all_report_text(out)
    assert SECRET not in text
    assert "sglang_server_api_key" in text  # named as withheld, its value never shown
    assert "eagle_training_batch_tokens" in text


def test_settings_from_stdin(tmp_path, monkeypatch):
    out = make_run(tmp_path / "run")
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"extraction_num_samples": 7, "my_password": SECRET})))
    assert report(out, "--settings-json", "-") == 0
    page = (out / "report" / "index.html").read_text()
    assert "extraction_num_samples" in page and SECRET not in page


@pytest.mark.parametrize("content, message", [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object")])
def test_settings_that_do_not_parse_are_refused_and_nothing_is_written(tmp_path, capsys, content, message):
    out = make_run(tmp_path / "run")
    (out / "settings.json").write_text(content)
    assert report(out, "--settings-json", str(out / "settings.json")) == 2
    assert message in capsys.readouterr().err
    assert not (out / "report").exists()


def test_report_of_an_empty_run_says_what_was_not_measured(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert report(out) == 0
    page = (out / "report" / "index.html").read_text()
    for section in SECTION_IDS:
        assert section in page
    assert "No GPU reset log" in page
    assert f"Not measured: {out / 'data' / 'data_config.json'} does not exist" in page
    assert f"Not measured: {out / 'drafter-run' / 'metrics.jsonl'} does not exist" in page
    assert f"Not measured: {out / 'evaluation' / 'evaluation.json'} does not exist" in page
    assert "&lt;target model path&gt;" in page
    assert "<img" not in page
    assert state(out)["summary"]["measured_tau"] is None


def test_evaluation_without_tau_is_not_measured_and_training_is_still_shown(tmp_path):
    out = make_run(tmp_path / "run")
    (out / "evaluation" / "evaluation.json").write_text(json.dumps({"engine": "sglang", "prompts": 3}))
    assert report(out) == 0
    page = (out / "report" / "index.html").read_text()
    assert "has no numeric tau" in page
    assert "Simulated by the training (held-out evaluation at step 6)" in page
    assert "acceptance_measured_vs_simulated.png" not in page
    assert not (out / "report" / "acceptance_measured_vs_simulated.png").exists()


def test_missing_training_charts_are_drawn_from_the_metrics(tmp_path):
    out = make_run(tmp_path / "run", evaluation=False)
    shutil.rmtree(out / "drafter-run" / "charts")
    assert report(out) == 0
    assert sorted(p.name for p in (out / "report").glob("*.png")) == [
        "acc_per_position.png", "acceptance_length.png", "loss.png"]
    assert (out / "report" / "loss.png").read_bytes().startswith(b"\x89PNG")


# -- idempotence and atomicity --------------------------------------------------------------
def test_unchanged_inputs_write_nothing(tmp_path, capsys):
    out = make_run(tmp_path / "run")
    assert report(out, "--json") == 0
    first = json.loads(capsys.readouterr().out)
    assert first["written"] and first["changed"]
    index = out / "report" / "index.html"
    before = index.stat().st_mtime_ns, index.stat().st_ino
    assert report(out, "--json") == 0
    second = json.loads(capsys.readouterr().out)
    assert not second["written"] and not second["changed"]
    assert (index.stat().st_mtime_ns, index.stat().st_ino) == before


def test_a_new_gpu_reset_log_rewrites_the_report_without_counting_as_a_change(tmp_path, capsys):
    out = make_run(tmp_path / "run")
    assert report(out) == 0
    log = out / "gpu_reset" / "localhost.json"
    record = json.loads(log.read_text())
    record["wait_seconds"] = 2.5
    log.write_text(json.dumps(record))
    capsys.readouterr()
    assert report(out, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["written"] and not result["changed"]
    assert "waiting for free memory took 2.50 s" in (out / "report" / "index.html").read_text()


def test_a_new_evaluation_is_a_change(tmp_path, capsys):
    out = make_run(tmp_path / "run")
    assert report(out) == 0
    evaluation = out / "evaluation" / "evaluation.json"
    record = json.loads(evaluation.read_text())
    record["tau"], record["accepted_per_position"] = 2.0, [0.5, 0.3, 0.2]
    evaluation.write_text(json.dumps(record))
    capsys.readouterr()
    assert report(out, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["written"] and result["changed"] and result["measured_tau"] == 2.0


def test_a_new_training_chart_is_a_change(tmp_path, capsys):
    out = make_run(tmp_path / "run")
    assert report(out) == 0
    tiny_png(out / "drafter-run" / "charts" / "loss.png", (1, 2, 3))
    capsys.readouterr()
    assert report(out, "--json") == 0
    assert json.loads(capsys.readouterr().out)["changed"]


def test_check_says_what_would_happen_and_writes_nothing(tmp_path, capsys):
    out = make_run(tmp_path / "run")
    assert report(out, "--check", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["check"] and result["written"] and result["changed"]
    assert not (out / "report").exists()
    assert report(out) == 0
    capsys.readouterr()
    assert report(out, "--check") == 0
    assert "would be left as it is" in capsys.readouterr().out


def test_force_rewrites_unchanged_inputs(tmp_path, capsys):
    out = make_run(tmp_path / "run")
    assert report(out) == 0
    capsys.readouterr()
    assert report(out, "--force", "--json") == 0
    assert json.loads(capsys.readouterr().out)["written"]


def test_a_failed_build_keeps_the_old_report_and_leaves_no_temp_directory(tmp_path, monkeypatch):
    out = make_run(tmp_path / "run")
    assert report(out) == 0
    old_page = (out / "report" / "index.html").read_text()
    (out / "evaluation" / "evaluation.json").write_text(json.dumps({"tau": 3.0}))

    def broken(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(build_module, "render_page", broken)
    assert report(out) == 1
    assert (out / "report" / "index.html").read_text() == old_page
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_leftovers_of_a_killed_build_are_removed(tmp_path):
    out = make_run(tmp_path / "run")
    (out / ".report.tmp-dead").mkdir()
    (out / ".report.old-dead" / "report").mkdir(parents=True)
    assert report(out) == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert (out / "report" / "index.html").is_file()


def test_the_evaluation_verdict_chains_exclusions_and_output_check_are_shown(tmp_path):
    out = make_run(tmp_path)
    assert report(out) == 0
    page = (out / "report" / "index.html").read_text()
    assert "Evaluation passed: measured acceptance within what the training predicts." in page
    assert "At each chain length (same prompts)" in page and "0.500 / 0.500 / 0.400" in page
    assert "Prompts excluded (1): seen in training or repeated" in page and "held-bad" in page
    assert "1 differ at a numerical near-tie (logit gaps 0.062), 0 differ otherwise" in page


def test_a_failed_evaluation_marks_the_report_with_its_problems_and_causes(tmp_path):
    out = make_run(tmp_path)
    path = out / "evaluation" / "evaluation.json"
    record = json.loads(path.read_text())
    record["verdict"] = {"passed": False, "judged": True,
                         "problems": ["chain of 3, draft position 1: accepted in 14 of 2263 rounds"],
                         "likely_causes": ["the target's forward with a KV cache differs from a full forward"]}
    path.write_text(json.dumps(record))
    assert report(out) == 0
    page = (out / "report" / "index.html").read_text()
    assert "Evaluation FAILED" in page and "accepted in 14 of 2263 rounds" in page
    assert "the target&#x27;s forward with a KV cache differs" in page
    assert '<div class="value">FAILED</div><div class="label">evaluation verdict</div>' in page
