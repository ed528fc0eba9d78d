"""Every input image is read by one rule (composer.images.to_rgb / read_image_file): I2V images, a causal model's
start image and the server's base64 images. 16-bit grey is scaled to 8 bits (not clipped to white, not wrapped
to black), CMYK is converted (not read as RGB), palettes are expanded, alpha is dropped, and a mode with no such
reading is one clear error."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from composer.errors import InvalidInputError
from composer.images import load_image, read_image_file, to_rgb
from composer.video import read_frames

GREY_75 = 0xC000  # 75 % of 16-bit white: 191 in 8 bits (round(49152 / 257))
RED = (255, 0, 0)


def grey16(mode: str = "I;16") -> Image.Image:
    image = Image.fromarray(np.full((4, 6), GREY_75, dtype=np.uint16))
    return image if image.mode == mode else image.convert(mode)


def cmyk_red() -> Image.Image:
    return Image.new("CMYK", (6, 4), (0, 255, 255, 0))


def palette(transparent: bool) -> Image.Image:
    image = Image.new("P", (6, 4), 1)
    image.putpalette([0, 0, 0, *RED] + [0, 0, 0] * 254)
    if transparent:
        image.info["transparency"] = 1
    return image


# mode -> (an image in that mode, the RGB pixel it reads as)
CASES = {
    "I;16 (16-bit grey PNG)": (grey16, (191, 191, 191)),
    "I (32-bit int grey)": (lambda: grey16("I"), (191, 191, 191)),
    "F (float grey in [0, 1])": (lambda: Image.fromarray(np.full((4, 6), 0.75, dtype=np.float32)), (191, 191, 191)),
    "1 (bilevel)": (lambda: Image.new("1", (6, 4), 1), (255, 255, 255)),
    "L": (lambda: Image.new("L", (6, 4), 191), (191, 191, 191)),
    "LA (grey + alpha)": (lambda: Image.new("LA", (6, 4), (191, 0)), (191, 191, 191)),
    "P": (lambda: palette(False), RED),
    "P with transparency": (lambda: palette(True), RED),
    "PA": (lambda: palette(False).convert("PA"), RED),
    "RGB": (lambda: Image.new("RGB", (6, 4), RED), RED),
    "RGBA (alpha dropped)": (lambda: Image.new("RGBA", (6, 4), (*RED, 0)), RED),
    "CMYK": (cmyk_red, RED),
    "YCbCr": (lambda: Image.new("RGB", (6, 4), RED).convert("YCbCr"), None),  # JPEG's own rounding
}


@pytest.mark.parametrize("name", CASES)
def test_every_mode_reads_as_8_bit_rgb(name):
    make, expected = CASES[name]
    image = to_rgb(make())
    assert image.mode == "RGB" and image.size == (6, 4)
    pixel = np.asarray(image)[0, 0]
    if expected is None:
        assert np.abs(pixel.astype(int) - RED).max() <= 2
    else:
        assert tuple(pixel) == expected


@pytest.mark.parametrize("value, expected", [(0, 0), (257, 1), (0x8000, 128), (GREY_75, 191), (65535, 255)])
def test_16_bit_grey_is_scaled_by_1_over_257(value, expected):
    image = Image.fromarray(np.full((2, 2), value, dtype=np.uint16))
    assert np.asarray(to_rgb(image))[0, 0, 0] == expected


@pytest.mark.parametrize("make, text", [
    (lambda: Image.fromarray(np.full((2, 2), 2.0, dtype=np.float32)), "float grey pixels (mode F) in [0, 1]"),
    (lambda: Image.fromarray(np.full((2, 2), np.nan, dtype=np.float32)), "float grey pixels (mode F) in [0, 1]"),
    (lambda: Image.fromarray(np.full((2, 2), 70000, dtype=np.int32)), "16-bit grey pixels (0-65535)"),
])
def test_modes_without_a_reading_are_clear_errors(make, text):
    with pytest.raises(InvalidInputError, match=r"image = PIL image 2x2 .*: expected " + text.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        to_rgb(make())


@pytest.mark.parametrize("name, suffix", [("I;16 (16-bit grey PNG)", ".png"), ("LA (grey + alpha)", ".png"),
                                          ("P with transparency", ".png"), ("RGBA (alpha dropped)", ".png"),
                                          ("CMYK", ".jpg")])
def test_files_read_the_same_in_every_reader(name, suffix, tmp_path):
    """The I2V loader, the start-image reader (read_frames) and read_image_file agree, for files Pillow writes."""
    make, expected = CASES[name]
    path = tmp_path / f"input{suffix}"
    make().save(path)
    reference = np.asarray(read_image_file(path))
    assert np.array_equal(np.asarray(load_image(str(path))), reference)
    frames = read_frames(path)
    assert frames.shape == (1, 4, 6, 3) and frames.dtype == np.uint8
    assert np.array_equal(frames[0], reference)
    tolerance = 2 if suffix == ".jpg" else 0  # JPEG is lossy
    assert np.abs(reference[0, 0].astype(int) - expected).max() <= tolerance


def test_exif_orientation_is_applied_as_diffusers_load_image_does(tmp_path):
    image = Image.new("RGB", (6, 4), RED)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    image.save(tmp_path / "rotated.jpg", exif=exif)
    assert read_image_file(tmp_path / "rotated.jpg").size == (4, 6)
    assert read_frames(tmp_path / "rotated.jpg").shape == (1, 6, 4, 3)


def test_an_unreadable_file_names_it(tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(InvalidInputError, match=f"could not read the image {path}: expected a readable image file"):
        read_frames(path)


def test_served_base64_images_follow_the_same_rule():
    from composer.serve.requests import RequestProblem, decode_image

    buffer = io.BytesIO()
    grey16().save(buffer, format="PNG")
    image = decode_image(base64.b64encode(buffer.getvalue()).decode(), "image")
    assert image.mode == "RGB" and tuple(np.asarray(image)[0, 0]) == (191, 191, 191)
    buffer = io.BytesIO()
    Image.fromarray(np.full((2, 2), 2.0, dtype=np.float32)).save(buffer, format="TIFF")
    with pytest.raises(RequestProblem, match=r"float grey pixels \(mode F\) in \[0, 1\]"):
        decode_image(base64.b64encode(buffer.getvalue()).decode(), "image")


@pytest.mark.parametrize("name", ["LA (grey + alpha)", "I;16 (16-bit grey PNG)", "CMYK"])
def test_cli_start_image_of_any_mode_starts_the_video(name, cli, tiny_causal_dir, tmp_path, monkeypatch):
    """`composer generate --start-image`: a grey+alpha PNG once crashed the start-frame stage (2 channels), a
    16-bit one started from black, a CMYK JPEG from cyan. The pipeline now gets the frame every reader gives."""
    import composer.pipelines.causal_wan as causal_wan

    seen = []
    real = causal_wan.StartFrames

    def record(frames):
        seen.append(frames)
        return real(frames)

    monkeypatch.setattr(causal_wan, "StartFrames", record)
    make, expected = CASES[name]
    path = tmp_path / ("start.jpg" if name == "CMYK" else "start.png")
    make().save(path)
    code, _, err = cli("generate", "--model-path", tiny_causal_dir, "--prompt", "x", "--start-image", path,
                       "--height", "32", "--width", "48", "--num-frames", "9", "--seed", "0", "--no-progress",
                       "--output", tmp_path / "out/")
    assert code == 0, err
    (frames,) = seen
    assert frames.shape == (1, 4, 6, 3) and frames.dtype == np.uint8
    assert np.abs(frames[0, 0, 0].astype(int) - expected).max() <= (2 if name == "CMYK" else 0)
