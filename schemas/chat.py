"""Chat messages with image parts, in the form vLLM's ``/v1/chat/completions/render`` reads.

Pure functions on messages, shared by the trainer side (``broker.rollouts.render``) and the engine
that fronts a vLLM server (``workers.engines.vllm_http``), so neither imports the other.

Image parts may be ``{"type": "image", "image": X}`` with X an HxWx3 uint8 array, a PIL image, a
file path, a ``data:`` URL or an ``http(s)`` URL, or already ``{"type": "image_url", ...}``.
numpy and Pillow are imported only when an image needs them.
"""

from __future__ import annotations

import base64
import io
import mimetypes
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from schemas.errors import RenderError


def image_url(image: Any) -> str:
    """An image as a URL the server can read: URLs pass through, files and pixels become data URLs."""
    if isinstance(image, str) and image.startswith(("data:", "http://", "https://")):
        return image
    if isinstance(image, (str, Path)):
        path = Path(image).expanduser()
        if not path.is_file():
            raise RenderError(f"image {str(image)!r} is neither a URL nor a file")
        mime = mimetypes.guess_type(path.name)[0] or "image/png"
        return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(_pixels(image))
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: the server sees exactly these pixels
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


def _pixels(value: Any) -> Any:
    import numpy as np

    array = np.asarray(value)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise RenderError(f"an image array must be HxWx3 uint8, got {array.dtype} {list(array.shape)}")
    return array


def messages_for_render(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with every ``{"type": "image", "image": X}`` part as an ``image_url`` part."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = [{"type": "image_url", "image_url": {"url": image_url(part.get("image"))}}
                 if part.get("type") == "image" else dict(part) for part in content]
        out.append({**message, "content": parts})
    return out


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(
        isinstance(p, Mapping) and p.get("type") in ("image", "image_url") for p in m["content"]) for m in messages)
