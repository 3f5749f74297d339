"""Procedural behaviour screenshots: one RGB image of a class, drawn from a random generator.

Each class has a recognisable structure (a browser login page, a red-banded alert dialog, a dark
full-screen ransom note, ...) drawn over shared desktop themes with random positions, distractors
and pixel noise, so that a small CNN learns the classes at 32-64 px but not trivially. Class names
outside DEFAULT_CLASSES are hashed onto a template with their own colour. `app.data.synth` turns these
images into device traffic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image, ImageDraw

DEFAULT_CLASSES: tuple[str, ...] = (
    "normal",
    "phishing_page",
    "fake_av_popup",
    "ransom_note",
    "adware_overlay",
    "credential_prompt",
)

_OCCLUDED = 0.06  # share of non-normal images partly covered by ordinary windows: hard cases
MIN_SIZE = 16

Color = tuple[int, int, int]
Box = tuple[int, int, int, int]


# Desktop themes shared by every class, so colour alone says little about the class:
# (desktop, window, title bar, text, field).
_THEMES: tuple[tuple[Color, Color, Color, Color, Color], ...] = (
    ((58, 110, 165), (240, 240, 240), (0, 84, 166), (60, 60, 60), (255, 255, 255)),
    ((0, 128, 128), (236, 233, 216), (10, 36, 106), (30, 30, 30), (255, 255, 255)),
    ((30, 30, 36), (45, 45, 48), (62, 62, 66), (200, 200, 200), (30, 30, 30)),
    ((180, 160, 200), (250, 250, 250), (222, 222, 222), (40, 40, 40), (255, 255, 255)),
    ((70, 120, 70), (245, 245, 240), (90, 90, 90), (50, 50, 50), (255, 255, 255)),
    ((200, 120, 60), (235, 235, 235), (40, 40, 40), (20, 20, 20), (250, 250, 250)),
)
# Brand colours: logos and buttons of real and fake pages alike.
_BRANDS: tuple[Color, ...] = (
    (0, 120, 215),
    (219, 68, 55),
    (255, 153, 0),
    (52, 168, 83),
    (24, 119, 242),
    (20, 20, 20),
    (120, 40, 160),
)
_ADS: tuple[Color, ...] = (
    (255, 0, 200),
    (0, 230, 60),
    (0, 220, 255),
    (255, 120, 0),
    (255, 240, 0),
    (255, 40, 40),
    (140, 0, 255),
)
_WARN: tuple[Color, ...] = ((215, 25, 25), (250, 200, 0), (240, 110, 0))
_DARK: tuple[Color, ...] = ((0, 0, 0), (110, 0, 0), (10, 10, 60), (50, 0, 50), (25, 25, 25))


def _rect(d: ImageDraw.ImageDraw, box: Box, **kw) -> None:
    # Layouts scale with the image; at small sizes a box can collapse, and Pillow rejects x1 < x0.
    if box[2] >= box[0] and box[3] >= box[1]:
        d.rectangle(box, **kw)


def _ellipse(d: ImageDraw.ImageDraw, box: Box, **kw) -> None:
    if box[2] >= box[0] and box[3] >= box[1]:
        d.ellipse(box, **kw)


def _pick(rng: np.random.Generator, items: Sequence):
    return items[int(rng.integers(len(items)))]


def _jit(rng: np.random.Generator, c: Color, amount: int = 14) -> Color:
    d = rng.integers(-amount, amount + 1, 3)
    return (
        min(255, max(0, c[0] + int(d[0]))),
        min(255, max(0, c[1] + int(d[1]))),
        min(255, max(0, c[2] + int(d[2]))),
    )


def _rand_box(
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


def _lines(
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
            _rect(d, (x0, y, x0 + length, y + thick - 1), fill=col)
        y += pitch


def _window(
    d: ImageDraw.ImageDraw, rng: np.random.Generator, s: int, box: Box, theme, title: Color | None = None
) -> Box:
    """A window frame with a title bar and its buttons; returns the content area."""
    x0, y0, x1, y1 = box
    _, win, tbar, _, _ = theme
    th = max(2, int(0.07 * s))
    _rect(d, box, fill=_jit(rng, win, 6), outline=(90, 90, 90))
    _rect(d, (x0, y0, x1, y0 + th), fill=_jit(rng, title or tbar, 10))
    b = max(1, th - 2)
    for k, c in enumerate(((200, 60, 50), (160, 160, 160), (160, 160, 160))):
        bx = x1 - 2 - (k + 1) * (b + 1)
        if bx > x0 + th:
            _rect(d, (bx, y0 + 1, bx + b - 1, y0 + b), fill=c)
    return x0 + 1, y0 + th + 1, x1 - 1, y1 - 1


def _login_form(
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
    _rect(d, (cx - lw // 2, y, cx + lw // 2, y + max(2, int(0.1 * s))), fill=_jit(rng, brand))
    y += max(2, int(0.1 * s)) + max(2, int(0.05 * s))
    for _ in range(2):
        _rect(d, (fx0, y, fx1, y + fh), fill=field, outline=(150, 150, 150))
        y += fh + max(1, int(0.04 * s))
    _rect(d, (fx0, y, fx1, y + fh), fill=_jit(rng, brand))


def _desktop(d: ImageDraw.ImageDraw, rng: np.random.Generator, s: int, theme) -> None:
    _rect(d, (0, 0, s - 1, s - 1), fill=_jit(rng, theme[0], 20))
    if rng.random() < 0.5:  # a big soft wallpaper shape
        _ellipse(d, _rand_box(rng, s, (0.4, 1.0), (0.4, 1.0)), fill=_jit(rng, theme[0], 40))
    if rng.random() < 0.6:
        _rect(d, (0, s - max(2, int(0.06 * s)), s - 1, s - 1), fill=_jit(rng, (35, 35, 45), 15))
    for k in range(int(rng.integers(0, 5))):
        g = max(2, int(0.07 * s))
        y = 2 + k * (g + 2)
        _rect(d, (2, y, 2 + g, y + g), fill=_jit(rng, (220, 200, 120), 40))


def _app_window(
    d: ImageDraw.ImageDraw, rng: np.random.Generator, s: int, theme, accent: Color | None, confusers: bool
) -> None:
    """An ordinary application window; with `confusers`, sometimes one that looks half-suspicious."""
    box = _rand_box(rng, s, (0.35, 0.9), (0.3, 0.85))
    area = _window(d, rng, s, box, theme, accent)
    x0, y0, x1, y1 = area
    if x1 - x0 < 4 or y1 - y0 < 4:
        return
    text = theme[3]
    pitch = max(2, int(0.05 * s))
    kind = int(rng.integers(6))
    if kind == 0:  # document
        page = (x0 + (x1 - x0) // 8, y0, x1 - (x1 - x0) // 8, y1)
        _rect(d, page, fill=(255, 255, 255))
        _lines(d, rng, (page[0] + 2, page[1] + 1, page[2] - 2, page[3]), (70, 70, 70), pitch)
    elif kind == 1:  # file explorer
        side = x0 + (x1 - x0) // 4
        _rect(d, (x0, y0, side, y1), fill=_jit(rng, (215, 225, 235), 10))
        _lines(d, rng, (x0 + 1, y0 + 1, side - 1, y1), text, pitch)
        g = max(2, int(0.06 * s))
        for yy in range(y0 + 2, y1 - g, g + 3):
            for xx in range(side + 3, x1 - g, g + 3):
                _rect(d, (xx, yy, xx + g, yy + g), fill=_jit(rng, (230, 190, 80), 30))
    elif kind == 2:  # spreadsheet
        _rect(d, area, fill=(255, 255, 255))
        step = max(3, int(0.06 * s))
        for xx in range(x0, x1, step * 2):
            d.line((xx, y0, xx, y1), fill=(190, 190, 190))
        for yy in range(y0, y1, step):
            d.line((x0, yy, x1, yy), fill=(190, 190, 190))
    elif kind == 3:  # browser
        bar = max(2, int(0.07 * s))
        _rect(d, (x0, y0, x1, y0 + bar), fill=(225, 225, 225))
        _rect(d, (x0 + bar, y0 + 1, x1 - 2, y0 + bar - 1), fill=(255, 255, 255))
        page = (x0, y0 + bar + 1, x1, y1)
        _rect(d, page, fill=(255, 255, 255))
        if confusers and rng.random() < 0.3:  # a legitimate sign-in page
            _login_form(d, rng, s, page, _pick(rng, _BRANDS), (250, 250, 250))
        else:
            if rng.random() < 0.6:
                picture = _rand_box(rng, s, (0.3, 0.6), (0.2, 0.4), page)
                _rect(d, picture, fill=_jit(rng, (150, 170, 190), 50))
            _lines(d, rng, (page[0] + 2, page[1] + 2, page[2] - 2, page[3]), (80, 80, 80), pitch)
    elif kind == 4:  # media player
        _rect(d, area, fill=(15, 15, 15))
        _rect(d, (x0 + 2, y1 - max(2, int(0.05 * s)), x1 - 2, y1 - 1), fill=(200, 0, 0))
    else:  # code editor: dark, coloured text
        _rect(d, area, fill=(28, 28, 32))
        for _ in range(3):
            _lines(d, rng, (x0 + 2, y0 + 1, x1 - 2, y1), _pick(rng, _ADS[:5]), pitch * 3)


def _scene(
    d, rng, s, theme, lo: int = 1, hi: int = 3, accent: Color | None = None, confusers: bool = False
) -> None:
    _desktop(d, rng, s, theme)
    for _ in range(int(rng.integers(lo, hi + 1))):
        _app_window(d, rng, s, theme, accent, confusers)


def _distractors(d, rng, s) -> None:
    """Small things any screen may show: notification toasts, cursor-sized blobs, a stray icon."""
    for _ in range(int(rng.integers(0, 3))):
        box = _rand_box(rng, s, (0.05, 0.25), (0.04, 0.12))
        colours = _BRANDS + _THEMES[int(rng.integers(len(_THEMES)))][:3]
        _rect(d, box, fill=_jit(rng, _pick(rng, colours), 20))


# Class templates. `accent` overrides the class's signature colour; custom classes use it.


def _normal(d, rng, s, theme, accent):
    _scene(d, rng, s, theme, 1, 3, accent, confusers=True)
    if rng.random() < 0.12:  # a harmless system dialog, grey and blue: the fake alert's look-alike
        box = _rand_box(rng, s, (0.3, 0.5), (0.25, 0.4))
        area = _window(d, rng, s, box, theme, (0, 90, 180))
        _lines(d, rng, (area[0] + 2, area[1] + 1, area[2] - 2, area[3] - 3), theme[3], max(2, int(0.05 * s)))


def _phishing_page(d, rng, s, theme, accent):
    _desktop(d, rng, s, theme)
    box = _rand_box(rng, s, (0.78, 1.0), (0.78, 1.0))
    x0, y0, x1, y1 = box
    tab = max(2, int(0.06 * s))
    bar = max(2, int(0.08 * s))
    _rect(d, box, fill=(255, 255, 255), outline=(90, 90, 90))
    _rect(d, (x0, y0, x1, y0 + tab), fill=_jit(rng, theme[2], 10))
    _rect(d, (x0 + 2, y0 + 1, x0 + (x1 - x0) // 3, y0 + tab), fill=_jit(rng, (235, 235, 235), 8))
    _rect(d, (x0, y0 + tab + 1, x1, y0 + tab + bar), fill=_jit(rng, (218, 220, 224), 6))
    # Address field with a red "not secure" mark: the page's tell-tale.
    ay0, ay1 = y0 + tab + 2, y0 + tab + bar - 1
    _rect(d, (x0 + bar, ay0, x1 - 2, ay1), fill=(255, 255, 255), outline=(170, 170, 170))
    _rect(d, (x0 + bar + 1, ay0 + 1, x0 + bar + max(2, bar // 2), ay1 - 1), fill=(210, 30, 30))
    page = (x0 + 1, y0 + tab + bar + 1, x1 - 1, y1 - 1)
    brand = accent or _pick(rng, _BRANDS)
    if rng.random() < 0.6:  # brand header strip
        _rect(d, (page[0], page[1], page[2], page[1] + max(2, int(0.06 * s))), fill=_jit(rng, brand))
    if rng.random() < 0.4:
        _rect(d, page, fill=_jit(rng, (240, 244, 250), 8))
    _login_form(d, rng, s, page, brand, (255, 255, 255))
    _lines(
        d,
        rng,
        (page[0] + 2, page[3] - max(3, int(0.1 * s)), page[2] - 2, page[3]),
        (150, 150, 150),
        max(2, int(0.04 * s)),
    )


def _fake_av_popup(d, rng, s, theme, accent):
    _scene(d, rng, s, theme, 0, 2)
    for _ in range(1 + int(rng.random() < 0.3)):
        box = _rand_box(rng, s, (0.38, 0.62), (0.35, 0.55))
        x0, y0, x1, y1 = box
        w, h = x1 - x0, y1 - y0
        _rect(d, box, fill=_jit(rng, (245, 245, 245), 8), outline=(60, 60, 60))
        band = accent or _pick(rng, _WARN)
        by1 = y0 + max(3, int(h * rng.uniform(0.25, 0.38)))
        _rect(d, (x0, y0, x1, by1), fill=_jit(rng, band, 10))
        # Warning triangle in the band.
        t = max(2, by1 - y0 - 2)
        tx = x0 + 2
        d.polygon(
            ((tx, by1 - 1), (tx + t, by1 - 1), (tx + t // 2, y0 + 1)), fill=(255, 230, 0), outline=(0, 0, 0)
        )
        _lines(d, rng, (x0 + 2, by1 + 2, x1 - 2, y1 - max(3, h // 4)), (60, 60, 60), max(2, int(0.045 * s)))
        bh = max(2, int(h * rng.uniform(0.14, 0.22)))
        bw = int(w * rng.uniform(0.65, 0.9))
        bx = x0 + (w - bw) // 2
        button = _pick(rng, ((30, 170, 60), (215, 25, 25), (0, 100, 220)))
        _rect(d, (bx, y1 - bh - 2, bx + bw, y1 - 2), fill=_jit(rng, button))


def _ransom_note(d, rng, s, theme, accent):
    bg = _jit(rng, (accent[0] // 3, accent[1] // 3, accent[2] // 3) if accent else _pick(rng, _DARK), 12)
    _rect(d, (0, 0, s - 1, s - 1), fill=bg)
    hot = _pick(rng, ((230, 30, 30), (250, 210, 0), (240, 240, 240)))
    left = 2
    if rng.random() < 0.5:  # lock / skull panel
        pw = int(s * rng.uniform(0.18, 0.3))
        _rect(d, (2, 2, 2 + pw, s - 3), fill=_jit(rng, (bg[0] // 2 + 20, bg[1] // 2, bg[2] // 2), 10))
        r = pw // 3
        cy = s // 3 + int(rng.integers(-s // 10, s // 10 + 1))
        _ellipse(d, (2 + pw // 2 - r, cy - r, 2 + pw // 2 + r, cy + r), fill=hot)
        left = pw + 5
    y = 2 + int(rng.integers(0, max(1, s // 12)))
    head = max(2, int(0.08 * s))
    _rect(d, (left, y, left + int((s - left) * rng.uniform(0.5, 0.95)), y + head), fill=_jit(rng, hot, 15))
    y += head + 2
    text_bottom = int(s * rng.uniform(0.6, 0.72))
    _lines(
        d,
        rng,
        (left, y, s - 3, text_bottom),
        _jit(rng, (225, 225, 225), 25),
        max(3, int(0.06 * s)),
        max(1, int(0.025 * s)),
    )
    # Countdown: a row of outlined boxes with digit strokes.
    k = int(rng.integers(2, 5))
    bw = max(3, int((s - left - 4) / k * rng.uniform(0.6, 0.85)))
    bh = max(3, int(0.14 * s))
    by = text_bottom + 2 + int(rng.integers(0, max(1, s - text_bottom - bh - 5)))
    for i in range(k):
        bx = left + i * ((s - left - 4) // k)
        _rect(d, (bx, by, bx + bw, by + bh), fill=(10, 10, 10), outline=hot)
        for j in range(2):
            sx = bx + (j + 1) * bw // 3
            _rect(d, (sx, by + 2, sx + max(0, bw // 10), by + bh - 2), fill=(240, 240, 240))
    if rng.random() < 0.4:  # wallet address field
        _rect(d, (left, s - max(3, int(0.07 * s)) - 2, s - 4, s - 3), fill=(235, 235, 235))


def _adware_overlay(d, rng, s, theme, accent):
    _scene(d, rng, s, theme, 1, 2)
    for _ in range(int(rng.integers(5, 13))):
        box = _rand_box(rng, s, (0.14, 0.38), (0.07, 0.2))
        col = _jit(rng, accent if accent and rng.random() < 0.6 else _pick(rng, _ADS), 25)
        _rect(d, box, fill=col)
        x0, y0, x1, y1 = box
        if rng.random() < 0.6:  # slogan stripe in a contrasting colour
            ym = (y0 + y1) // 2
            _rect(
                d,
                (x0 + 1, ym, x1 - max(2, (x1 - x0) // 4), ym + (y1 - y0) // 5),
                fill=(255 - col[0], 255 - col[1], 255 - col[2]),
            )
        if rng.random() < 0.5:  # close box
            c = max(1, int(0.03 * s))
            _rect(d, (x1 - c - 1, y0 + 1, x1 - 1, y0 + 1 + c), fill=(255, 255, 255), outline=(0, 0, 0))
        if rng.random() < 0.2:  # starburst
            r = max(2, int(0.06 * s))
            _ellipse(d, (x0 - r, y0 - r, x0 + r, y0 + r), fill=(255, 255, 0))


def _credential_prompt(d, rng, s, theme, accent):
    _scene(d, rng, s, theme, 1, 3)
    _rect(d, (0, 0, s - 1, s - 1), fill=(0, 0, 0, int(rng.integers(80, 170))))
    mw, mh = int(s * rng.uniform(0.45, 0.7)), int(s * rng.uniform(0.45, 0.62))
    cx = s // 2 + int(rng.integers(-s // 16, s // 16 + 1))
    cy = s // 2 + int(rng.integers(-s // 16, s // 16 + 1))
    x0, y0 = cx - mw // 2, cy - mh // 2
    x1, y1 = x0 + mw, y0 + mh
    light = rng.random() < 0.75
    _rect(
        d,
        (x0, y0, x1, y1),
        fill=_jit(rng, (248, 248, 248) if light else (50, 50, 56), 6),
        outline=(40, 40, 40),
    )
    top = y0 + 1
    if accent or rng.random() < 0.5:
        top = y0 + max(2, int(0.07 * s))
        _rect(d, (x0, y0, x1, top), fill=_jit(rng, accent or theme[2], 10))
    r = max(1, int(0.05 * s))  # key / account icon
    _ellipse(d, (cx - r, top + 2, cx + r, top + 2 + 2 * r), fill=_jit(rng, _pick(rng, _BRANDS), 10))
    fy = top + 2 * r + 4
    fh = max(2, int(0.07 * s))
    text = (90, 90, 90) if light else (190, 190, 190)
    for _ in range(2):
        _rect(d, (x0 + 3, fy, x0 + 3 + mw // 3, fy), fill=text)  # field label
        fy += 2
        _rect(
            d,
            (x0 + 3, fy, x1 - 3, fy + fh),
            fill=(255, 255, 255) if light else (30, 30, 30),
            outline=(120, 120, 120),
        )
        fy += fh + max(1, int(0.03 * s))
    bw = max(3, mw // 4)
    by = min(y1 - 2, fy + 1)
    _rect(d, (x1 - 3 - bw, by - max(2, int(0.06 * s)), x1 - 3, by), fill=_jit(rng, (0, 110, 220), 15))
    _rect(d, (x1 - 6 - 2 * bw, by - max(2, int(0.06 * s)), x1 - 6 - bw, by), fill=(200, 200, 200))


_TEMPLATES: dict[str, Callable] = {
    "normal": _normal,
    "phishing_page": _phishing_page,
    "fake_av_popup": _fake_av_popup,
    "ransom_note": _ransom_note,
    "adware_overlay": _adware_overlay,
    "credential_prompt": _credential_prompt,
}


def _style(label: str) -> tuple[Callable, Color | None, bool]:
    """Template, signature colour and mirroring for a class; custom names are hashed onto a template."""
    if label in _TEMPLATES:
        return _TEMPLATES[label], None, False
    h = hashlib.sha256(label.encode("utf-8")).digest()
    template = list(_TEMPLATES.values())[h[0] % len(_TEMPLATES)]
    # A saturated colour: one channel high, one low, the third anywhere.
    hi = h[1] % 3
    lo = (hi + 1 + h[2] % 2) % 3
    accent = [0, 0, 0]
    accent[hi], accent[lo], accent[3 - hi - lo] = 200 + h[3] % 56, h[4] % 60, h[5]
    return template, (accent[0], accent[1], accent[2]), bool(h[6] & 1)


def render(label: str, rng: np.random.Generator, size: int = 64) -> Image.Image:
    """One RGB size×size screenshot of class `label`, drawn from `rng`."""
    if size < MIN_SIZE:
        raise ValueError(f"size must be at least {MIN_SIZE}, got {size}")
    template, accent, mirror = _style(label)
    img = Image.new("RGB", (size, size))
    # RGBA drawing mode so translucent fills (the dimmed backdrop) blend onto the RGB image.
    d = ImageDraw.Draw(img, "RGBA")
    theme = _THEMES[int(rng.integers(len(_THEMES)))]
    template(d, rng, size, theme, accent)
    if template is not _normal and rng.random() < _OCCLUDED:
        # The user moved windows over it: part of the evidence is gone, as on real screenshots.
        for _ in range(int(rng.integers(1, 3))):
            _app_window(d, rng, size, theme, None, False)
    _distractors(d, rng, size)
    if mirror:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    amp = int(rng.integers(0, 16))
    if amp:
        noise = rng.integers(-amp, amp + 1, (size, size, 3), dtype=np.int16)
        img = Image.fromarray(np.clip(np.asarray(img, np.int16) + noise, 0, 255).astype(np.uint8), "RGB")
    return img
