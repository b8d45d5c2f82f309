"""The run's report (eagle3_pipeline.report): inputs read forgivingly, values escaped, secrets
dropped, the directory written whole and only when its inputs change."""

from __future__ import annotations

import io
import json
import shutil
from html.parser import HTMLParser
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

# The order an operator reads the page in: the verdict, the charts, the stages, the settings last.
SECTION_ORDER = ["verdict", "charts", "acceptance", "drafter", "training", "extraction", "gpu-reset", "settings"]
SECTION_IDS = [f'id="{key}"' for key in SECTION_ORDER]
VOID_TAGS = {"img", "meta", "link", "br", "hr", "input"}
# Tags whose text reads apart from its neighbours' (cells, items, paragraphs): the outline's text puts a space.
SEPARATE_TAGS = {"td", "th", "tr", "li", "p", "div", "h2", "h3", "summary", "ol", "ul", "table"}


class Outline(HTMLParser):
    """The page's sections in order: for each, its id, its text, and every tag with its attributes and the
    tags it sits in."""

    def __init__(self, page: str):
        super().__init__()
        self.sections: list[dict] = []
        self._open: list[tuple[str, dict]] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.sections.append({"id": attrs.get("id"), "text": "", "tags": []})
        elif self.sections:
            self.sections[-1]["tags"].append((tag, attrs, tuple(self._open)))
        if tag not in VOID_TAGS:
            self._open.append((tag, attrs))
        self._separate(tag)

    def _separate(self, tag):
        if tag in SEPARATE_TAGS and self.sections:
            self.sections[-1]["text"] += " "

    def handle_endtag(self, tag):
        self._separate(tag)
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self.sections:
            self.sections[-1]["text"] += data

    def ids(self) -> list[str]:
        return [section["id"] for section in self.sections]

    def section(self, key: str) -> dict:
        return next(section for section in self.sections if section["id"] == key)


def outline(out: Path) -> Outline:
    return Outline((out / "report" / "index.html").read_text())


def squeeze(text: str) -> str:
    """Text with runs of white space as one space (the page wraps its markup over lines)."""
    return " ".join(text.split())


def rewrite_evaluation(out: Path, **fields) -> None:
    path = out / "evaluation" / "evaluation.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


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
    # The held-out split over what serving first answers drafts, beside the whole split.
    assert ("what serving first answers of 128 tokens drafts (345 tokens): simulated acceptance length 0.876 (per "
            "token); walked round by round as serving drafts them: tau 1.371 at 1, 1.552 at 3, 1.703 at 10") in page
    assert "acc_k (held-out, served first answers, step 6)" in page and "0.450" in page
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
    verdict = squeeze(outline(out).section("verdict")["text"])
    assert verdict.startswith("Verdict PASSED Measured acceptance within what the training predicts, and the "
                              "outputs equal the target's own greedy decode.")
    assert "At each chain length (same prompts)" in page and "0.500 / 0.500 / 0.400" in page
    assert "The verdict per draft position" in page and "no: too few rounds" in page
    assert "Prompts excluded (1): seen in training, repeated or too long" in page and "held-bad" in page
    assert "1 differ at a numerical near-tie (logit gaps 0.062), 0 differ otherwise" in page


FAILED_VERDICT = {
    "passed": False, "judged": True, "min_ratio": 0.5, "min_rounds": 30, "predicted_from": "the held-out split",
    "positions": [{"draft_tokens": 3, "position": 1, "measured": 0.006, "rounds": 2263, "upper_99": 0.011,
                   "predicted": 0.6, "judged": True, "ok": False}],
    "problems": ["chain of 3, draft position 1: accepted in 14 of 2263 rounds"],
    "likely_causes": ["the target's forward with a KV cache differs from a full forward",
                      "the drafter was trained on other aux layers"],
}


