"""Line charts as PNG files, drawn here (an RGB canvas, a 5x7 bitmap font, zlib for the encoding):
`slmrank bench` ships in the wheel, and a plotting library would weigh more than the server it
measures. Text is drawn in capitals."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Sequence

Color = tuple[int, int, int]
WHITE, BLACK, GREY, LIGHT = (255, 255, 255), (0, 0, 0), (120, 120, 120), (225, 225, 225)
PALETTE: tuple[Color, ...] = ((31, 119, 180), (44, 160, 44), (255, 127, 14), (214, 39, 40), (148, 103, 189),
                              (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))

_GLYPHS = """
0 .###. #...# #..## #.#.# ##..# #...# .###.
1 ..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.
2 .###. #...# ....# ...#. ..#.. .#... #####
3 ##### ...#. ..#.. ...#. ....# #...# .###.
4 ...#. ..##. .#.#. #..#. ##### ...#. ...#.
5 ##### #.... ####. ....# ....# #...# .###.
6 ..##. .#... #.... ####. #...# #...# .###.
7 ##### ....# ...#. ..#.. .#... .#... .#...
8 .###. #...# #...# .###. #...# #...# .###.
9 .###. #...# #...# .#### ....# ...#. .##..
A .###. #...# #...# ##### #...# #...# #...#
B ####. #...# #...# ####. #...# #...# ####.
C .###. #...# #.... #.... #.... #...# .###.
D ###.. #..#. #...# #...# #...# #..#. ###..
E ##### #.... #.... ####. #.... #.... #####
F ##### #.... #.... ####. #.... #.... #....
G .###. #...# #.... #.### #...# #...# .####
H #...# #...# #...# ##### #...# #...# #...#
I .###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.
J ..### ...#. ...#. ...#. ...#. #..#. .##..
K #...# #..#. #.#.. ##... #.#.. #..#. #...#
L #.... #.... #.... #.... #.... #.... #####
M #...# ##.## #.#.# #.#.# #...# #...# #...#
N #...# #...# ##..# #.#.# #..## #...# #...#
O .###. #...# #...# #...# #...# #...# .###.
P ####. #...# #...# ####. #.... #.... #....
Q .###. #...# #...# #...# #.#.# #..#. .##.#
R ####. #...# #...# ####. #.#.. #..#. #...#
S .#### #.... #.... .###. ....# ....# ####.
T ##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
U #...# #...# #...# #...# #...# #...# .###.
V #...# #...# #...# #...# #...# .#.#. ..#..
W #...# #...# #...# #.#.# #.#.# #.#.# .#.#.
X #...# #...# .#.#. ..#.. .#.#. #...# #...#
Y #...# #...# .#.#. ..#.. ..#.. ..#.. ..#..
Z ##### ....# ...#. ..#.. .#... #.... #####
. ..... ..... ..... ..... ..... .##.. .##..
, ..... ..... ..... ..... .##.. ..#.. .#...
: ..... .##.. .##.. ..... .##.. .##.. .....
- ..... ..... ..... ##### ..... ..... .....
+ ..... ..#.. ..#.. ##### ..#.. ..#.. .....
/ ..... ....# ...#. ..#.. .#... #.... .....
( ...#. ..#.. .#... .#... .#... ..#.. ...#.
) .#... ..#.. ...#. ...#. ...#. ..#.. .#...
% ##... ##..# ...#. ..#.. .#... #..## ...##
< ...#. ..#.. .#... #.... .#... ..#.. ...#.
> .#... ..#.. ...#. ....# ...#. ..#.. .#...
= ..... ..... ##### ..... ##### ..... .....
_ ..... ..... ..... ..... ..... ..... #####
* ..... ..#.. #.#.# .###. #.#.# ..#.. .....
[ .###. .#... .#... .#... .#... .#... .###.
] .###. ...#. ...#. ...#. ...#. ...#. .###.
' ..#.. ..#.. .#... ..... ..... ..... .....
"""
FONT: dict[str, tuple[str, ...]] = {line[0]: tuple(line[2:].split()) for line in _GLYPHS.strip().splitlines()}
FONT[" "] = (".....",) * 7
GLYPH_W, GLYPH_H = 6, 8  # a 5x7 glyph and its spacing


class Canvas:
    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, c: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(c)

    def get(self, x: int, y: int) -> Color:
        i = 3 * (y * self.width + x)
        return tuple(self.pixels[i:i + 3])  # type: ignore[return-value]

    def rect(self, x0: int, y0: int, x1: int, y1: int, c: Color) -> None:
        """Filled, corners included."""
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            lo, hi = max(0, min(x0, x1)), min(self.width - 1, max(x0, x1))
            if lo <= hi:
                self.pixels[3 * (y * self.width + lo):3 * (y * self.width + hi + 1)] = bytes(c) * (hi - lo + 1)

    def line(self, x0: float, y0: float, x1: float, y1: float, c: Color, width: int = 1, dash: int = 0) -> None:
        """A straight line of `width` pixels; dash > 0: dash pixels on, dash off."""
        steps = max(1, int(max(abs(x1 - x0), abs(y1 - y0))))
        r = (width - 1) // 2
        for i in range(steps + 1):
            if dash and (i // dash) % 2:
                continue
            x, y = round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps)
            self.rect(x - r, y - r, x - r + width - 1, y - r + width - 1, c)

    def text(self, x: int, y: int, s: str, c: Color = BLACK, scale: int = 1) -> None:
        """s in capitals from its top-left corner; a character the font lacks is a space."""
        for k, ch in enumerate(s.upper()):
            rows = FONT.get(ch, FONT[" "])
            for dy, row in enumerate(rows):
                for dx, bit in enumerate(row):
                    if bit == "#":
                        gx, gy = x + (k * GLYPH_W + dx) * scale, y + dy * scale
                        self.rect(gx, gy, gx + scale - 1, gy + scale - 1, c)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[3 * y * self.width:3 * (y + 1) * self.width])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def text_width(s: str, scale: int = 1) -> int:
    return len(s) * GLYPH_W * scale


def read_png(data: bytes) -> Canvas:
    """A PNG this module wrote (8-bit RGB, filter 0) back as a Canvas: for the tests."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0], kind
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    width, height = size
    raw = zlib.decompress(idat)
    canvas = Canvas(width, height)
    stride = 3 * width + 1
    for y in range(height):
        assert raw[y * stride] == 0, "filter"
        canvas.pixels[3 * y * width:3 * (y + 1) * width] = raw[y * stride + 1:(y + 1) * stride]
    return canvas


