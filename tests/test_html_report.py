"""``tracedump diff --html``: the page is opened in headless Chromium and checked as a person sees it.

Chromium is driven over the DevTools protocol on ``--remote-debugging-pipe`` (file descriptors 3
and 4, NUL-separated JSON): a small stdlib client below, no browser download, works with Debian's
``chromium`` offline. One browser serves the whole file; each test opens its own tab. Without
Chromium the browser tests skip with the reason (``.ci/run`` installs it, so they run in CI); the
tests of the page's text (self-contained, escaped, bounded, imported only with ``--html``) always run.

The dumps are real: a tiny HF Llama (random weights) through ``attach()``, two passes, one weight
perturbed in layer 1; a ``.pt`` pass file whose tensor names are hostile HTML.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_llama

import tracedump
from tracedump.cli import main
from tracedump.compare import compare
from tracedump.compare.judge.reason import RULES
from tracedump.compare.report.page import charts, limits, render
from tracedump.compare.report.page.limits import MAX_LINES, esc
from tracedump.compare.report.page.rows import Row

PROMPTS = [torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 2, 11]]), torch.tensor([[8, 9, 7, 9, 3, 4]])]
PERTURBED = "model.layers.1.mlp.up_proj"
HOSTILE = '</script><script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">\x1b[31m\u202eevil'


# ----------------------------------------------------------------------------- dumps and reports


def _dump(model: torch.nn.Module, out: Path) -> Path:
    dumper = tracedump.attach(model, {"dir": str(out), "modules": "all"})
    assert dumper is not None
    with torch.no_grad():
        for ids in PROMPTS:
            model(ids)
    dumper.close()
    return out


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("html")
    reference = make_tiny_llama(layers=3)
    port = make_tiny_llama(layers=3)
    weight = dict(port.named_parameters())[f"{PERTURBED}.weight"]
    with torch.no_grad():
        weight.mul_(1 + 1e-3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)))
    out = {"a": _dump(port, base / "a"), "b": _dump(reference, base / "b")}
    # Hostile names in a .pt pass file: the first one diverges, so the summary must show it.
    values = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(2))
    torch.save({HOSTILE: values * 1.01, "plain": values}, base / "hostile_a.pt")
    torch.save({HOSTILE: values, "plain": values}, base / "hostile_b.pt")
    out["hostile_a"], out["hostile_b"] = base / "hostile_a.pt", base / "hostile_b.pt"
    return out


def _cli_html(tmp_path: Path, *args: str | Path, name: str = "report.html") -> tuple[int, Path]:
    page = tmp_path / name
    code = main(["diff", *map(str, args), "--html", str(page), "--no-progress"])
    assert page.is_file()
    return code, page


@pytest.fixture(scope="module")
def report_page(dumps: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    page = tmp_path_factory.mktemp("page") / "report.html"
    assert main(["diff", str(dumps["a"]), str(dumps["b"]), "--html", str(page), "--no-progress"]) == 1
    return page


# ----------------------------------------------------------------------------- a DevTools client


def _chromium() -> str | None:
    for name in (os.environ.get("TRACEDUMP_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class Browser:
    """Headless Chromium over ``--remote-debugging-pipe``: commands out on fd 3, replies on fd 4."""

    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="tracedump-chromium-")
        theirs_in, self._out = os.pipe()
        self._in, theirs_out = os.pipe()

        def on_fds_3_and_4() -> None:  # in the child, before exec
            read, write = os.dup(theirs_in), os.dup(theirs_out)
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.process = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",  # root in a container
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--remote-debugging-pipe",
                f"--user-data-dir={self.profile}",
                "--window-size=1280,900",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=on_fds_3_and_4,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(theirs_in)
        os.close(theirs_out)
        self._buffer = b""
        self._next = 0
        self.events: list[dict[str, Any]] = []

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout=30)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, session: str, timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method and event.get("sessionId") == session:
                    self.events.remove(event)
                    return event
            self.events.append(self._read(timeout=max(deadline - time.monotonic(), 0.01)))

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, path: Path) -> Tab:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        tab = Tab(self, target, session)
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.send(f"{domain}.enable", session=session)
        self.send("Page.navigate", {"url": path.resolve().as_uri()}, session)
        self.wait_event("Page.loadEventFired", session)
        return tab

    def close(self) -> None:
        try:
            self.send("Browser.close")
            self.process.wait(timeout=10)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait(timeout=10)
        finally:
            os.close(self._in)
            os.close(self._out)
            shutil.rmtree(self.profile, ignore_errors=True)


class Tab:
    """One page: evaluate JavaScript, click and type as a person would."""

    def __init__(self, browser: Browser, target: str, session: str) -> None:
        self.browser, self.target, self.session = browser, target, session

    def js(self, expression: str) -> Any:
        result = self.browser.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            self.session,
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click at the element's centre (scrolled into view first)."""
        box = self.js(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.browser.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
                self.session,
            )

    def choose(self, selector: str, value: str) -> None:
        """Pick an option of a ``<select>`` (what the keyboard would do, and the change event)."""
        self.js(
            f"(() => {{ const s = document.querySelector({json.dumps(selector)});"
            f" s.value = {json.dumps(value)}; s.dispatchEvent(new Event('change')); }})()"
        )

    def type(self, selector: str, text: str) -> None:
        self.click(selector)
        self.browser.send("Input.insertText", {"text": text}, self.session)

    def problems(self) -> list[str]:
        """Script errors, console errors (a CSP violation is one) and requests for anything but the page."""
        found = []
        for event in self.browser.events:
            if event.get("sessionId") != self.session:
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"exception: {params['exceptionDetails']}")
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(f"log: {params['entry']['text']}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(f"console: {params['args']}")
            elif method == "Network.requestWillBeSent":
                url = params["request"]["url"]
                if not url.startswith(("file://", "data:")):
                    found.append(f"request: {url}")
        return found

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    binary = _chromium()
    if binary is None:
        pytest.skip("headless Chromium not found: apt-get install chromium (.ci/run installs it)")
    chromium = Browser(binary)
    try:
        chromium.send("Browser.getVersion")
        yield chromium
    finally:
        chromium.close()


@pytest.fixture
def tab(browser: Browser, report_page: Path) -> Iterator[Tab]:
    page = browser.open(report_page)
    yield page
    assert page.problems() == []
    page.close()


# ----------------------------------------------------------------------------- in the browser


def test_summary_names_the_first_divergence(tab: Tab) -> None:
    summary = tab.js("document.getElementById('summary').innerText")
    assert "exit 1" in summary and "diverged" in summary
    first = tab.js("document.getElementById('first-divergence').innerText")
    assert first.startswith(f"First divergence: {PERTURBED}, pass 0")
    assert re.search(r"rel_diff \S+ > threshold \S+", summary)  # why, with the verdict's numbers
    assert "worst token\nposition" in summary
    # the link goes to that tensor's row, and the row says it is the first divergence
    href = tab.js("document.querySelector('#first-divergence a').getAttribute('href')")
    row = tab.js(f"document.querySelector({json.dumps(href)}).innerText")
    assert PERTURBED in row and "first divergence" in row


def test_the_curve_draws_a_line_per_pass_with_thresholds_and_names(tab: Tab) -> None:
    lines = tab.js(
        "[...document.querySelectorAll('#curve .line')].map(g => ["
        " g.querySelector('polyline.error').getAttribute('points').split(' ').length,"
        " g.querySelector('polyline.threshold').getBBox().width,"
        " g.getBBox().width, g.getBBox().height])"
    )
    assert len(lines) == 2  # two passes
    for points, threshold_width, width, height in lines:
        assert points > 10 and threshold_width > 500 and width > 500 and height > 50
    titles = tab.js("[...document.querySelectorAll('#curve circle.pt title')].map(t => t.textContent)")
    assert any(t.startswith(f"{PERTURBED}\npass 0") for t in titles)
    assert any("model.layers.0.self_attn" in t for t in titles)
    marker = tab.js("document.querySelector('#marker-first text').textContent")
    assert marker == f"first divergence: {PERTURBED} (pass 0)"
    assert tab.js("document.querySelector('#legend').innerText").split("\n") == ["pass 0", "pass 1"]
    tab.click("#legend .swatch[data-unit='1']")  # hides pass 1
    assert (
        tab.js("getComputedStyle(document.querySelector(\"#curve .line[data-unit='1']\")).display") == "none"
    )


def test_the_heatmap_renders_cells_and_links_rows_to_the_table(tab: Tab) -> None:
    # the cells are a PNG: decoded and drawn to a canvas, it must hold many colours
    colours = tab.js(
        """(async () => {
        const image = document.querySelector('#heatmap image.cells');
        const element = new Image(); element.src = image.getAttribute('href'); await element.decode();
        const canvas = document.createElement('canvas');
        canvas.width = element.naturalWidth; canvas.height = element.naturalHeight;
        const context = canvas.getContext('2d'); context.drawImage(element, 0, 0);
        const data = context.getImageData(0, 0, canvas.width, canvas.height).data;
        const seen = new Set();
        for (let i = 0; i < data.length; i += 4) seen.add(data.slice(i, i + 4).join());
        const box = image.getBBox();
        return [canvas.width, canvas.height, seen.size, box.width, box.height];
        })()"""
    )
    width, height, distinct, box_w, box_h = colours
    assert width == 10 and height > 20  # 10 token positions (the longer prompt), a row per tensor
    assert distinct > 20 and box_w > 100 and box_h > 100
    rows = tab.js("document.querySelectorAll('#heatmap rect.hrow').length")
    assert rows == height
    # hovering a cell names the tensor and the position
    tab.js(
        "(() => { const r = document.querySelector('#heatmap rect.hrow.first').getBoundingClientRect();"
        " document.getElementById('heatmap').dispatchEvent(new MouseEvent('mousemove',"
        " {clientX: r.x + r.width * 0.95, clientY: r.y + r.height / 2, bubbles: true})); })()"
    )
    tip = tab.js("document.getElementById('heat-tip').textContent")
    assert tip.startswith(f"{PERTURBED} (pass 0)\nposition 9: rel_diff ≈ ")
    tab.click("#heatmap rect.hrow.first")
    assert tab.js("location.hash") == "#" + tab.js("document.querySelector('#tensors tr.first').id")


ROWS = "[...document.querySelectorAll('#tensors tbody tr')]"
VISIBLE = ROWS + ".filter(r => !r.hidden)"


def test_the_table_sorts_and_filters(tab: Tab) -> None:
    total = tab.js(f"{ROWS}.length")
    assert total > 40
    tab.click("#tensors th[data-col='6'] button")  # rel_diff, ascending
    tab.click("#tensors th[data-col='6'] button")  # descending
    values = tab.js(f"{ROWS}.map(r => parseFloat(r.cells[6].dataset.v))")
    assert values == sorted(values, reverse=True) and values[0] > 0
    tab.click("#tensors th[data-col='0'] button")  # back to execution order
    assert tab.js(f"{ROWS}.map(r => +r.cells[0].innerText)") == list(range(total))
    tab.type("#f-name", "layers.2.mlp")
    names = tab.js(f"{VISIBLE}.map(r => r.cells[2].innerText.split('\\n')[0])")
    assert names and all("layers.2.mlp" in n for n in names)
    assert tab.js("document.getElementById('f-count').innerText") == f"{len(names)} of {total} rows"
    tab.js(
        "(() => { const e = document.getElementById('f-name'); e.value = '';"
        " e.dispatchEvent(new Event('input')); })()"
    )
    tab.choose("#f-unit", "1")
    assert set(tab.js(f"{VISIBLE}.map(r => r.cells[1].innerText)")) == {"pass 1"}
    tab.choose("#f-status", "ok")
    assert set(tab.js(f"{VISIBLE}.map(r => r.dataset.status)")) == {"ok"}
    tab.choose("#f-status", "!ok")
    assert set(tab.js(f"{VISIBLE}.map(r => r.dataset.status)")) == {"diverged"}


def test_a_hostile_name_is_shown_as_text(browser: Browser, dumps: dict[str, Path], tmp_path: Path) -> None:
    code, page = _cli_html(tmp_path, dumps["hostile_a"], dumps["hostile_b"])
    assert code == 1
    tab = browser.open(page)
    try:
        assert tab.js("window.__pwned === undefined")
        assert tab.js("document.querySelectorAll('img').length") == 0  # the name's <img> is text
        assert tab.js("document.querySelectorAll('script').length") == 2  # the page's: code, heatmap data
        shown = HOSTILE.replace("\x1b", "\\x1b").replace("\u202e", "\\u202e")
        assert tab.js("document.querySelector('#first-divergence code').textContent") == shown
        assert shown in tab.js("document.querySelector('#tensors tbody tr').innerText")
        assert tab.js("document.querySelector('#marker-first text').textContent").startswith(
            f"first divergence: {shown[:80]}"  # long names are cut in the chart
        )
        assert tab.problems() == []
    finally:
        tab.close()


def test_a_report_of_sequences_draws_a_line_per_sequence(
    browser: Browser, dumps: dict[str, Path], tmp_path: Path
) -> None:
    code, page = _cli_html(tmp_path, dumps["a"], dumps["b"], "--align", "tokens")
    assert code == 1
    tab = browser.open(page)
    try:
        # an HF model's sequences are its batch rows (dump/hf_layout.py)
        assert tab.js("document.querySelector('#legend').innerText").split("\n") == ["seq 0", "seq 1"]
        first = tab.js("document.getElementById('first-divergence').innerText")
        assert re.match(rf"First divergence: {re.escape(PERTURBED)}, seq 0, position \d+, step 0\.", first)
        assert tab.js("document.querySelector('#tensors thead').innerText").split("\t")[1] == "sequence"
        assert tab.problems() == []
    finally:
        tab.close()


# ----------------------------------------------------------------------------- the page's text


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_the_page_is_self_contained(report_page: Path) -> None:
    text = report_page.read_text()
    parser = _Collect()
    parser.feed(text)
    for tag, attrs in parser.tags:
        for key in ("src", "href", "xlink:href", "action", "data"):
            value = attrs.get(key)
            assert value is None or value.startswith(("#", "data:image/png;base64,")), (tag, key, value)
        assert tag not in ("link", "iframe", "object", "embed", "img")
    policy = next(a["content"] for t, a in parser.tags if t == "meta" and a.get("http-equiv"))
    assert policy.startswith("default-src 'none'; img-src data:;") and "unsafe" not in policy
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text


def test_every_section_is_in_the_page_in_order(report_page: Path) -> None:
    text = report_page.read_text()
    order = [
        text.index(f"id='{ident}'") for ident in ("summary", "curve", "heatmap", "tensors", "notes-section")
    ]
    assert order == sorted(order)
    assert "Run A: <code>" in text and "torch_version" in text and "tracedump_version" in text


def test_strings_are_escaped_and_control_characters_shown() -> None:
    assert esc('<b a="1">&') == "&lt;b a=&quot;1&quot;&gt;&amp;"
    assert esc("a\x00b\x1b\u202e\u2028c\td") == "a\\x00b\\x1b\\u202e\\u2028c\td"
    assert esc("\udcff") == "\\udcff"  # a lone surrogate (a name from bytes) cannot break the file


def test_the_heatmap_png_has_a_pixel_per_cell_in_its_level_s_colour() -> None:
    """No data transparent, exact zero grey, NaN/Inf red, then viridis from small to large."""
    import io

    from matplotlib.image import imread

    first = charts.FIRST_LEVEL
    levels = bytes([charts.NO_DATA, charts.ZERO, charts.NON_FINITE, first, first + 100, 255])
    data = charts.png(levels, 3, 2)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = (imread(io.BytesIO(data)) * 255).round().astype(int)
    assert pixels.shape == (2, 3, 4)
    assert pixels[0, 0, 3] == 0  # no data: transparent
    assert pixels[0, 1].tolist() == [236, 236, 236, 255] and pixels[0, 2].tolist() == [214, 39, 40, 255]
    assert pixels[1, 0].tolist() == [68, 1, 84, 255] and pixels[1, 2].tolist() == [253, 231, 37, 255]
    assert pixels[1, 1].tolist() not in (pixels[1, 0].tolist(), pixels[1, 2].tolist())


def test_without_matplotlib_the_page_leaves_the_heatmap_out_and_says_so(
    dumps: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    report = compare(dumps["hostile_a"], dumps["hostile_b"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.image", None)
    text = render(report)
    assert "<svg id='heatmap'" not in text and "id='heat-data'" not in text
    assert "The heatmap needs matplotlib" in text
    bounds = text.split("id='bounds'")[1].split("</div>")[0]
    assert "heatmap: left out, matplotlib is not installed" in bounds
    assert "id='curve'" in text and "<tr id='t-0'" in text  # the rest of the page is there


def test_a_pairing_and_a_reason_on_the_records_are_shown(dumps: dict[str, Path]) -> None:
    """Records that say how their pair was made get a ``paired by`` column (after the status, so
    the columns before it keep their places); the judge's reason record is shown, escaped, in the
    summary's why of the first divergence and in its point on the curve."""
    report = compare(dumps["hostile_a"], dumps["hostile_b"])
    doc = report.to_json()
    first = doc["summary"]["first_divergence"]["index"]
    for record in doc["tensors"]:
        record["paired_by"] = "name" if record["index"] != first else "<rule> q|k"
    assert doc["tensors"][first]["reason"]["rule"] in RULES  # the judge wrote one
    doc["tensors"][first]["reason"] = {
        "rule": "local",
        "decided_by": "<decided>",
        "text": "error above the threshold",
        "threshold_from": "<local>",
    }
    text = render(report, doc)
    head = text.split("<thead>")[1].split("</thead>")[0]
    titles = re.findall(r"<button type='button'>([^<]*)</button>", head)
    assert titles[6] == "rel_diff" and titles[-3:] == ["status", "paired by", "details"]
    row = text.split(f"<tr id='t-{first}'")[1].split("</tr>")[0]
    assert "&lt;rule&gt; q|k" in row and "<rule>" not in row
    point = text.split(f"<a href='#t-{first}'><circle")[1].split("</circle>")[0]
    assert "error above the threshold" in point  # the curve's point says the reason's words
    why = text.split("<dl class='why'>")[1].split("</dl>")[0]
    assert "<dt>why</dt><dd>error above the threshold</dd>" in why
    assert "<dt>threshold from</dt><dd>&lt;local&gt;</dd>" in why
    assert "<dt>decided by</dt><dd>&lt;decided&gt;</dd>" in why
    assert "<dt>paired by</dt>" in why
    assert "<dt>paired by</dt><dd>name</dd>" in render(report)  # every pair says how it was paired
    bare = report.to_json()
    for record in bare["tensors"]:
        record.pop("paired_by", None)
    assert "paired by" not in render(report, bare)  # records without it: no column


def test_html_works_with_baseline_and_unshard(dumps: dict[str, Path], tmp_path: Path) -> None:
    code, page = _cli_html(tmp_path, dumps["a"], dumps["b"], "--baseline", dumps["b"], "--unshard", "x=sum")
    assert code == 1
    text = page.read_text()
    assert "× noise" in text  # the baseline's column
    assert "--unshard had no effect" in text  # the note the terminal prints


def test_a_big_diff_gives_a_bounded_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More tensors and token positions than the page draws (the bounds made small, so the diff is
    too): each part keeps what matters and the page says what it left out."""
    for name, value in (
        ("MAX_TABLE_ROWS", 200),
        ("HEATMAP_ROWS", 50),
        ("HEATMAP_COLS", 16),
        ("MAX_POINTS", 100),
    ):
        monkeypatch.setattr(limits, name, value)
    tensors = {
        f"layer{i}.out": torch.randn(1, 40, 2, generator=torch.Generator().manual_seed(i)) for i in range(600)
    }
    torch.save(tensors, tmp_path / "b.pt")
    torch.save(
        {k: v * (1.01 if i >= 500 else 1.0) for i, (k, v) in enumerate(tensors.items())}, tmp_path / "a.pt"
    )
    report = compare(tmp_path / "a.pt", tmp_path / "b.pt")
    assert report.first_divergence is not None and report.first_divergence.index == 500
    text = render(report)
    bounds = text.split("id='bounds'")[1].split("</div>")[0]
    assert "table: 200 of 600 tensors" in bounds
    assert "heatmap: 50 of 600 tensors shown" in bounds
    assert "heatmap: 40 token positions in 14 columns of 3" in bounds
    assert re.search(r"curve: 1\d\d of 600 points drawn", bounds)
    assert text.count("<tr id='t-") == 200 and "<tr id='t-500' class='s-diverged first'" in text
    assert text.count("<rect class='hrow") == 50 and "class='hrow first'" in text
    assert text.count("<circle class='pt") < 200 and "#t-500'><circle" in text
    assert len(text) < 210_000  # a tenth of it the cells' PNG and the table (each row: how it was paired)


def test_many_passes_are_drawn_as_at_most_max_lines(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    for side in ("a", "b"):
        dumper = tracedump.attach(model, {"dir": str(tmp_path / side)})
        with torch.no_grad():
            for step in range(MAX_LINES + 6):
                model(torch.full((1, 3, 4), float(step)) + (0.5 if side == "a" and step == 20 else 0))
        dumper.close()
    report = compare(tmp_path / "a", tmp_path / "b")
    text = render(report)
    assert f"curve: {MAX_LINES} of {MAX_LINES + 6} passes drawn" in text
    assert text.count("<g class='line'") == MAX_LINES
    legend = re.findall(r"data-unit='(\d+)'", text.split("id='legend'")[1].split("</div>")[0])
    assert "20" in legend and legend[0] == "0" and legend[-1] == str(MAX_LINES + 5)  # failing, first, last


def test_only_diff_with_html_imports_the_page_module(dumps: dict[str, Path], tmp_path: Path) -> None:
    probe = (
        "import sys, tracedump; from tracedump.cli import main\n"
        "assert 'tracedump.compare.report.page' not in sys.modules, 'import tracedump'\n"
        "assert 'jinja2' not in sys.modules, 'import tracedump imports jinja2'\n"
        "code = main(sys.argv[1:])\n"
        "print('IMPORTED' if 'tracedump.compare.report.page' in sys.modules else 'NOT IMPORTED', code)\n"
    )
    args = [str(dumps["a"]), str(dumps["b"]), "--pass", "0"]
    plain = subprocess.run(
        [sys.executable, "-c", probe, "diff", *args], capture_output=True, text=True, timeout=120
    )
    assert plain.stdout.strip().endswith("NOT IMPORTED 1"), plain.stderr[-2000:]
    page = tmp_path / "sub" / "r.html"
    with_html = subprocess.run(
        [sys.executable, "-c", probe, "diff", *args, "--html", str(page)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert with_html.stdout.strip().endswith("IMPORTED 1") and page.is_file(), with_html.stderr[-2000:]
    assert f"html report: {page}" in with_html.stdout


def test_html_to_a_directory_is_a_usage_error(
    dumps: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diff", str(dumps["a"]), str(dumps["b"]), "--html", str(tmp_path)]) == 2
    assert "--html" in capsys.readouterr().err


def test_html_into_a_fifo_or_through_a_link_replaces_neither(dumps: dict[str, Path], tmp_path: Path) -> None:
    """A rename over the target would replace a FIFO, a device (``/dev/stdout``, ``/dev/null``: as
    root, the device node itself) or a symlink with a plain file: they are written into instead."""
    import threading

    fifo = tmp_path / "pipe.html"
    os.mkfifo(fifo, 0o600)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()  # blocks in open() until the report opens the FIFO for writing
    code = main(["diff", str(dumps["hostile_a"]), str(dumps["hostile_b"]), "--html", str(fifo)])
    # The reader may still be on its way out of read_bytes() when main() returns (it has closed the
    # FIFO, so a writer's open would now fail with ENXIO): wait for it first. Alive after that, it
    # is still blocked in open(): the report never opened the FIFO; unblock it before failing.
    reader.join(10)
    if reader.is_alive():
        with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "w"):
            pass
        reader.join(10)
    assert code == 1 and fifo.is_fifo()
    assert got and got[0].startswith(b"<!DOCTYPE html>") and got[0].rstrip().endswith(b"</html>")
    target = tmp_path / "reports" / "real.html"
    target.parent.mkdir()
    link = tmp_path / "link.html"
    link.symlink_to(target)
    assert main(["diff", str(dumps["hostile_a"]), str(dumps["hostile_b"]), "--html", str(link)]) == 1
    assert link.is_symlink() and target.read_text().startswith("<!DOCTYPE html>")


def test_a_nan_only_divergence_says_nan_on_the_page(tmp_path: Path) -> None:
    """As the terminal says it: not "rel_diff 0 > threshold", which is false."""
    values = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    with_nan = values.clone()
    with_nan[0, 1] = float("nan")
    torch.save({"t": with_nan}, tmp_path / "a.pt")
    torch.save({"t": values}, tmp_path / "b.pt")
    code, page = _cli_html(tmp_path, tmp_path / "a.pt", tmp_path / "b.pt")
    assert code == 1
    text = page.read_text()
    assert "NaN/Inf only: rel_diff of the finite values 0 &lt;= threshold" in text
    assert "rel_diff 0 &gt; threshold" not in text


def test_the_sides_carry_their_manifests_without_module_lists(dumps: dict[str, Path]) -> None:
    sides = compare(dumps["a"], dumps["b"], passes="0").to_json()["sides"]
    for side in sides.values():
        (root,) = side["roots"].values()
        manifest = root["manifest"]
        assert manifest["tracedump_version"] == tracedump.__version__
        assert manifest["torch_version"] == torch.__version__
        assert manifest["model_class"].endswith("LlamaForCausalLM")
        assert manifest["settings"]["modules"] == "all"
        assert "modules" not in manifest and "passes" not in manifest


def test_fields_a_later_option_adds_reach_the_page(dumps: dict[str, Path]) -> None:
    """The page is built from the JSON document: a record's or the summary's field that it does not
    know (a bridge's, a graft's) is shown, escaped, not dropped."""
    report = compare(dumps["hostile_a"], dumps["hostile_b"])
    doc = report.to_json()
    doc["tensors"][1]["bridge"] = {"rule": "<b>qkv</b>", "from": ["q", "k", "v"]}
    doc["summary"]["bridged"] = ["plain <i>"]
    text = render(report, doc)
    row = text.split("<tr id='t-1'")[1].split("</tr>")[0]
    assert "bridge: {&#34;rule&#34;: &#34;&lt;b&gt;qkv&lt;/b&gt;&#34;" in row
    assert "<code>bridge</code> on 1 tensors" in text
    assert "<code>bridged</code>: <code>plain &lt;i&gt;</code>" in text


def test_heatmap_columns_bin_positions_by_their_largest_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "HEATMAP_COLS", 4)
    rows = [
        Row({"index": 0, "per_token": {"rel_diff": [1e-3, 2e-3, 0.0, "nan", 5e-4, 1e-4, 0.0]}}, 0, 0),
        Row({"index": 1, "per_token": {"rel_diff": [3e-3, 1e-5], "positions": [100, 101]}}, 0, 1),
    ]
    grid, width, binned = charts.cells(rows)
    assert (width, binned) == (102, 26) and len(grid[0]) == len(grid[1]) == 4
    assert grid[0][0] is not None and math.isnan(grid[0][0])  # a NaN among the first 26 positions wins
    assert grid[0][1:] == [None, None, None] and grid[1] == [None, None, None, 3e-3]
