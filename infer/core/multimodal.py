"""Images in prompts: preprocessing, the encoder step, and the encoder output cache.

A prompt with images becomes token ids whose image placeholders are runs of the
model's image token, one `ImageItem` per image: where its run starts, how many
rows it has, its content hash and the processor's pixels. The language model's
step reads, for the rows of placeholders it computes, the rows of each image's
encoder output (`mm_rows` / `mm_embeds`, see `models/llava.py`):

- `MultiModalProcessor` runs the checkpoint's own transformers processor
  (AutoProcessor: resize, crop, normalise; the prompt's placeholders expanded to
  one token per feature row) and checks the counts;
- `step_images` (engine) lists, per scheduled request, the image rows a step's
  tokens cover: a chunked prefill may cut through an image, and the next chunk
  reads the rest of the same encoder output;
- `VisionEncoder` (the rank that runs the model) runs the vision graph once per
  image on the first step that needs it, batching a step's new images, and keeps
  outputs by content hash in a cache bounded in rows (least recently used out).

The hash is of the processed pixels, so two requests sending the same picture
share its encoder output and, through `Request.mm_items`, its prefix-cache
blocks; different pictures never do, though their placeholder tokens are equal.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..primitives.types import AttentionMetadata

log = logging.getLogger("infer")

# Images above this many pixels are refused before they are decoded (a decompression bomb).
MAX_IMAGE_PIXELS = 50_000_000


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a prompt: placeholder rows [offset, offset + length) of the prompt."""

    offset: int
    length: int
    hash: bytes
    pixel_values: np.ndarray = field(repr=False)  # [C, H, W] float32, the processor's output

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ImageSlice:
    """A step's share of one image: `count` batch rows from `row` take its feature rows from `first` on."""

    row: int
    first: int
    count: int
    item: ImageItem


def load_image(data: bytes, where: str):
    """A PIL image from encoded bytes; ValueError naming `where` if undecodable or too large."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > MAX_IMAGE_PIXELS:
            raise ValueError(f"{where}: the image is {w}x{h} pixels, over the limit of {MAX_IMAGE_PIXELS}")
        img.load()
    except ValueError:
        raise
    except Image.DecompressionBombError:
        raise ValueError(f"{where}: the image has more pixels than the limit of {MAX_IMAGE_PIXELS}") from None
    except Exception as exc:  # noqa: BLE001 (PIL raises many kinds for a bad file)
        raise ValueError(f"{where}: the data is not a decodable image ({type(exc).__name__}: {exc})") from None
    return img


class MultiModalProcessor:
    """Prompt text and images -> token ids and `ImageItem`s, by the checkpoint's processor."""

    def __init__(self, source, image_token_id: int, rows_per_image: int, limit: int | None = None):
        self.source, self.image_token_id, self.rows_per_image = source, image_token_id, rows_per_image
        self.limit = limit
        self._processor = None

    @property
    def processor(self):
        if self._processor is None:
            import transformers

            logging.getLogger("transformers").setLevel(logging.ERROR)  # the torchvision fallback notice
            self._processor = transformers.AutoProcessor.from_pretrained(str(self.source))
        return self._processor

    @property
    def image_token(self) -> str:
        return self.processor.tokenizer.convert_ids_to_tokens(self.image_token_id)

    def process(self, text: str, images: Sequence[Any], where: str = "the prompt",
                add_special_tokens: bool = True) -> tuple[list[int], list[ImageItem]]:
        """`add_special_tokens` False for text a chat template rendered (it has its BOS already)."""
        from PIL import Image

        images = list(images)
        if self.limit is not None and len(images) > self.limit:
            raise ValueError(f"{where} has {len(images)} images, more than the limit of {self.limit} per prompt "
                             "(--limit-mm-per-prompt)")
        for i, img in enumerate(images):
            if not isinstance(img, Image.Image):
                raise TypeError(f"{where}: image {i} must be a PIL.Image, got {type(img).__name__}")
        marks = text.count(self.image_token)
        if marks != len(images):
            raise ValueError(f"{where} has {marks} image placeholders ({self.image_token!r}) but {len(images)} images "
                             "were given; put one placeholder where each image goes")
        if not images:
            return list(self.processor.tokenizer(text, add_special_tokens=add_special_tokens).input_ids), []
        images = [img.convert("RGB") if img.mode != "RGB" else img for img in images]
        out = self.processor(text=[text], images=images, return_tensors="np", add_special_tokens=add_special_tokens)
        ids = [int(t) for t in np.asarray(out["input_ids"])[0]]
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        return ids, self.items(ids, pixels, where)

    def items(self, ids: list[int], pixels: np.ndarray, where: str) -> list[ImageItem]:
        """One item per image: its placeholder run (images side by side split by rows per image)."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        n = self.rows_per_image
        if len(at) != n * len(pixels):
            raise ValueError(f"{where}: the processor gave {len(at)} image tokens for {len(pixels)} images of {n} "
                             "rows each")
        items = []
        for k, px in enumerate(pixels):
            run = at[k * n:(k + 1) * n]
            if run[-1] - run[0] != n - 1:
                raise ValueError(f"{where}: image {k}'s placeholder tokens are not contiguous")
            digest = hashlib.sha256(b"infer-image:" + str(px.shape).encode() + px.tobytes()).digest()
            items.append(ImageItem(run[0], n, digest, px))
        return items


def step_images(scheduled) -> tuple[ImageSlice, ...]:
    """The image rows of a step's scheduled requests (`ScheduledRequest`s, in batch order)."""
    out, row = [], 0
    for s in scheduled:
        for item in getattr(s.request, "mm_items", ()):
            lo, hi = max(item.offset, s.start), min(item.end, s.start + s.num_tokens)
            if lo < hi:
                out.append(ImageSlice(row + lo - s.start, lo - item.offset, hi - lo, item))
        row += s.num_tokens
    return tuple(out)


