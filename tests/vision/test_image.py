"""strata.vision.image against transformers' Qwen2VLImageProcessorPil, the PIL backend of the image processor that
qwen3_5_moe and qwen4_exp ship (the torchvision backend is not installed here), and its smart_resize.

pixel_values are compared bit for bit: both resize in uint8 through the same PIL call, rescale in float64 then cast
to float32, and normalize in float32, so every element is the same IEEE computation on the same uint8 value."""
from __future__ import annotations

import base64
import io
import itertools

import numpy as np
import pytest
from PIL import Image, ImageOps
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from strata.errors import ModelLoadError
from strata.vision.image import (ImageError, ImageSettings, decode_data_url, image_hash, image_tokens, preprocess,
                                 smart_resize)

# Qwen3.5's preprocessor_config.json (Qwen3-VL's is the same)
QWEN35 = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
          "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
          "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}
# the same with small pixel bounds: 20x30 is scaled up to min, 1200x900 down to max, and the tests stay fast
SMALL = {**QWEN35, "size": {"shortest_edge": 8192, "longest_edge": 409600}}
# an older file's form (top-level min/max_pixels) with Qwen2-VL's patch and CLIP's mean and std
OLDER = {"min_pixels": 3136, "max_pixels": 200704, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
         "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
         "resample": 3, "rescale_factor": 0.00392156862745098, "do_convert_rgb": True}