# ---- charts --------------------------------------------------------------------------------------------

def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.3g}"


def linear_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    out = [m * 10.0 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
           for m in (1, 2, 5) if lo <= m * 10.0 ** k <= hi]
    return out if len(out) <= 12 else [t for t in out if f"{t:e}".startswith("1")]


class Axes:
    """The mapping from data to pixels of a plot area, linear or logarithmic per axis."""

    def __init__(self, box: tuple[int, int, int, int], xr: tuple[float, float], yr: tuple[float, float],
                 log_x: bool = False, log_y: bool = False) -> None:
        self.box, self.log_x, self.log_y = box, log_x, log_y
        f = math.log10
        self.xr = (f(xr[0]), f(xr[1])) if log_x else xr
        self.yr = (f(yr[0]), f(yr[1])) if log_y else yr

    def px(self, x: float, y: float) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        if self.log_x:
            x = math.log10(max(x, 1e-12))
        if self.log_y:
            y = math.log10(max(y, 1e-12))
        fx = (x - self.xr[0]) / ((self.xr[1] - self.xr[0]) or 1.0)
        fy = (y - self.yr[0]) / ((self.yr[1] - self.yr[0]) or 1.0)
        return x0 + fx * (x1 - x0), y1 - fy * (y1 - y0)


def line_chart(path: str | Path, title: str, x_label: str, y_label: str,
               series: Sequence[tuple[str, Sequence[tuple[float, float]]]], *, log_x: bool = False,
               log_y: bool = False, hlines: Sequence[tuple[str, float]] = (), marks: Sequence[tuple[str, float, float]] = (),
               notes: Sequence[tuple[str, float, float]] = (), steps: bool = False,
               size: tuple[int, int] = (900, 540)) -> Canvas:
    """Writes a PNG of the series (label, [(x, y)]), in PALETTE's colours; hlines: dashed
    horizontal lines (label, y); marks: circled points (label, x, y); notes: small grey labels at
    points (label, x, y); steps: each point a flat step to the next x (a histogram). Returns the canvas."""
    w, h = size
    c = Canvas(w, h)
    box = (80, 40, w - 24, h - 56)
    pts = [p for _, s in series for p in s if not (math.isnan(p[0]) or math.isnan(p[1]))]
    ys = [y for _, y in pts] + [y for _, y in hlines] + [y for _, _, y in marks]
    xs = [x for x, _ in pts] + [x for _, x, _ in marks]
    if log_y:
        ys = [y for y in ys if y > 0]
    if log_x:
        xs = [x for x in xs if x > 0]
    if not xs or not ys:
        xs, ys = xs or [0.0, 1.0], ys or [1.0, 10.0]
    xr = (min(xs), max(xs))
    yr = (min(ys), max(ys))
    if log_y:
        yr = (yr[0] / 1.5, yr[1] * 1.5) if yr[0] < yr[1] else (yr[0] / 2, yr[1] * 2)
    else:
        yr = (min(0.0, yr[0]), yr[1] * 1.08 if yr[1] > 0 else 1.0)
    if log_x:
        xr = (xr[0] / 1.2, xr[1] * 1.2) if xr[0] < xr[1] else (xr[0] / 2, xr[1] * 2)
    else:
        pad = (xr[1] - xr[0]) * 0.05 or max(abs(xr[0]) * 0.1, 1.0)
        xr = (max(0.0, xr[0] - pad) if xr[0] >= 0 else xr[0] - pad, xr[1] + pad)
    ax = Axes(box, xr, yr, log_x, log_y)
    x0, y0, x1, y1 = box
    xticks = log_ticks(*xr) if log_x else linear_ticks(*xr)
    yticks = log_ticks(*yr) if log_y else linear_ticks(*yr)
    for t in xticks:
        px, _ = ax.px(t, yr[0])
        if x0 <= px <= x1:
            c.line(px, y0, px, y1, LIGHT)
            label = _fmt(t)
            c.text(int(px - text_width(label) / 2), y1 + 8, label, GREY)
    for t in yticks:
        _, py = ax.px(xr[0], t)
        if y0 <= py <= y1:
            c.line(x0, py, x1, py, LIGHT)
            label = _fmt(t)
            c.text(x0 - 6 - text_width(label), int(py - 3), label, GREY)
    c.line(x0, y1, x1, y1, BLACK)
    c.line(x0, y0, x0, y1, BLACK)
    if text_width(title, 2) <= w - x0:
        c.text(x0, 12, title, BLACK, 2)
    else:
        c.text(x0, 16, title, BLACK)
    c.text(int((x0 + x1) / 2 - text_width(x_label) / 2), h - 22, x_label, BLACK)
    c.text(8, y0 - 14, y_label, BLACK)
    for label, y in hlines:
        _, py = ax.px(xr[0], y)
        if y0 <= py <= y1:
            c.line(x0, py, x1, py, GREY, 1, dash=6)
            c.text(x1 - text_width(label) - 4, int(py - 11), label, GREY)
    for k, (label, s) in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        good = [p for p in s if not (math.isnan(p[0]) or math.isnan(p[1])) and (not log_y or p[1] > 0)]
        prev = None
        for x, y in good:
            px, py = ax.px(x, y)
            if prev is not None:
                if steps:
                    c.line(prev[0], prev[1], px, prev[1], color, 2)
                    c.line(px, prev[1], px, py, color, 2)
                else:
                    c.line(prev[0], prev[1], px, py, color, 2)
            if not steps:
                c.rect(int(px) - 2, int(py) - 2, int(px) + 2, int(py) + 2, color)
            prev = (px, py)
        # the legend, top right inside the plot
        ly = y0 + 6 + 12 * k
        lx = x1 - 8 - text_width(label) - 16
        c.rect(lx, ly, lx + 9, ly + 6, color)
        c.text(lx + 14, ly, label, BLACK)
    for label, x, y in notes:
        if not (math.isnan(x) or math.isnan(y)) and (not log_y or y > 0):
            px, py = ax.px(x, y)
            c.text(int(px) + 5, int(py) - 10, label, GREY)
    for label, x, y in marks:
        px, py = ax.px(x, y)
        for a in range(0, 360, 6):
            c.set(int(px + 7 * math.cos(math.radians(a))), int(py + 7 * math.sin(math.radians(a))), BLACK)
        c.text(int(px) + 10, int(py) - 14, label, BLACK)
    Path(path).write_bytes(c.png())
    return c