def test_a_failed_evaluation_heads_the_report_with_failed_its_problems_and_causes(tmp_path, capsys):
    out = make_run(tmp_path)
    rewrite_evaluation(out, verdict=FAILED_VERDICT)
    assert report(out, "--json") == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "FAILED"
    page = (out / "report" / "index.html").read_text()
    parsed = outline(out)
    assert parsed.ids()[0] == "verdict"
    verdict = squeeze(parsed.section("verdict")["text"])
    assert verdict.startswith("Verdict FAILED Failed: Measured acceptance against the training's simulation")
    # The problem and every likely cause are in the first section, in the order the evaluation gives them.
    problem = verdict.index("accepted in 14 of 2263 rounds")
    first_cause = verdict.index("the target's forward with a KV cache differs from a full forward")
    assert problem < verdict.index("Likely causes, most frequent first:") < first_cause < verdict.index(
        "the drafter was trained on other aux layers")
    assert "1 draft position of 1 judged below 0.5 of what the held-out split predicts" in verdict
    assert "1 judged, 1 below" in verdict  # the chain of 3 in the measured-against-simulated table
    assert page.index("accepted in 14 of 2263 rounds") < page.index('id="charts"')
    assert '<div class="value">FAILED</div><div class="label">evaluation verdict</div>' in page
    assert 'class="headline failed"' in page and "BELOW" in parsed.section("acceptance")["text"]


# -- the page's order: the verdict first, the settings last and folded ------------------------
def test_the_page_leads_with_the_verdict_then_the_charts_and_ends_with_the_settings_folded(tmp_path):
    out = make_run(tmp_path / "run")
    assert report(out, "--settings-json", str(out / "settings.json")) == 0
    parsed = outline(out)
    assert parsed.ids() == SECTION_ORDER
    # Every chart is in the Charts section, none before it.
    images = {section["id"]: [attrs["src"] for tag, attrs, _ in section["tags"] if tag == "img"]
              for section in parsed.sections}
    assert sorted(images.pop("charts")) == ["acc_per_position.png", "acceptance_length.png",
                                            "acceptance_measured_vs_simulated.png", "loss.png"]
    assert not any(images.values()), images
    # The settings: their table inside a <details> that is closed until the reader opens it.
    settings = parsed.section("settings")
    tables = [ancestors for tag, _, ancestors in settings["tags"] if tag == "table"]
    assert len(tables) == 1
    details = [attrs for tag, attrs in tables[0] if tag == "details"]
    assert details == [{}], "the settings table must sit in a <details> without the open attribute"
    assert "Show the 5 variables" in settings["text"]  # the sixth names a secret
    # The names' cells never wrap; the page's style says so for that class.
    name_cells = [attrs for tag, attrs, _ in settings["tags"] if tag == "td" and attrs.get("class") == "nowrap"]
    assert len(name_cells) == 5
    page = (out / "report" / "index.html").read_text()
    assert "td.nowrap, td.nowrap code { white-space: nowrap; overflow-wrap: normal; word-break: normal; }" in page


def test_the_verdict_lists_each_check_and_what_to_look_at(tmp_path):
    out = make_run(tmp_path / "run")
    assert report(out) == 0
    verdict = squeeze(outline(out).section("verdict")["text"])
    for check in ("GPUs freed before the run (gpu_reset) passed 4 GPUs on 2 hosts verified free by NVML",
                  "Hidden states extracted and verified (extraction) passed 3 samples (300 tokens) stored",
                  "Training finished (training.json) passed 6 of 6 steps",
                  "Drafter exported (config.json, model.safetensors) passed",
                  "Measured acceptance against the training's simulation (evaluation verdict) passed each of the "
                  "2 draft positions judged",
                  "Outputs equal the target's own greedy decode (reference check) passed every output, but 1 output "
                  "at a numerical near-tie",
                  "Held-out prompts never seen in training (overlap check) passed 8 prompts measured"):
        assert check in verdict, check
    # Measured against simulated at each chain length: the chain of 7 is longer than the training simulates.
    # The replay (full forwards, no cache) beside them where the evaluation made one, and its diagnosis.
    assert "3 1.90 1.92 2.02 94% 2 judged, all within" in verdict
    assert "7 2.10 - - (the training simulates 3 draft positions) - none (too few rounds)" in verdict
    assert "Chain of 3: tau measured 1.900, replayed from full forwards 1.920" in verdict
    after = verdict[verdict.index("What to look at"):]
    for item in ("1 held-out prompt excluded: seen in training, repeated or longer", "1 dataset record skipped: "
                 "no_assistant_turn (1)", "1 sample failed the check, not stored: top1_mismatch bad (1)",
                 "localhost: 1 process left running: 77 (protected)"):
        assert item in after, item