LIMIT = 10_000_000


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _noise(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (h, w, channels) if channels > 1 else (h, w)
    return _rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _palette_png() -> bytes:
    img = Image.fromarray(_noise(150, 100, seed=5)).quantize(64)
    alpha = bytes(_rng(6).integers(0, 256, 64, dtype=np.uint8))     # a tRNS entry per palette colour
    return _encode(img, "PNG", transparency=alpha)


def _exif_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6                                                # orientation: rotate 90 degrees to view
    return _encode(Image.fromarray(_noise(120, 200, seed=8)), "JPEG", exif=exif, quality=90)


# (name, bytes, media type, whether HF's load_image gives the same RGB: not where transparency is composited)
IMAGES = [
    ("tiny 20x30 png", lambda: _encode(Image.fromarray(_noise(20, 30, seed=1)), "PNG"), "image/png", True),
    ("640x480 png", lambda: _encode(Image.fromarray(_noise(480, 640, seed=2)), "PNG"), "image/png", True),
    ("333x517 png", lambda: _encode(Image.fromarray(_noise(517, 333, seed=3)), "PNG"), "image/png", True),
    ("1200x900 png", lambda: _encode(Image.fromarray(_noise(900, 1200, seed=4)), "PNG"), "image/png", True),
    ("jpeg", lambda: _encode(Image.fromarray(_noise(333, 517, seed=7)), "JPEG", quality=85), "image/jpeg", True),
    ("webp", lambda: _encode(Image.fromarray(_noise(240, 320, seed=9)), "WEBP", quality=80), "image/webp", True),
    ("rgba png", lambda: _encode(Image.fromarray(_noise(101, 203, 4, seed=10), "RGBA"), "PNG"), "image/png",
     False),
    ("palette png with alpha", _palette_png, "image/png", False),
    ("rgb png with a transparent colour", lambda: _encode(
        Image.fromarray(_noise(64, 96, seed=11) // 128 * 255), "PNG", transparency=(255, 0, 255)), "image/png",
     False),
    ("grayscale png", lambda: _encode(Image.fromarray(_noise(77, 131, 1, seed=12), "L"), "PNG"), "image/png",
     True),
    ("grayscale+alpha png", lambda: _encode(Image.fromarray(_noise(70, 90, 2, seed=13), "LA"), "PNG"),
     "image/png", False),
    ("jpeg with exif orientation", _exif_jpeg, "image/jpeg", True),
]


@pytest.fixture(scope="module")
def processors() -> dict[str, Qwen2VLImageProcessorPil]:
    return {name: Qwen2VLImageProcessorPil(**cfg) for name, cfg in (("small", SMALL), ("qwen35", QWEN35),
                                                                     ("older", OLDER))}


def _hf(processor: Qwen2VLImageProcessorPil, img: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    out = processor(img, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def _check(rgb: np.ndarray, hf_image: Image.Image, processor: Qwen2VLImageProcessorPil, cfg: dict) -> None:
    settings = ImageSettings.from_preprocessor(cfg, "preprocessor_config.json")
    pixels, grid = preprocess(rgb, settings)
    hf_pixels, hf_grid = _hf(processor, hf_image)
    assert hf_grid.tolist() == [list(grid)]
    assert pixels.dtype == np.float32 and pixels.shape == hf_pixels.shape
    np.testing.assert_array_equal(pixels, hf_pixels)                 # bit for bit: see the module docstring
    merge = settings.merge_size
    assert image_tokens(grid, merge) == int(np.prod(hf_grid)) // merge ** 2 == \
        processor.get_number_of_image_patches(*rgb.shape[:2]) // merge ** 2


@pytest.mark.parametrize("name, make, media_type, same_as_load_image", IMAGES, ids=[i[0] for i in IMAGES])
def test_decode_and_preprocess_equal_transformers(processors, name, make, media_type, same_as_load_image):
    data = make()
    url = _url(data, media_type)
    rgb = decode_data_url(url, LIMIT)
    assert rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3
    # the processor's own RGB conversion (transparency onto white) of the upright image
    hf_image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    if same_as_load_image:
        # transformers' loader for a data URL: the EXIF orientation, then convert("RGB")
        np.testing.assert_array_equal(rgb, np.array(load_image(url)))
    np.testing.assert_array_equal(rgb, convert_to_rgb(hf_image, return_numpy=True))
    if name == "jpeg with exif orientation":
        assert rgb.shape == (200, 120, 3)
    _check(rgb, hf_image, processors["small"], SMALL)
    _, grid = preprocess(rgb, ImageSettings.from_preprocessor(SMALL, "p.json"))
    if name == "tiny 20x30 png":                                    # scaled up to min_pixels
        assert grid == (1, 6, 8) and 96 * 128 >= SMALL["size"]["shortest_edge"]
    if name == "1200x900 png":                                      # scaled down to max_pixels
        assert grid == (1, 34, 46) and 544 * 736 <= SMALL["size"]["longest_edge"] < 1200 * 900


def test_transparency_is_composited_onto_white():
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3], rgba[0, 1, 3], rgba[0, 2, 3] = 0, 255, 128
    rgb = decode_data_url(_url(_encode(Image.fromarray(rgba, "RGBA"), "PNG"), "image/png"), LIMIT)
    assert rgb[0, 0].tolist() == [255, 255, 255]                     # fully transparent: white, not the hidden red
    assert rgb[0, 1].tolist() == [200, 0, 0]
    assert rgb[0, 2].tolist() == [227, 127, 127]                     # 200 * 128/255 + 255 * 127/255


@pytest.mark.parametrize("processor, cfg, h, w", [("qwen35", QWEN35, 517, 333), ("qwen35", QWEN35, 40, 50),
                                                   ("older", OLDER, 333, 517), ("older", OLDER, 1000, 700)])
def test_other_settings_equal_transformers(processors, processor, cfg, h, w):
    rgb = _noise(h, w, seed=h + w)
    _check(rgb, Image.fromarray(rgb), processors[processor], cfg)


def test_smart_resize_equals_transformers():
    sides = [1, 2, 15, 16, 17, 27, 28, 31, 32, 33, 47, 48, 80, 100, 112, 333, 517, 1000, 3000, 4097, 9000]
    bounds = [(56 * 56, 28 * 28 * 1280), (65536, 16777216), (8192, 409600), (32 * 32, 32 * 32)]
    for (h, w), factor, (lo, hi) in itertools.product(itertools.product(sides, sides), (28, 32), bounds):
        try:
            expected = hf_smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
        except ValueError:
            with pytest.raises(ImageError, match="200 times"):
                smart_resize(h, w, factor, lo, hi)
            continue
        assert smart_resize(h, w, factor, lo, hi) == expected, (h, w, factor, lo, hi)


def test_settings_from_preprocessor():
    assert ImageSettings.from_preprocessor(None, "absent") == ImageSettings() == \
        ImageSettings.from_preprocessor(QWEN35, "preprocessor_config.json")
    assert ImageSettings() == ImageSettings(16, 2, 2, 65536, 16777216, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    older = ImageSettings.from_preprocessor(OLDER, "p.json")
    assert (older.patch_size, older.min_pixels, older.max_pixels) == (14, 3136, 200704)
    # top-level min/max_pixels win over size, as in transformers' __init__
    both = ImageSettings.from_preprocessor({**QWEN35, "max_pixels": 100000}, "p.json")
    assert (both.min_pixels, both.max_pixels) == (65536, 100000)
    hf = Qwen2VLImageProcessorPil(**{**QWEN35, "max_pixels": 100000})
    assert (hf.size["shortest_edge"], hf.size["longest_edge"]) == (both.min_pixels, both.max_pixels)
    assert ImageSettings.from_preprocessor({"image_mean": 0.25}, "p.json").image_mean == (0.25, 0.25, 0.25)


@pytest.mark.parametrize("change, words", [
    ({"patch_size": "16"}, "patch_size is '16'"),
    ({"merge_size": 0}, "merge_size is 0"),
    ({"temporal_patch_size": True}, "temporal_patch_size is True"),
    ({"size": {"shortest_edge": 65536, "longest_edge": -1}}, "size.longest_edge is -1"),
    ({"size": {"shortest_edge": 65536}}, 'no "longest_edge"'),
    ({"size": 448}, "size is 448"),
    ({"min_pixels": 1.5}, "min_pixels is 1.5"),
    ({"size": {"shortest_edge": 100, "longest_edge": 99}}, "over the maximum"),
    ({"image_mean": [0.5, 0.5]}, "image_mean is [0.5, 0.5]"),
    ({"image_std": [0.5, 0, 0.5]}, "image_std is [0.5, 0, 0.5]; it must be a list of 3 non-zero numbers"),
    ({"resample": 2}, "resample is 2"),
    ({"rescale_factor": 1.0}, "rescale_factor is 1.0"),
    ({"do_normalize": False}, "do_normalize is False"),
])
def test_bad_preprocessor_values(change, words):
    with pytest.raises(ModelLoadError, match="^my/preprocessor_config.json: ") as e:
        ImageSettings.from_preprocessor({**QWEN35, **change}, "my/preprocessor_config.json")
    assert words in str(e.value)


def _png_header(width: int, height: int) -> bytes:
    """A PNG's signature and header claiming width x height RGB, with no pixel data."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


PNG_100x50 = _encode(Image.fromarray(_noise(50, 100)), "PNG")
BAD_URLS = [
    ("https://example.com/cat.png", ["data URL", "remote URLs are not fetched"]),
    ("/tmp/cat.png", ["data URL", "remote URLs are not fetched"]),
    (None, ["data URL"]),
    (_url(_encode(Image.new("RGB", (4, 4)), "GIF"), "image/gif"), ["'image/gif' is not supported",
                                                                   "image/jpeg, image/jpg, image/png, image/webp"]),
    ("data:text/plain;base64,aGk=", ["'text/plain' is not supported"]),
    ("data:;base64,aGk=", ["'(none)' is not supported"]),
    ("data:image/png," + PNG_100x50.decode("latin-1"), ["must be base64-encoded"]),
    ("data:image/png;base64", ["needs a comma"]),
    ("data:image/png;base64,iVBORw0KGgo@@@", ["base64 is invalid"]),
    ("data:image/png;base64,iVBORw0KGgoAA", ["base64 is invalid"]),              # bad padding
    ("data:image/png;base64,", ["the image is empty"]),
    (_url(b"this is not an image", "image/png"), ["not a PNG, JPEG or WebP image"]),
    (_url(_encode(Image.new("RGB", (4, 4)), "GIF"), "image/png"), ["not a PNG, JPEG or WebP image"]),
    (_url(PNG_100x50[: len(PNG_100x50) // 2], "image/png"), ["not a PNG, JPEG or WebP image"]),   # truncated
    (_url(_png_header(0, 5), "image/png"), ["not a PNG, JPEG or WebP image"]),     # Pillow refuses a 0-wide PNG
]


@pytest.mark.parametrize("url, words", BAD_URLS, ids=[str(i) for i in range(len(BAD_URLS))])
def test_bad_images(url, words):
    with pytest.raises(ImageError) as e:
        decode_data_url(url, LIMIT)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value)


def test_too_many_pixels():
    url = _url(PNG_100x50, "image/png")
    assert decode_data_url(url, 5000).shape == (50, 100, 3)
    with pytest.raises(ImageError, match=r"the image is 100x50 = 5000 pixels, over the limit of 4999 pixels"):
        decode_data_url(url, 4999)
    # refused from the header, before any pixel is decoded (this one has none)
    with pytest.raises(ImageError, match=r"the image is 10000x5000 = 50000000 pixels, over the limit of 4999 pixels"):
        decode_data_url(_url(_png_header(10000, 5000), "image/png"), 4999)
    # past Pillow's own decompression-bomb bound, Pillow refuses it when opening
    with pytest.raises(ImageError, match=r"the image is too large .*; the limit is 4999 pixels"):
        decode_data_url(_url(_png_header(20000, 20000), "image/png"), 4999)


def test_bad_shapes():
    with pytest.raises(ImageError, match=r"zero size \(5x0\)"):
        preprocess(np.zeros((0, 5, 3), np.uint8), ImageSettings())
    with pytest.raises(ImageError, match="at most 200 times its shorter side"):
        preprocess(np.zeros((1, 201, 3), np.uint8), ImageSettings())
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        preprocess(np.zeros((8, 8, 4), np.uint8), ImageSettings())


def test_image_tokens():
    assert image_tokens((1, 6, 8), 2) == 12
    assert image_tokens((1, 64, 48), 2) == 768
    with pytest.raises(ValueError):
        image_tokens((1, 5, 8), 2)                                 # 5 rows: not whole 2x2 blocks


def test_image_hash():
    a = _noise(24, 36, seed=20)
    png = decode_data_url(_url(_encode(Image.fromarray(a), "PNG"), "image/png"), LIMIT)
    webp = decode_data_url(_url(_encode(Image.fromarray(a), "WEBP", lossless=True), "image/webp"), LIMIT)
    assert image_hash(png) == image_hash(webp) == image_hash(a.copy())           # pixels, not their encoding
    b = a.copy()
    b[3, 4, 1] ^= 1
    assert image_hash(b) != image_hash(a)
    assert image_hash(a.reshape(36, 24, 3)) != image_hash(a)                    # same bytes, other shape
    assert image_hash(np.asfortranarray(a)) == image_hash(a)
    # stable across runs and processes: a later cache may persist it
    assert image_hash(np.arange(12, dtype=np.uint8).reshape(2, 2, 3)) == HASH_2x2
    assert len(HASH_2x2) == 32


HASH_2x2 = "4a9db56d54d3fa307cbd2c56b8e624ad"
