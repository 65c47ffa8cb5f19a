#!/usr/bin/env python3
"""Generate the demo's sample images into src/tensorwire/encoder/samples/ (deterministic; committed).

Patterns made here, so the repository ships no third-party pictures:
- checker_448.png      checkerboard with a colour gradient, 448x448
- rings_640x480.jpg    concentric rings, 640x480
- bars_1024x576.png    colour bars plus a diagonal ramp, 1024x576 (a 16:9 frame)
- scene_2048x1365.jpg  a synthetic landscape the size of the seed's benchmark image (2048x1365 JPEG)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

OUT = Path(__file__).resolve().parents[1] / "src" / "tensorwire" / "encoder" / "samples"


def checker(size: int = 448) -> Image.Image:
    y, x = np.mgrid[0:size, 0:size]
    cells = ((x // 32 + y // 32) % 2).astype(np.float32)
    rgb = np.stack([cells * 200 + x / size * 55, (1 - cells) * 180 + y / size * 75, 255 * x * y / size**2], -1)
    return Image.fromarray(rgb.clip(0, 255).astype(np.uint8))


def rings(w: int = 640, h: int = 480) -> Image.Image:
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = np.hypot(x - w / 2, y - h / 2)
    rgb = np.stack([128 + 127 * np.sin(r / 9), 128 + 127 * np.sin(r / 13 + 1), 128 + 127 * np.cos(r / 17)], -1)
    return Image.fromarray(rgb.astype(np.uint8))


def bars(w: int = 1024, h: int = 576) -> Image.Image:
    colours = [
        (235, 235, 235),
        (235, 235, 16),
        (16, 235, 235),
        (16, 235, 16),
        (235, 16, 235),
        (235, 16, 16),
        (16, 16, 235),
    ]
    img = Image.new("RGB", (w, h))
    d = ImageDraw.Draw(img)
    bw = w // len(colours)
    for i, c in enumerate(colours):
        d.rectangle([i * bw, 0, (i + 1) * bw, h * 2 // 3], fill=c)
    for x in range(w):
        v = int(255 * x / (w - 1))
        d.line([x, h * 2 // 3, x, h], fill=(v, v, 255 - v))
    return img


def scene(w: int = 2048, h: int = 1365) -> Image.Image:
    rng = np.random.default_rng(1353)  # the seed PR's number: fixed, so the JPEG is byte-stable per Pillow
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    sky = np.stack([90 + 80 * y / h, 140 + 60 * y / h, 235 - 40 * y / h], -1)
    horizon = h * 0.62 + 40 * np.sin(x / 170) + 25 * np.sin(x / 53 + 2)
    ground = np.stack([60 + 50 * np.sin(x / 90) ** 2, 120 + 40 * (y - h * 0.6) / h, 50 + 0 * x], -1)
    rgb = np.where((y > horizon)[..., None], ground, sky)
    rgb += rng.normal(0, 6, size=rgb.shape)  # texture, so JPEG and the encoder see detail
    img = Image.fromarray(rgb.clip(0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    d.ellipse([1500, 180, 1700, 380], fill=(255, 225, 120))  # sun
    for i in range(9):  # hills of trees
        cx = 120 + i * 220 + int(rng.integers(-40, 40))
        base = int(h * 0.62 + 40 * np.sin(cx / 170))
        d.polygon([(cx, base - 260), (cx - 90, base + 30), (cx + 90, base + 30)], fill=(30, 90 + 10 * i, 40))
    return img.filter(ImageFilter.GaussianBlur(0.8))


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    checker().save(OUT / "checker_448.png", optimize=True)
    rings().save(OUT / "rings_640x480.jpg", quality=85)
    bars().save(OUT / "bars_1024x576.png", optimize=True)
    scene().save(OUT / "scene_2048x1365.jpg", quality=85)
    total = 0
    for p in sorted(OUT.iterdir()):
        total += p.stat().st_size
        print(f"{p.name:24s} {p.stat().st_size / 1024:8.1f} KiB")
    print(f"{'total':24s} {total / 1024:8.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