class VisionEncoder:
    """The vision graph's runner, and its outputs by image hash (host float32 rows, LRU)."""

    def __init__(self, runner, capacity_rows: int = 16384):
        self.runner, self.backend, self.dtype = runner, runner.backend, runner.dtype
        self.spec = runner.program.graph.encoder_inputs
        self.capacity = capacity_rows
        self.cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0
        self.images_encoded = 0

    def step_inputs(self, slices: Sequence[ImageSlice]) -> dict[str, Any]:
        """``mm_rows`` [M] and ``mm_embeds`` [M, H] for `slices`, running the encoder for new images."""
        need = {s.item.hash: s.item for s in slices}
        missing = [it for h, it in need.items() if h not in self.cache]
        self.hits += len(need) - len(missing)
        self.misses += len(missing)
        if missing:
            for item, rows in zip(missing, self.encode(missing)):
                self.cache[item.hash] = rows
        for h in need:
            self.cache.move_to_end(h)
        rows = np.concatenate([np.arange(s.row, s.row + s.count) for s in slices]).astype(np.int64)
        embeds = np.concatenate([self.cache[s.item.hash][s.first:s.first + s.count] for s in slices])
        self._evict(keep=set(need))
        return {"mm_rows": self.backend.asarray(rows), "mm_embeds": self.backend.asarray(embeds, self.dtype)}

    def _evict(self, keep: set[bytes]) -> None:
        total = sum(len(v) for v in self.cache.values())
        for h in list(self.cache):
            if total <= self.capacity:
                break
            if h not in keep:
                total -= len(self.cache.pop(h))

    def encode(self, items: Sequence[ImageItem]) -> list[np.ndarray]:
        """Each image's feature rows [length, H] (float32), the images batched in one forward."""
        sp, be = self.spec, self.backend
        p, n = sp["patch_size"], sp["rows_per_image"]
        patches, positions, classes, keep = [], [], [], []
        for k, item in enumerate(items):
            px = np.asarray(item.pixel_values, np.float32)
            c, hh, ww = px.shape
            if hh % p or ww % p or (hh // p) * (ww // p) + sp["class_row"] != n:
                raise ValueError(f"an image of {hh}x{ww} pixels does not make the tower's {n} rows of {p}x{p} patches")
            grid = px.reshape(c, hh // p, p, ww // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, c * p * p)
            if sp["class_row"]:
                grid = np.concatenate([np.zeros((1, grid.shape[1]), np.float32), grid])
                classes.append(np.array([0] + [1] * (n - 1), np.int64))
            patches.append(grid)
            positions.append(np.arange(n, dtype=np.int64))
            first = k * n + (1 if sp["drop_class"] else 0)
            keep.append(np.arange(first, (k + 1) * n, dtype=np.int64))
        count = len(items)
        qsl = (np.arange(count + 1) * n).astype(np.int32)
        lens = np.full(count, n, np.int32)
        meta = AttentionMetadata(qsl, lens, np.zeros((count, 1), np.int32), np.full(count * n, -1, np.int64), n, n, 16)
        inputs = {"patches": be.asarray(np.concatenate(patches), self.dtype), "feature_rows": be.asarray(np.concatenate(keep))}
        if sp["class_row"]:
            inputs["class_ids"] = be.asarray(np.concatenate(classes))
        out = self.runner.forward(None, be.asarray(np.concatenate(positions)), None, self.runner.prepare_metadata(meta),
                                  inputs=inputs)
        feats = be.to_numpy(be.cast(out.pooled, "float32")).astype(np.float32)
        self.images_encoded += count
        per = len(feats) // count
        if any(it.length != per for it in items):
            raise ValueError(f"the vision tower gives {per} rows per image, the prompt holds "
                             f"{[it.length for it in items]}")
        return [feats[k * per:(k + 1) * per] for k in range(count)]


class MediaConnector:
    """Images named by chat content parts: ``data:`` URLs, http(s) URLs (a timeout, a byte cap,
    a redirect cap, `allowed_media_domains`), ``file://`` paths under `allowed_local_media_path`
    only; vLLM's flags of the same names."""

    def __init__(self, allowed_local_media_path: str | None = None, allowed_media_domains=None,
                 timeout_s: float | None = None, max_bytes: int | None = None, max_redirects: int = 5):
        """Defaults: $INFER_IMAGE_FETCH_TIMEOUT seconds (5, vLLM's), $INFER_MAX_IMAGE_BYTES (20 MiB)."""
        import os

        timeout_s = float(os.environ.get("INFER_IMAGE_FETCH_TIMEOUT", 5)) if timeout_s is None else timeout_s
        max_bytes = int(os.environ.get("INFER_MAX_IMAGE_BYTES", 20 * 2**20)) if max_bytes is None else max_bytes
        self.local = os.path.realpath(allowed_local_media_path) if allowed_local_media_path else None
        self.domains = {d.lower() for d in allowed_media_domains} if allowed_media_domains else None
        self.timeout_s, self.max_bytes, self.max_redirects = timeout_s, max_bytes, max_redirects

    def load(self, url: str, where: str):
        import base64
        import binascii

        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}: the image URL must be a non-empty string")
        if url.startswith("data:"):
            head, sep, body = url.partition(",")
            if not sep or ";base64" not in head:
                raise ValueError(f"{where}: a data URL must be base64 (data:image/png;base64,...)")
            if len(body) * 3 // 4 > self.max_bytes:
                raise ValueError(f"{where}: the image is larger than {self.max_bytes} bytes")
            try:
                data = base64.b64decode(body, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"{where}: the data URL is not valid base64") from None
            return load_image(data, where)
        if url.startswith("file://"):
            return load_image(self._read_local(url[len("file://"):], where), where)
        if url.startswith(("http://", "https://")):
            return load_image(self._fetch(url, where), where)
        raise ValueError(f"{where}: unsupported image URL scheme (use data:, http(s): or file:)")

    def _read_local(self, path: str, where: str) -> bytes:
        import os

        if self.local is None:
            raise ValueError(f"{where}: local files are not served; start with --allowed-local-media-path DIR")
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.local]) != self.local:
            raise ValueError(f"{where}: {path} is outside the allowed local media path")
        if not os.path.isfile(real):
            raise ValueError(f"{where}: no such file {path}")
        if os.path.getsize(real) > self.max_bytes:
            raise ValueError(f"{where}: the image is larger than {self.max_bytes} bytes")
        with open(real, "rb") as f:
            return f.read()

    def _check_domain(self, url: str, where: str) -> None:
        from urllib.parse import urlsplit

        host = (urlsplit(url).hostname or "").lower()
        if self.domains is not None and host not in self.domains:
            raise ValueError(f"{where}: the domain {host!r} is not in --allowed-media-domains")

    def _fetch(self, url: str, where: str) -> bytes:
        import urllib.error
        import urllib.request

        self._check_domain(url, where)
        connector = self

        class Redirects(urllib.request.HTTPRedirectHandler):
            max_redirections = self.max_redirects

            def redirect_request(self, req, fp, code, msg, headers, newurl):
                connector._check_domain(newurl, where)
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        opener = urllib.request.build_opener(Redirects)
        try:
            with opener.open(urllib.request.Request(url, headers={"User-Agent": "infer"}), timeout=self.timeout_s) as r:
                data = r.read(self.max_bytes + 1)
        except ValueError:
            raise
        except urllib.error.HTTPError as exc:
            raise ValueError(f"{where}: fetching the image failed: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ValueError(f"{where}: fetching the image failed ({reason}; timeout {self.timeout_s:g} s)") from None
        if len(data) > self.max_bytes:
            raise ValueError(f"{where}: the image is larger than {self.max_bytes} bytes")
        return data


def chat_images(messages: Sequence[dict], media: MediaConnector | None) -> tuple[list[dict], list[Any]]:
    """Chat messages with their image parts replaced by ``{"type": "image"}`` (what VLM chat templates
    read), and the images in order. Parts: ``text``, ``image_url`` ({"url": ...} or a string), and
    offline ``image_pil`` (a PIL image); `media` None: the caller serves no images."""
    out, images = [], []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(dict(msg))
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}: a text part needs a string 'text'")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("image_url", "image_pil", "image"):
                if media is None:
                    raise ValueError(f"{where}: this model takes no images (a text-only model)")
                if kind == "image_url":
                    ref = part.get("image_url")
                    images.append(media.load(ref.get("url") if isinstance(ref, dict) else ref, where))
                else:
                    img = part.get(kind)
                    if img is None or isinstance(img, str):
                        images.append(media.load(img, where))
                    else:
                        images.append(img)
                parts.append({"type": "image"})
            else:
                raise ValueError(f"{where}: content parts of type {kind!r} are not supported (text, image_url)")
        # A text model's template reads a string; a VLM's reads the parts.
        out.append({**msg, "content": parts if media is not None else "\n".join(p["text"] for p in parts)})
    return out, images
