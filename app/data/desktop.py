"""The desktop every behaviour screenshot is drawn on (`app.data.scenes`): themes and brand
colours shared by every class, drawing primitives that tolerate boxes collapsed at small sizes,
ordinary application windows, login forms and the small distractors any screen shows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import ImageDraw

Color = tuple[int, int, int]
Box = tuple[int, int, int, int]


# Desktop themes shared by every class, so colour alone says little about the class:
# (desktop, window, title bar, text, field).
THEMES: tuple[tuple[Color, Color, Color, Color, Color], ...] = (
    ((58, 110, 165), (240, 240, 240), (0, 84, 166), (60, 60, 60), (255, 255, 255)),
    ((0, 128, 128), (236, 233, 216), (10, 36, 106), (30, 30, 30), (255, 255, 255)),
    ((30, 30, 36), (45, 45, 48), (62, 62, 66), (200, 200, 200), (30, 30, 30)),
    ((180, 160, 200), (250, 250, 250), (222, 222, 222), (40, 40, 40), (255, 255, 255)),
    ((70, 120, 70), (245, 245, 240), (90, 90, 90), (50, 50, 50), (255, 255, 255)),
    ((200, 120, 60), (235, 235, 235), (40, 40, 40), (20, 20, 20), (250, 250, 250)),
)
# Brand colours: logos and buttons of real and fake pages alike.
BRANDS: tuple[Color, ...] = (
    (0, 120, 215),
    (219, 68, 55),
    (255, 153, 0),
    (52, 168, 83),
    (24, 119, 242),
    (20, 20, 20),
    (120, 40, 160),
)
ADS: tuple[Color, ...] = (
    (255, 0, 200),
    (0, 230, 60),
    (0, 220, 255),
    (255, 120, 0),
    (255, 240, 0),
    (255, 40, 40),
    (140, 0, 255),
)
WARN: tuple[Color, ...] = ((215, 25, 25), (250, 200, 0), (240, 110, 0))
DARK: tuple[Color, ...] = ((0, 0, 0), (110, 0, 0), (10, 10, 60), (50, 0, 50), (25, 25, 25))


def rect(d: ImageDraw.ImageDraw, box: Box, **kw) -> None:
    # Layouts scale with the image; at small sizes a box can collapse, and Pillow rejects x1 < x0.
    if box[2] >= box[0] and box[3] >= box[1]:
        d.rectangle(box, **kw)


def ellipse(d: ImageDraw.ImageDraw, box: Box, **kw) -> None:
    if box[2] >= box[0] and box[3] >= box[1]:
        d.ellipse(box, **kw)


def pick(rng: np.random.Generator, items: Sequence):
    return items[int(rng.integers(len(items)))]


def jit(rng: np.random.Generator, c: Color, amount: int = 14) -> Color:
    d = rng.integers(-amount, amount + 1, 3)
    return (
        min(255, max(0, c[0] + int(d[0]))),
        min(255, max(0, c[1] + int(d[1]))),
        min(255, max(0, c[2] + int(d[2]))),
    )


def rand_box(
    rng: np.random.Generator,
    s: int,
    w: tuple[float, float],
    h: tuple[float, float],
    within: Box | None = None,
) -> Box:
    x0, y0, x1, y1 = within or (0, 0, s - 1, s - 1)
    bw = max(3, int((x1 - x0) * rng.uniform(*w)))
    bh = max(3, int((y1 - y0) * rng.uniform(*h)))
    x = x0 + int(rng.integers(0, max(1, x1 - x0 - bw + 1)))
    y = y0 + int(rng.integers(0, max(1, y1 - y0 - bh + 1)))
    return x, y, x + bw, y + bh


def text_lines(
    d: ImageDraw.ImageDraw, rng: np.random.Generator, box: Box, col: Color, pitch: int, thick: int = 1
) -> None:
    """Text stand-in: rows of bars of random length, with the odd paragraph break."""
    x0, y0, x1, y1 = box
    if x1 - x0 < 3:
        return
    y = y0 + 1
    while y + thick <= y1:
        if rng.random() > 0.12:
            length = int((x1 - x0) * rng.uniform(0.35, 1.0))
            rect(d, (x0, y, x0 + length, y + thick - 1), fill=col)
        y += pitch


def window(
    d: ImageDraw.ImageDraw, rng: np.random.Generator, s: int, box: Box, theme, title: Color | None = None
) -> Box:
    """A window frame with a title bar and its buttons; returns the content area."""
    x0, y0, x1, y1 = box
    _, win, tbar, _, _ = theme
    th = max(2, int(0.07 * s))
    rect(d, box, fill=jit(rng, win, 6), outline=(90, 90, 90))
    rect(d, (x0, y0, x1, y0 + th), fill=jit(rng, title or tbar, 10))
    b = max(1, th - 2)
    for k, c in enumerate(((200, 60, 50), (160, 160, 160), (160, 160, 160))):
        bx = x1 - 2 - (k + 1) * (b + 1)
        if bx > x0 + th:
            rect(d, (bx, y0 + 1, bx + b - 1, y0 + b), fill=c)
    return x0 + 1, y0 + th + 1, x1 - 1, y1 - 1


def login_form(
    d: ImageDraw.ImageDraw, rng: np.random.Generator, s: int, area: Box, brand: Color, field: Color
) -> None:
    """Logo block over two input fields and a submit button, roughly centred in `area`."""
    x0, y0, x1, y1 = area
    w, h = x1 - x0, y1 - y0
    fw = int(w * rng.uniform(0.4, 0.65))
    cx = x0 + w // 2 + int(rng.integers(-w // 10, w // 10 + 1))
    fx0, fx1 = cx - fw // 2, cx + fw // 2
    fh = max(2, int(0.07 * s))
    y = y0 + int(h * rng.uniform(0.05, 0.15))
    lw = int(fw * rng.uniform(0.3, 0.7))
    rect(d, (cx - lw // 2, y, cx + lw // 2, y + max(2, int(0.1 * s))), fill=jit(rng, brand))
    y += max(2, int(0.1 * s)) + max(2, int(0.05 * s))
    for _ in range(2):
        rect(d, (fx0, y, fx1, y + fh), fill=field, outline=(150, 150, 150))
        y += fh + max(1, int(0.04 * s))
    rect(d, (fx0, y, fx1, y + fh), fill=jit(rng, brand))


def desktop(d: ImageDraw.ImageDraw, rng: np.random.Generator, s: int, theme) -> None:
    rect(d, (0, 0, s - 1, s - 1), fill=jit(rng, theme[0], 20))
    if rng.random() < 0.5:  # a big soft wallpaper shape
        ellipse(d, rand_box(rng, s, (0.4, 1.0), (0.4, 1.0)), fill=jit(rng, theme[0], 40))
    if rng.random() < 0.6:
        rect(d, (0, s - max(2, int(0.06 * s)), s - 1, s - 1), fill=jit(rng, (35, 35, 45), 15))
    for k in range(int(rng.integers(0, 5))):
        g = max(2, int(0.07 * s))
        y = 2 + k * (g + 2)
        rect(d, (2, y, 2 + g, y + g), fill=jit(rng, (220, 200, 120), 40))


def app_window(
    d: ImageDraw.ImageDraw, rng: np.random.Generator, s: int, theme, accent: Color | None, confusers: bool
) -> None:
    """An ordinary application window; with `confusers`, sometimes one that looks half-suspicious."""
    box = rand_box(rng, s, (0.35, 0.9), (0.3, 0.85))
    area = window(d, rng, s, box, theme, accent)
    x0, y0, x1, y1 = area
    if x1 - x0 < 4 or y1 - y0 < 4:
        return
    text = theme[3]
    pitch = max(2, int(0.05 * s))
    kind = int(rng.integers(6))
    if kind == 0:  # document
        page = (x0 + (x1 - x0) // 8, y0, x1 - (x1 - x0) // 8, y1)
        rect(d, page, fill=(255, 255, 255))
        text_lines(d, rng, (page[0] + 2, page[1] + 1, page[2] - 2, page[3]), (70, 70, 70), pitch)
    elif kind == 1:  # file explorer
        side = x0 + (x1 - x0) // 4
        rect(d, (x0, y0, side, y1), fill=jit(rng, (215, 225, 235), 10))
        text_lines(d, rng, (x0 + 1, y0 + 1, side - 1, y1), text, pitch)
        g = max(2, int(0.06 * s))
        for yy in range(y0 + 2, y1 - g, g + 3):
            for xx in range(side + 3, x1 - g, g + 3):
                rect(d, (xx, yy, xx + g, yy + g), fill=jit(rng, (230, 190, 80), 30))
    elif kind == 2:  # spreadsheet
        rect(d, area, fill=(255, 255, 255))
        step = max(3, int(0.06 * s))
        for xx in range(x0, x1, step * 2):
            d.line((xx, y0, xx, y1), fill=(190, 190, 190))
        for yy in range(y0, y1, step):
            d.line((x0, yy, x1, yy), fill=(190, 190, 190))
    elif kind == 3:  # browser
        bar = max(2, int(0.07 * s))
        rect(d, (x0, y0, x1, y0 + bar), fill=(225, 225, 225))
        rect(d, (x0 + bar, y0 + 1, x1 - 2, y0 + bar - 1), fill=(255, 255, 255))
        page = (x0, y0 + bar + 1, x1, y1)
        rect(d, page, fill=(255, 255, 255))
        if confusers and rng.random() < 0.3:  # a legitimate sign-in page
            login_form(d, rng, s, page, pick(rng, BRANDS), (250, 250, 250))
        else:
            if rng.random() < 0.6:
                picture = rand_box(rng, s, (0.3, 0.6), (0.2, 0.4), page)
                rect(d, picture, fill=jit(rng, (150, 170, 190), 50))
            text_lines(d, rng, (page[0] + 2, page[1] + 2, page[2] - 2, page[3]), (80, 80, 80), pitch)
    elif kind == 4:  # media player
        rect(d, area, fill=(15, 15, 15))
        rect(d, (x0 + 2, y1 - max(2, int(0.05 * s)), x1 - 2, y1 - 1), fill=(200, 0, 0))
    else:  # code editor: dark, coloured text
        rect(d, area, fill=(28, 28, 32))
        for _ in range(3):
            text_lines(d, rng, (x0 + 2, y0 + 1, x1 - 2, y1), pick(rng, ADS[:5]), pitch * 3)


def scene(
    d, rng, s, theme, lo: int = 1, hi: int = 3, accent: Color | None = None, confusers: bool = False
) -> None:
    desktop(d, rng, s, theme)
    for _ in range(int(rng.integers(lo, hi + 1))):
        app_window(d, rng, s, theme, accent, confusers)


def distractors(d, rng, s) -> None:
    """Small things any screen may show: notification toasts, cursor-sized blobs, a stray icon."""
    for _ in range(int(rng.integers(0, 3))):
        box = rand_box(rng, s, (0.05, 0.25), (0.04, 0.12))
        colours = BRANDS + THEMES[int(rng.integers(len(THEMES)))][:3]
        rect(d, box, fill=jit(rng, pick(rng, colours), 20))
