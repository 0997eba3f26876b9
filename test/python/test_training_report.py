"""The training report (megaslide-report, docs/Training.md "Training report")
rendered by a real browser: headless Chromium opens the page, its
screenshot must be a PNG of the window's size that shows the curves in
their colours, and the DOM Chromium parsed must hold each plot's polyline
with one point per step that has the value.

The PNG is decoded here (zlib and the PNG filter rules, numpy for the
pixels), so the test needs nothing beyond scripts/requirements-test.txt.
Without Chromium (scripts/install-deps.sh installs it) the tests skip,
unless MEGASLIDE_REQUIRE_CHROMIUM=1 (scripts/test.sh sets it, so CI runs
them): then they fail.
"""

import html.parser
import json
import math
import os
import pathlib
import random
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest

from conftest import tool_path

WIDTH, HEIGHT = 1200, 2000
STEPS = 150
SKIPPED = 61
MAX_GRAD_NORM = 1.0
# Series colours of runtime/train/TrainingReport.cpp.
LOSS_COLOR = (0x4E, 0x79, 0xA7)
LR_COLOR = (0x59, 0xA1, 0x4F)
GRAD_COLOR = (0xB0, 0x7A, 0xA1)
PROBLEM_COLOR = (0xE1, 0x57, 0x59)


def chromium() -> str:
    for name in (os.environ.get("MEGASLIDE_CHROMIUM"), "chromium",
                 "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    message = ("chromium is not installed (scripts/install-deps.sh installs "
               "it; set MEGASLIDE_CHROMIUM to use another build)")
    if os.environ.get("MEGASLIDE_REQUIRE_CHROMIUM") == "1":
        pytest.fail(message)
    pytest.skip(message)


def run_chromium(tmp_path: pathlib.Path, *args: str) -> str:
    """Headless Chromium with a profile of its own; its stdout."""
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
               f"--user-data-dir={tmp_path / 'profile'}",
               "--no-first-run", "--disable-extensions", *args]
    r = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{command} exited {r.returncode}:\n{r.stderr}"
    return r.stdout


def realistic_metrics() -> list:
    """A warmup-cosine run whose loss falls and then flattens with noise,
    with validation every 25 steps, clipped steps while the gradient norm
    is high, and one skipped step."""
    rng = random.Random(15)
    lines = []
    for step in range(1, STEPS + 1):
        warmup = min(1.0, step / 15)
        lr = 1e-4 * warmup * 0.5 * (1 + math.cos(math.pi * step / STEPS))
        loss = 0.12 + 0.9 * math.exp(-step / 20) + 0.03 * rng.random()
        grad = 0.5 + 2.5 * math.exp(-step / 25) + 0.4 * rng.random()
        seconds = 0.8 + 0.05 * rng.random() + (1.5 if step == 1 else 0)
        line = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad,
                "clipped": grad > MAX_GRAD_NORM, "skipped": False,
                "micro_batches": 2, "seconds": seconds,
                "samples_per_second": 2 / seconds,
                "tokens_per_second": 480 * 2 / seconds,
                "host_rss_bytes": int(2.1e9 + 1e6 * step),
                "device_peak_bytes": int(4.5e9)}
        if step == SKIPPED:
            line.update(loss=None, grad_norm=None, clipped=False,
                        skipped=True)
        if step % 25 == 0:
            line["val_loss"] = loss * 1.04
        lines.append(line)
    return lines


