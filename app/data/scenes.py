"""Procedural behaviour screenshots: one RGB image of a class, drawn from a random generator.

Each class has a recognisable structure (a browser login page, a red-banded alert dialog, a dark
full-screen ransom note, ...) drawn over shared desktop themes with random positions, distractors
and pixel noise, so that a small CNN learns the classes at 32-64 px but not trivially. Class names
outside DEFAULT_CLASSES are hashed onto a template with their own colour. `app.data.synth` turns these
images into device traffic; the desktop under them is `app.data.desktop`'s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageDraw

from app.data.desktop import (
    ADS,
    BRANDS,
    DARK,
    THEMES,
    WARN,
    Color,
    app_window,
    desktop,
    distractors,
    ellipse,
    jit,
    login_form,
    pick,
    rand_box,
    rect,
    scene,
    text_lines,
    window,
)

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

# Class templates. `accent` overrides the class's signature colour; custom classes use it.


def _normal(d, rng, s, theme, accent):
    scene(d, rng, s, theme, 1, 3, accent, confusers=True)
    if rng.random() < 0.12:  # a harmless system dialog, grey and blue: the fake alert's look-alike
        box = rand_box(rng, s, (0.3, 0.5), (0.25, 0.4))
        area = window(d, rng, s, box, theme, (0, 90, 180))
        text_lines(
            d, rng, (area[0] + 2, area[1] + 1, area[2] - 2, area[3] - 3), theme[3], max(2, int(0.05 * s))
        )


def _phishing_page(d, rng, s, theme, accent):
    desktop(d, rng, s, theme)
    box = rand_box(rng, s, (0.78, 1.0), (0.78, 1.0))
    x0, y0, x1, y1 = box
    tab = max(2, int(0.06 * s))
    bar = max(2, int(0.08 * s))
    rect(d, box, fill=(255, 255, 255), outline=(90, 90, 90))
    rect(d, (x0, y0, x1, y0 + tab), fill=jit(rng, theme[2], 10))
    rect(d, (x0 + 2, y0 + 1, x0 + (x1 - x0) // 3, y0 + tab), fill=jit(rng, (235, 235, 235), 8))
    rect(d, (x0, y0 + tab + 1, x1, y0 + tab + bar), fill=jit(rng, (218, 220, 224), 6))
    # Address field with a red "not secure" mark: the page's tell-tale.
    ay0, ay1 = y0 + tab + 2, y0 + tab + bar - 1
    rect(d, (x0 + bar, ay0, x1 - 2, ay1), fill=(255, 255, 255), outline=(170, 170, 170))
    rect(d, (x0 + bar + 1, ay0 + 1, x0 + bar + max(2, bar // 2), ay1 - 1), fill=(210, 30, 30))
    page = (x0 + 1, y0 + tab + bar + 1, x1 - 1, y1 - 1)
    brand = accent or pick(rng, BRANDS)
    if rng.random() < 0.6:  # brand header strip
        rect(d, (page[0], page[1], page[2], page[1] + max(2, int(0.06 * s))), fill=jit(rng, brand))
    if rng.random() < 0.4:
        rect(d, page, fill=jit(rng, (240, 244, 250), 8))
    login_form(d, rng, s, page, brand, (255, 255, 255))
    text_lines(
        d,
        rng,
        (page[0] + 2, page[3] - max(3, int(0.1 * s)), page[2] - 2, page[3]),
        (150, 150, 150),
        max(2, int(0.04 * s)),
    )


def _fake_av_popup(d, rng, s, theme, accent):
    scene(d, rng, s, theme, 0, 2)
    for _ in range(1 + int(rng.random() < 0.3)):
        box = rand_box(rng, s, (0.38, 0.62), (0.35, 0.55))
        x0, y0, x1, y1 = box
        w, h = x1 - x0, y1 - y0
        rect(d, box, fill=jit(rng, (245, 245, 245), 8), outline=(60, 60, 60))
        band = accent or pick(rng, WARN)
        by1 = y0 + max(3, int(h * rng.uniform(0.25, 0.38)))
        rect(d, (x0, y0, x1, by1), fill=jit(rng, band, 10))
        # Warning triangle in the band.
        t = max(2, by1 - y0 - 2)
        tx = x0 + 2
        d.polygon(
            ((tx, by1 - 1), (tx + t, by1 - 1), (tx + t // 2, y0 + 1)), fill=(255, 230, 0), outline=(0, 0, 0)
        )
        text_lines(
            d, rng, (x0 + 2, by1 + 2, x1 - 2, y1 - max(3, h // 4)), (60, 60, 60), max(2, int(0.045 * s))
        )
        bh = max(2, int(h * rng.uniform(0.14, 0.22)))
        bw = int(w * rng.uniform(0.65, 0.9))
        bx = x0 + (w - bw) // 2
        button = pick(rng, ((30, 170, 60), (215, 25, 25), (0, 100, 220)))
        rect(d, (bx, y1 - bh - 2, bx + bw, y1 - 2), fill=jit(rng, button))


def _ransom_note(d, rng, s, theme, accent):
    bg = jit(rng, (accent[0] // 3, accent[1] // 3, accent[2] // 3) if accent else pick(rng, DARK), 12)
    rect(d, (0, 0, s - 1, s - 1), fill=bg)
    hot = pick(rng, ((230, 30, 30), (250, 210, 0), (240, 240, 240)))
    left = 2
    if rng.random() < 0.5:  # lock / skull panel
        pw = int(s * rng.uniform(0.18, 0.3))
        rect(d, (2, 2, 2 + pw, s - 3), fill=jit(rng, (bg[0] // 2 + 20, bg[1] // 2, bg[2] // 2), 10))
        r = pw // 3
        cy = s // 3 + int(rng.integers(-s // 10, s // 10 + 1))
        ellipse(d, (2 + pw // 2 - r, cy - r, 2 + pw // 2 + r, cy + r), fill=hot)
        left = pw + 5
    y = 2 + int(rng.integers(0, max(1, s // 12)))
    head = max(2, int(0.08 * s))
    rect(d, (left, y, left + int((s - left) * rng.uniform(0.5, 0.95)), y + head), fill=jit(rng, hot, 15))
    y += head + 2
    text_bottom = int(s * rng.uniform(0.6, 0.72))
    text_lines(
        d,
        rng,
        (left, y, s - 3, text_bottom),
        jit(rng, (225, 225, 225), 25),
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
        rect(d, (bx, by, bx + bw, by + bh), fill=(10, 10, 10), outline=hot)
        for j in range(2):
            sx = bx + (j + 1) * bw // 3
            rect(d, (sx, by + 2, sx + max(0, bw // 10), by + bh - 2), fill=(240, 240, 240))
    if rng.random() < 0.4:  # wallet address field
        rect(d, (left, s - max(3, int(0.07 * s)) - 2, s - 4, s - 3), fill=(235, 235, 235))


def _adware_overlay(d, rng, s, theme, accent):
    scene(d, rng, s, theme, 1, 2)
    for _ in range(int(rng.integers(5, 13))):
        box = rand_box(rng, s, (0.14, 0.38), (0.07, 0.2))
        col = jit(rng, accent if accent and rng.random() < 0.6 else pick(rng, ADS), 25)
        rect(d, box, fill=col)
        x0, y0, x1, y1 = box
        if rng.random() < 0.6:  # slogan stripe in a contrasting colour
            ym = (y0 + y1) // 2
            rect(
                d,
                (x0 + 1, ym, x1 - max(2, (x1 - x0) // 4), ym + (y1 - y0) // 5),
                fill=(255 - col[0], 255 - col[1], 255 - col[2]),
            )
        if rng.random() < 0.5:  # close box
            c = max(1, int(0.03 * s))
            rect(d, (x1 - c - 1, y0 + 1, x1 - 1, y0 + 1 + c), fill=(255, 255, 255), outline=(0, 0, 0))
        if rng.random() < 0.2:  # starburst
            r = max(2, int(0.06 * s))
            ellipse(d, (x0 - r, y0 - r, x0 + r, y0 + r), fill=(255, 255, 0))


def _credential_prompt(d, rng, s, theme, accent):
    scene(d, rng, s, theme, 1, 3)
    rect(d, (0, 0, s - 1, s - 1), fill=(0, 0, 0, int(rng.integers(80, 170))))
    mw, mh = int(s * rng.uniform(0.45, 0.7)), int(s * rng.uniform(0.45, 0.62))
    cx = s // 2 + int(rng.integers(-s // 16, s // 16 + 1))
    cy = s // 2 + int(rng.integers(-s // 16, s // 16 + 1))
    x0, y0 = cx - mw // 2, cy - mh // 2
    x1, y1 = x0 + mw, y0 + mh
    light = rng.random() < 0.75
    rect(
        d,
        (x0, y0, x1, y1),
        fill=jit(rng, (248, 248, 248) if light else (50, 50, 56), 6),
        outline=(40, 40, 40),
    )
    top = y0 + 1
    if accent or rng.random() < 0.5:
        top = y0 + max(2, int(0.07 * s))
        rect(d, (x0, y0, x1, top), fill=jit(rng, accent or theme[2], 10))
    r = max(1, int(0.05 * s))  # key / account icon
    ellipse(d, (cx - r, top + 2, cx + r, top + 2 + 2 * r), fill=jit(rng, pick(rng, BRANDS), 10))
    fy = top + 2 * r + 4
    fh = max(2, int(0.07 * s))
    text = (90, 90, 90) if light else (190, 190, 190)
    for _ in range(2):
        rect(d, (x0 + 3, fy, x0 + 3 + mw // 3, fy), fill=text)  # field label
        fy += 2
        rect(
            d,
            (x0 + 3, fy, x1 - 3, fy + fh),
            fill=(255, 255, 255) if light else (30, 30, 30),
            outline=(120, 120, 120),
        )
        fy += fh + max(1, int(0.03 * s))
    bw = max(3, mw // 4)
    by = min(y1 - 2, fy + 1)
    rect(d, (x1 - 3 - bw, by - max(2, int(0.06 * s)), x1 - 3, by), fill=jit(rng, (0, 110, 220), 15))
    rect(d, (x1 - 6 - 2 * bw, by - max(2, int(0.06 * s)), x1 - 6 - bw, by), fill=(200, 200, 200))


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
    theme = THEMES[int(rng.integers(len(THEMES)))]
    template(d, rng, size, theme, accent)
    if template is not _normal and rng.random() < _OCCLUDED:
        # The user moved windows over it: part of the evidence is gone, as on real screenshots.
        for _ in range(int(rng.integers(1, 3))):
            app_window(d, rng, size, theme, None, False)
    distractors(d, rng, size)
    if mirror:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    amp = int(rng.integers(0, 16))
    if amp:
        noise = rng.integers(-amp, amp + 1, (size, size, 3), dtype=np.int16)
        img = Image.fromarray(np.clip(np.asarray(img, np.int16) + noise, 0, 255).astype(np.uint8), "RGB")
    return img
