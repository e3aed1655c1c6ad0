"""Synthetic screenshots for vision-language tests: deterministic images that look like a desktop
(a title bar, windows, lines of "text", buttons, and a photo-like picture that does not compress),
so they weigh what real screenshots weigh (a 1280x720 PNG is about 250 KB) rather than a flat
colour's few KB.

    png = screenshot(1280, 720, seed=3)              # bytes of a PNG
    jpeg = screenshot(640, 360, seed=3, fmt="JPEG")  # bytes of a JPEG
    part = image_part(png)                           # an OpenAI image_url content part (data URI)

The same (width, height, seed, fmt) gives the same bytes with the same Pillow; two seeds give two
different images (a changed screen), so sessions can repeat or change a screenshot on purpose.
"""

from __future__ import annotations

import base64
import io
import random

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg"}


def screenshot(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A `width` x `height` RGB screenshot drawn from `seed`, encoded as PNG or JPEG."""
    from PIL import Image, ImageDraw

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if width < 16 or height < 16:
        raise ValueError("a screenshot is at least 16 x 16 pixels")
    rng = random.Random(f"screenshot/{width}x{height}/{seed}")

    def colour(low: int, high: int) -> tuple[int, int, int]:
        return (rng.randint(low, high), rng.randint(low, high), rng.randint(low, high))

    image = Image.new("RGB", (width, height), colour(40, 90))
    draw = ImageDraw.Draw(image)
    bar = max(8, height // 30)
    draw.rectangle((0, 0, width, bar), fill=colour(20, 50))
    for _ in range(rng.randint(2, 4)):  # windows, each with a title bar and lines of text
        left, top = rng.randint(0, width * 2 // 3), rng.randint(bar, height * 2 // 3)
        right = min(width - 1, left + rng.randint(width // 4, width // 2))
        bottom = min(height - 1, top + rng.randint(height // 4, height // 2))
        draw.rectangle((left, top, right, bottom), fill=colour(200, 250), outline=colour(0, 80))
        draw.rectangle((left, top, right, top + bar), fill=colour(60, 160))
        line_height = max(4, bar // 2)
        y = top + bar + line_height
        while y + line_height < bottom:
            x = left + line_height
            while x < right - line_height:  # "words": dark blocks of varying width
                word = rng.randint(2, 9) * max(2, line_height // 2)
                if x + word >= right - line_height:
                    break
                draw.rectangle((x, y, x + word, y + line_height // 2), fill=colour(0, 70))
                x += word + line_height
            y += line_height * 2
        button = (right - 6 * bar, bottom - 2 * bar, right - bar, bottom - bar // 2)
        if button[0] > left and button[1] > top + bar:
            draw.rectangle(button, fill=colour(30, 200), outline=colour(0, 60))
    # A picture (a photo on a web page, a wallpaper): a twelfth of the screen in noise.
    picture_w, picture_h = max(1, width // 3), max(1, height // 4)
    picture = Image.frombytes("RGB", (picture_w, picture_h), rng.randbytes(picture_w * picture_h * 3))
    image.paste(picture, (rng.randint(0, width - picture_w), rng.randint(bar, height - picture_h)))
    out = io.BytesIO()
    if fmt == "PNG":
        image.save(out, format="PNG", optimize=False, compress_level=6)
    else:
        image.save(out, format="JPEG", quality=85, optimize=False, subsampling=2)
    return out.getvalue()


def data_uri(data: bytes, fmt: str = "PNG") -> str:
    """`data:image/png;base64,...` (or image/jpeg) for the image's bytes."""
    return f"data:{FORMATS[fmt]};base64,{base64.b64encode(data).decode('ascii')}"


def image_part(data: bytes, fmt: str = "PNG", detail: str | None = None) -> dict:
    """An OpenAI chat `image_url` content part carrying the image as a data URI."""
    url: dict = {"url": data_uri(data, fmt)}
    if detail is not None:
        url["detail"] = detail
    return {"type": "image_url", "image_url": url}