def expected_points(lines: list) -> dict:
    """(plot, series) -> the points its polyline must have."""
    def count(field):
        return sum(1 for l in lines if l.get(field) is not None)
    return {("loss", "loss"): count("loss"),
            ("loss", "val_loss"): count("val_loss"),
            ("lr", "lr"): count("lr"),
            ("grad_norm", "grad_norm"): count("grad_norm"),
            ("seconds", "seconds"): count("seconds"),
            ("throughput", "samples_per_second"): count("samples_per_second"),
            ("memory", "host_rss_bytes"): count("host_rss_bytes"),
            ("memory", "device_peak_bytes"): count("device_peak_bytes")}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple:
    """The metrics, and the page megaslide-report made of them."""
    tmp = tmp_path_factory.mktemp("report")
    lines = realistic_metrics()
    metrics = tmp / "run.jsonl"
    metrics.write_text("".join(json.dumps(l) + "\n" for l in lines))
    page = tmp / "run.html"
    r = subprocess.run([tool_path("megaslide-report"), os.fspath(metrics),
                        "-o", os.fspath(page), "--title", "tiny, 150 steps",
                        "--setting", f"max_grad_norm={MAX_GRAD_NORM}",
                        "--setting", "lr=1e-4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return lines, page


# --- PNG ---------------------------------------------------------------------

def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB or RGBA PNG (what Chromium writes) as a height x width x
    channels array; an AssertionError for anything else or a broken file."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, header, idat = 8, None, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        crc, = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    assert header, "no IHDR chunk"
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    assert len(raw) == height * (stride + 1), "IDAT size does not match IHDR"

    # Undo each row's filter (PNG spec, section 9).
    out = np.zeros((height, stride), dtype=np.uint8)
    prior = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        row = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1)
        if kind == 0:
            recon = row.copy()
        elif kind == 1:  # Sub: a running sum per channel, modulo 256
            recon = np.cumsum(row.reshape(width, bpp), axis=0,
                              dtype=np.uint8).reshape(stride)
        elif kind == 2:  # Up
            recon = row + prior
        elif kind in (3, 4):  # Average, Paeth: left to right
            f, up, r = row.tolist(), prior.tolist(), [0] * stride
            for i in range(stride):
                a = r[i - bpp] if i >= bpp else 0
                b = up[i]
                if kind == 3:
                    r[i] = (f[i] + ((a + b) >> 1)) & 0xFF
                    continue
                c = up[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                r[i] = (f[i] + pred) & 0xFF
            recon = np.array(r, dtype=np.uint8)
        else:
            raise AssertionError(f"row {y}: unknown filter type {kind}")
        out[y] = recon
        prior = recon
    return out.reshape(height, width, bpp)[:, :, :3]


def pixels_near(image: np.ndarray, color: tuple, tolerance: int = 12) -> int:
    diff = np.abs(image.astype(np.int16) - np.array(color, dtype=np.int16))
    return int(np.count_nonzero(diff.max(axis=2) <= tolerance))


def check_screenshot(png: pathlib.Path) -> None:
    data = png.read_bytes()
    image = decode_png(data)
    assert image.shape == (HEIGHT, WIDTH, 3), image.shape
    # Not blank: the text, grid and curves cover a few percent of the
    # page and antialiasing gives them many colours.
    non_white = np.count_nonzero(image.min(axis=2) < 245)
    assert non_white > 0.02 * WIDTH * HEIGHT, f"{non_white} non-white pixels"
    plots = image[HEIGHT // 4:]  # below the header and summary table
    packed = plots.astype(np.uint32)
    colors = len(np.unique((packed[..., 0] << 16) | (packed[..., 1] << 8)
                           | packed[..., 2]))
    assert colors > 200, f"only {colors} distinct colours in the plots"
    # The curves in their colours, and the problem marks (skipped step,
    # clipped steps, threshold).
    for name, color, least in [("loss", LOSS_COLOR, 300),
                               ("lr", LR_COLOR, 300),
                               ("grad norm", GRAD_COLOR, 200),
                               ("marks", PROBLEM_COLOR, 100)]:
        found = pixels_near(image, color)
        assert found >= least, f"{found} pixels of the {name} colour"


# --- DOM ---------------------------------------------------------------------

class PlotParser(html.parser.HTMLParser):
    """(plot, series) -> the points of its polyline, from <svg data-plot>
    and <polyline data-series points>."""

    def __init__(self):
        super().__init__()
        self.plot = None
        self.polylines = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "svg":
            self.plot = attrs.get("data-plot")
        elif tag == "polyline" and self.plot:
            points = [tuple(float(v) for v in p.split(","))
                      for p in attrs.get("points", "").split()]
            self.polylines[(self.plot, attrs.get("data-series"))] = points

    def handle_endtag(self, tag):
        if tag == "svg":
            self.plot = None


def check_dom(dom: str, lines: list) -> None:
    parser = PlotParser()
    parser.feed(dom)
    for key, count in expected_points(lines).items():
        assert key in parser.polylines, f"no polyline for {key}"
        points = parser.polylines[key]
        assert len(points) == count, f"{key}: {len(points)} points, {count} " \
                                     f"steps have the value"
        assert all(math.isfinite(x) and math.isfinite(y) for x, y in points)
        xs = [x for x, _ in points]
        assert xs == sorted(xs), f"{key}: points not in step order"
    assert "step 61: skipped" in dom
    assert dom.count('class="highlight"') > 10, "clipped steps not marked"
    assert 'class="threshold"' in dom


# --- Tests -------------------------------------------------------------------

def test_screenshot_shows_the_curves(report, tmp_path):
    lines, page = report
    png = tmp_path / "shot.png"
    run_chromium(tmp_path, f"--screenshot={png}",
                 f"--window-size={WIDTH},{HEIGHT}", page.as_uri())
    check_screenshot(png)


def test_dom_has_one_point_per_step(report, tmp_path):
    lines, page = report
    dom = run_chromium(tmp_path, "--dump-dom", page.as_uri())
    assert "<svg" in dom and "</html>" in dom, dom[:500]
    check_dom(dom, lines)


def test_checks_fail_on_a_broken_page(report, tmp_path):
    """The checks above can fail: a page whose curves are drawn in white
    and whose loss polyline lost its points does not pass them."""
    lines, page = report
    text = page.read_text()
    broken = tmp_path / "broken.html"
    broken.write_text(text.replace('stroke="#4e79a7"', 'stroke="#ffffff"')
                      .replace('data-series="loss" stroke="#ffffff" points="',
                               'data-series="loss" stroke="#ffffff" '
                               'points="0,0 '))
    png = tmp_path / "broken.png"
    run_chromium(tmp_path, f"--screenshot={png}",
                 f"--window-size={WIDTH},{HEIGHT}", broken.as_uri())
    with pytest.raises(AssertionError, match="loss colour"):
        check_screenshot(png)
    dom = run_chromium(tmp_path, "--dump-dom", broken.as_uri())
    with pytest.raises(AssertionError, match="points"):
        check_dom(dom, lines)
    with pytest.raises(AssertionError, match="not a PNG"):
        decode_png(b"GIF89a" + png.read_bytes()[6:])


def test_tool_errors(tmp_path):
    """Missing, empty and malformed metrics, an unwritable output and a full
    disk exit 1 with a message naming the file (docs/ExitCodes.md); no
    output is made or changed."""
    tool = tool_path("megaslide-report")
    out = tmp_path / "out.html"

    def fails(*args):
        r = subprocess.run([tool, *map(os.fspath, args)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1, (args, r.returncode, r.stderr)
        assert "Stack dump" not in r.stderr
        return r.stderr

    assert "nosuch.jsonl" in fails(tmp_path / "nosuch.jsonl", "-o", out)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "the metrics file is empty" in fails(empty, "-o", out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": }\n'
                   '{"step": 3}\n')
    assert "bad.jsonl: line 2: invalid JSON" in fails(bad, "-o", out)
    assert not out.exists()
    good = tmp_path / "good.jsonl"
    good.write_text('{"step": 1, "loss": 0.5, "seconds": 1}\n')
    # The output is checked before the input is read.
    assert "cannot" in fails(tmp_path / "nosuch.jsonl", "-o",
                             tmp_path / "no" / "dir" / "out.html")
    assert "not NAME=VALUE" in fails(good, "-o", out, "--setting", "x")
    out.write_text("old")
    fails(bad, "-o", out)
    assert out.read_text() == "old", "a failed run changed the output"
    # A disk that fills up while the page is written (docs/Testing.md,
    # "Fault injection"): the old page stays.
    r = subprocess.run([tool, os.fspath(good), "-o", os.fspath(out)],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "MEGASLIDE_FAULT_WRITE_LIMIT": "100"})
    assert r.returncode == 1 and "No space left on device" in r.stderr, r
    assert out.read_text() == "old"
    r = subprocess.run([tool, os.fspath(good), "-o", os.fspath(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "MegaSlide training run: good.jsonl" in out.read_text()


# --- A million steps ------------------------------------------------------------

BIG_STEPS = 1_000_000
# The plot frame of runtime/train/TrainingReport.cpp: left edge and width.
FRAME_LEFT, FRAME_WIDTH = 90, 780


@pytest.fixture(scope="module")
def big_report(tmp_path_factory) -> tuple:
    """A metrics log of a million steps with one loss spike, skipped steps
    (one alone, two next to each other), a NaN loss and clipped steps
    (one alone, a block), at random places; the page megaslide-report made
    of it."""
    tmp = tmp_path_factory.mktemp("big")
    rng = random.Random(26)
    # Mid-column (a column is 500 steps), so the pair shares one.
    picks = sorted(rng.sample(range(1250, BIG_STEPS - 1000, 3000), 6))
    rng.shuffle(picks)
    spike, skipped, pair, nan, clipped, block = picks
    special = {spike: "spike", skipped: "skipped", pair: "skipped",
               pair + 1: "skipped", nan: "nan", clipped: "clipped"}
    special.update({s: "clipped" for s in range(block, block + 400)})
    line = ('{"step": %d, "loss": %.5f, "lr": 0.0001, "grad_norm": %.4f, '
            '"clipped": %s, "skipped": %s, "seconds": %.4f}\n')
    out = []
    noise = [rng.random() for _ in range(997)]
    for step in range(1, BIG_STEPS + 1):
        kind = special.get(step)
        loss = 0.2 + 0.8 * math.exp(-step / 50000) + 0.05 * noise[step % 997]
        grad = 0.5 + 0.3 * noise[(step * 7) % 997]
        if kind == "spike":
            out.append(line % (step, 1000.0, grad, "false", "false", 0.8))
        elif kind == "skipped":
            out.append('{"step": %d, "loss": null, "lr": 0.0001, "grad_norm": '
                       'null, "clipped": false, "skipped": true, '
                       '"seconds": 0.8}\n' % step)
        elif kind == "nan":
            out.append('{"step": %d, "loss": NaN, "lr": 0.0001, "grad_norm": '
                       '0.5, "clipped": false, "skipped": false, '
                       '"seconds": 0.8}\n' % step)
        else:
            clip = kind == "clipped"
            out.append(line % (step, loss, 2.0 if clip else grad,
                               "true" if clip else "false", "false",
                               0.8 + 0.01 * noise[(step * 3) % 997]))
    metrics = tmp / "big.jsonl"
    metrics.write_text("".join(out))
    page = tmp / "big.html"
    r = subprocess.run([tool_path("megaslide-report"), os.fspath(metrics),
                        "-o", os.fspath(page),
                        "--setting", f"max_grad_norm={MAX_GRAD_NORM}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    metrics.unlink()
    return page, spike, skipped, pair, nan, clipped, block


def step_x(step: int) -> float:
    return FRAME_LEFT + (step - 1) / (BIG_STEPS - 1) * FRAME_WIDTH


def test_million_steps_page_is_small_and_keeps_every_mark(big_report):
    """Downsampled for drawing (docs/Training.md, "Training report"): the
    page of a million steps is a few MB, and the spike, the skipped, NaN
    and clipped steps are all still on it."""
    page, spike, skipped, pair, nan, clipped, block = big_report
    size = page.stat().st_size
    print(f"page of {BIG_STEPS} steps: {size} bytes")
    assert size < 5_000_000, f"the page is {size} bytes"
    text = page.read_text()
    parser = PlotParser()
    parser.feed(text)
    loss = parser.polylines[("loss", "loss")]
    assert 2000 <= len(loss) <= 4 * 2000, len(loss)
    xs = [x for x, _ in loss]
    assert xs == sorted(xs)
    # The spike is the highest point of the loss curve, where its step is,
    # and stands far above the rest.
    top = min(loss, key=lambda p: p[1])
    assert abs(top[0] - step_x(spike)) <= 0.06, (top, step_x(spike))
    rest = min(y for x, y in loss if (x, y) != top)
    assert rest - top[1] > 50, (top, rest)
    # Marks: a lone skipped step, two in one column summarised, a NaN loss,
    # a lone clipped step and a block of clipped steps, in both plots.
    assert f"step {skipped}: skipped (no update" in text
    assert f"2 steps from {pair} to {pair + 1}: skipped (no update" in text
    assert f"2 steps from {pair} to {pair + 1}: skipped</title>" in text
    assert f"step {nan}: the loss is not finite" in text
    assert f"step {clipped}: clipped</title>" in text
    assert f"steps from {block} to" in text
    assert "Downsampled for drawing: 1000000 points in 2000 columns" in text
    assert "1000000 optimizer steps" in text


def test_million_steps_page_renders(big_report, tmp_path):
    """Chromium lays out the page of a million steps (before downsampling:
    89 MB that it did not render in 240 s)."""
    page = big_report[0]
    dom = run_chromium(tmp_path, "--dump-dom", page.as_uri())
    assert "</html>" in dom and 'data-series="loss"' in dom, dom[-500:]