def test_the_verdict_of_an_empty_run_is_not_measured_and_names_why(tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert report(out, "--json") == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "NOT MEASURED"
    verdict = squeeze(outline(out).section("verdict")["text"])
    assert verdict.startswith(f"Verdict NOT MEASURED Not measured: {out / 'evaluation' / 'evaluation.json'} "
                              "does not exist")
    assert "Training finished (training.json) not measured" in verdict
    assert "Nothing measured, and no training metrics to simulate from." in verdict
    assert "PASSED" not in verdict and "FAILED" not in verdict


def test_a_verdict_that_judged_nothing_is_not_judged(tmp_path):
    out = make_run(tmp_path / "run")
    rewrite_evaluation(out, verdict={"passed": True, "judged": False, "min_rounds": 30, "positions": [],
                                     "problems": [], "likely_causes": []})
    assert report(out) == 0
    verdict = squeeze(outline(out).section("verdict")["text"])
    assert verdict.startswith("Verdict NOT JUDGED Too few rounds: no draft position was reached 30 times.")
    assert "PASSED" not in verdict


def test_gpus_still_busy_after_the_reset_fail_the_verdict(tmp_path):
    out = make_run(tmp_path / "run")
    log = out / "gpu_reset" / "localhost.json"
    record = json.loads(log.read_text())
    record["gpus_after"][1]["free"] = False
    record["health_problems"] = ["GPU 1: 3 volatile uncorrected ECC errors"]
    log.write_text(json.dumps(record))
    assert report(out) == 0
    verdict = squeeze(outline(out).section("verdict")["text"])
    assert verdict.startswith("Verdict FAILED Failed: GPUs freed before the run (gpu_reset).")
    assert "still in use after the reset: localhost GPU 1" in verdict
    assert "localhost: GPU 1: 3 volatile uncorrected ECC errors" in verdict


def test_a_training_without_training_json_is_not_finished(tmp_path):
    out = make_run(tmp_path / "run", evaluation=False)
    (out / "drafter-run" / "training.json").unlink()
    assert report(out) == 0
    verdict = squeeze(outline(out).section("verdict")["text"])
    assert "Training finished (training.json) not finished no training.json yet; metrics.jsonl reaches step 6" \
        in verdict
    assert "the training (held-out evaluation at step 6) simulates tau 2.02 over its 3 draft positions" in verdict


def test_a_malformed_verdict_still_renders_and_fails_without_inventing_figures(tmp_path):
    out = make_run(tmp_path / "run")
    rewrite_evaluation(out, verdict={"passed": False, "problems": "one string, not a list", "positions": [3, None],
                                     "likely_causes": None},
                       runs=["not a run", {"draft_tokens": "three", "tau": "high"}])
    assert report(out) == 0
    verdict = squeeze(outline(out).section("verdict")["text"])
    assert verdict.startswith("Verdict FAILED")
    assert "one string, not a list" not in verdict and "Likely causes" not in verdict
    assert "failed, naming no draft position below its prediction" in verdict
    assert "- - - (no simulation recorded) - none (too few rounds)" in verdict


def test_the_extraction_shows_its_storage_and_an_unfinished_conversion_is_not_measured(tmp_path):
    out = make_run(tmp_path / "run")
    manifest_path = out / "data" / "data_config.json"
    assert report(out) == 0
    assert "hidden states stored as bfloat16 (as captured)" in squeeze(outline(out).section("extraction")["text"])

    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "storage_dtype": "float8_e4m3", "storage": {
        "dtype": "float8_e4m3", "quantized": True, "read_as": "bfloat16", "scales": {"dtype": "float32"}}}))
    assert report(out) == 0
    assert ("hidden states stored as float8_e4m3, one float32 scale per token and captured layer; read back as "
            "bfloat16") in squeeze(outline(out).section("extraction")["text"])

    (out / "data" / "storage-conversion.journal.jsonl").write_text("")
    assert report(out) == 0
    text = squeeze(outline(out).section("extraction")["text"])
    assert f"a storage conversion is unfinished in {out / 'data'}" in text
    assert f"`eagle3-pipeline convert-storage {out / 'data'} --to float8_e4m3`" in text
