"""The report in a real browser: headless Chromium (Debian's ``chromium``) renders it cleanly.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
messages ending in NUL on file descriptors 3 and 4), so no port, no websocket package and no
browser download is needed. For each page the test collects console errors, uncaught
exceptions, log entries of level error (failed loads land there), failed network loads and any
request that is not a local file, then asks the DOM for the sections and each image's
``naturalWidth``. It also measures the layout an operator sees: the verdict's headline inside the
first screen of a laptop, the settings folded, and, opened on a narrow window, every variable's name
on one line. ``make test`` installs chromium; without it these tests are skipped, saying so.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
from report_fixtures import make_run  # noqa: E402

from eagle3_pipeline.cli import main as cli_main  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (make test installs it: apt-get install -y chromium)"
)
LOAD_TIMEOUT_S = 30.0
SECTIONS = ["verdict", "charts", "acceptance", "drafter", "training", "extraction", "gpu-reset", "settings"]
# A laptop's first screen, and a window narrow enough that the settings table must wrap something.
LAPTOP, NARROW = (1280, 720), (760, 900)


class Chromium:
    """A headless Chromium spoken to over the DevTools pipe, one page attached."""

    def __init__(self, profile: Path):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire_pipes():  # in the child: fd 3 reads commands, fd 4 writes answers
            # Moved above 4 first: a pipe may already sit on fd 3 or 4, and dup2 onto itself
            # would keep its close-on-exec flag (and one dup2 could clobber the other pipe).
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child_r, from_child_w)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--remote-debugging-pipe", f"--user-data-dir={profile}",
             "--disable-gpu", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--window-size=1280,2000", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # The test starts no thread: preexec_fn is safe here, and the only way to place the pipes.
            preexec_fn=wire_pipes, close_fds=False, start_new_session=True,  # noqa: PLW1509
        )  # fmt: skip
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            assert left > 0, "chromium did not answer in time"
            ready, _, _ = select.select([self._from_child], [], [], left)
            if ready:
                chunk = os.read(self._from_child, 1 << 16)
                assert chunk, f"chromium closed the DevTools pipe (exit {self.process.poll()})"
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, session: bool = True) -> dict:
        """Send a command and wait for its answer; events that arrive meanwhile are kept."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") == self._next_id:
                assert "error" not in answer, f"{method}: {answer['error']}"
                return answer.get("result", {})
            self.events.append(answer)

    def wait_for(self, method: str) -> dict:
        """The first event named ``method`` (already received or coming)."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            self.events.append(self._read_message(deadline))

    def open(self, url: str) -> None:
        """A new page, attached, with the domains that report problems enabled, loaded with ``url``."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True},
                             session=False)
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.events.clear()
        self.send("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression in the page (DevTools evaluation, not the page's CSP)."""
        answer = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        assert "exceptionDetails" not in answer, answer["exceptionDetails"]
        return answer["result"].get("value")

    def resize(self, width: int, height: int) -> None:
        """Lay the page out for a viewport of ``width`` x ``height`` CSS pixels."""
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})

    def problems(self) -> list[str]:
        """Console errors, exceptions, error log entries, failed loads and non-file requests seen so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(f"console.{params['type']}: {params.get('args')}")
            elif method == "Runtime.exceptionThrown":
                found.append(f"exception: {params.get('exceptionDetails')}")
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append(f"log: {params['entry'].get('text')} ({params['entry'].get('url')})")
            elif method == "Network.loadingFailed":
                found.append(f"load failed: {params.get('errorText')} ({params.get('requestId')})")
            elif method == "Network.requestWillBeSent":
                url = params.get("request", {}).get("url", "")
                if not url.startswith(("file://", "data:")):
                    found.append(f"request off the local files: {url}")
        return found

    def close(self) -> None:
        """Stop this browser (its own process group, started by this test)."""
        try:
            self.send("Browser.close", session=False)
            self.process.wait(timeout=10)
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, 9)
            self.process.wait(timeout=10)
        finally:
            os.close(self._to_child)
            os.close(self._from_child)


@pytest.fixture
def browser(tmp_path):
    chromium = Chromium(tmp_path / "profile")
    try:
        yield chromium
    finally:
        chromium.close()


def page_facts(browser: Chromium) -> dict:
    return browser.evaluate("""({
        sections: [...document.querySelectorAll('section[id]')].map(s => s.id),
        images: [...document.images].map(i => ({src: i.getAttribute('src'), width: i.naturalWidth,
                                                complete: i.complete})),
        missing: [...document.querySelectorAll('.missing')].map(m => m.closest('section').id + ': ' + m.textContent),
        scripts: document.scripts.length,
        pwned: window.__pwned === true,
        text: document.body.innerText,
    })""")


def test_full_report_renders_without_errors_with_every_figure(tmp_path, browser, capsys):
    out = make_run(tmp_path / "run", hostile=True)
    assert cli_main(["report", "--output-dir", str(out), "--settings-json", str(out / "settings.json")]) == 0
    index = out / "report" / "index.html"
    browser.open(index.as_uri())
    facts = page_facts(browser)
    assert browser.problems() == []
    assert facts["sections"] == SECTIONS
    names = sorted(Path(i["src"]).name for i in facts["images"])
    assert names == ["acc_per_position.png", "acceptance_length.png", "acceptance_measured_vs_simulated.png",
                     "loss.png"]
    assert all(i["complete"] and i["width"] > 0 for i in facts["images"]), facts["images"]
    assert facts["missing"] == []
    # The hostile strings in the inputs arrive as text: no script element, nothing ran.
    assert facts["scripts"] == 0 and not facts["pwned"]
    assert "<script>window.__pwned = true</script>" in facts["text"]
    assert "measured acceptance length tau" in facts["text"]


def test_report_without_training_or_evaluation_renders_and_says_not_measured(tmp_path, browser):
    out = make_run(tmp_path / "run", training=False, evaluation=False)
    assert cli_main(["report", "--output-dir", str(out)]) == 0
    browser.open((out / "report" / "index.html").as_uri())
    facts = page_facts(browser)
    assert browser.problems() == []
    assert facts["sections"] == SECTIONS
    assert facts["images"] == []
    missing = "\n".join(facts["missing"])
    assert "training: Not measured" in missing
    assert "acceptance: Not measured" in missing and "evaluation.json does not exist" in missing
    assert "settings: Settings not given" in missing


def test_demo_report_renders_when_the_demo_has_run(tmp_path, browser):
    demo = ROOT / "output" / "demo"
    if not (demo / "data" / "data_config.json").is_file():
        pytest.skip("output/demo has no extraction yet (make demo writes it)")
    report_dir = tmp_path / "out"
    assert cli_main(["report", "--output-dir", str(report_dir), "--gpu-reset-dir", str(demo / "gpu_reset"),
                     "--data-dir", str(demo / "data"), "--training-dir", str(demo / "drafter-run"),
                     "--evaluation-dir", str(demo / "evaluation")]) == 0
    browser.open((report_dir / "report" / "index.html").as_uri())
    facts = page_facts(browser)
    assert browser.problems() == []
    assert facts["sections"] == SECTIONS
    assert all(i["width"] > 0 for i in facts["images"]), facts["images"]


def test_verdict_heads_the_first_screen_and_settings_are_folded_with_names_on_one_line(tmp_path, browser):
    out = make_run(tmp_path / "run")
    settings = json.loads((out / "settings.json").read_text())
    # A long name beside a long value: the table has to wrap one of them on a narrow window.
    long_name = "eagle_training_a_long_variable_name_that_must_stay_whole"
    settings[long_name] = [f"/data/shards/part-{i:04d}/hidden-states" for i in range(30)]
    (out / "settings.json").write_text(json.dumps(settings))
    assert cli_main(["report", "--output-dir", str(out), "--settings-json", str(out / "settings.json")]) == 0
    browser.open((out / "report" / "index.html").as_uri())
    assert browser.problems() == []
    browser.resize(*LAPTOP)
    top = browser.evaluate("""(() => {
        const headline = document.getElementById('headline');
        const box = headline.getBoundingClientRect();
        const hit = document.elementFromPoint(box.left + 8, box.top + box.height / 2);
        const details = document.querySelector('#settings details');
        return {first: document.querySelector('main > section').id, top: box.top, bottom: box.bottom,
                height: window.innerHeight, shown: headline.contains(hit), text: headline.innerText,
                open: details.open, tableShown: details.querySelector('table').checkVisibility(),
                last: [...document.querySelectorAll('main > section')].pop().id};
    })()""")
    assert top["first"] == "verdict" and top["last"] == "settings"
    assert 0 <= top["top"] and top["bottom"] <= top["height"], top
    assert top["shown"] and top["text"].startswith("PASSED"), top
    assert top["open"] is False and top["tableShown"] is False, "the settings must be folded when the page opens"

    browser.resize(*NARROW)
    layout = browser.evaluate("""(() => {
        const details = document.querySelector('#settings details');
        details.open = true;
        const rows = [...details.querySelectorAll('tbody tr')].map(row => {
            const [name, value] = row.querySelectorAll('td');
            const code = name.querySelector('code');
            return {name: code.textContent, lines: code.getClientRects().length,
                    fits: code.getBoundingClientRect().right <= name.getBoundingClientRect().right + 0.5,
                    valueLines: value.querySelector('code').getClientRects().length};
        });
        return {rows};
    })()""")
    rows = {row["name"]: row for row in layout["rows"]}
    assert long_name in rows
    assert rows[long_name]["valueLines"] > 1, "the long value should wrap on a narrow window (no layout pressure?)"
    broken = [row for row in layout["rows"] if row["lines"] != 1 or not row["fits"]]
    assert broken == [], f"variable names broken across lines or overflowing their cell: {broken}"
