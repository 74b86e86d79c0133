"""The routing key of a request for cache-aware routing: chained hashes of its prompt's leading chunks.

A worker's prefix cache holds whole KV blocks of a prompt's beginning, so two requests share cached
work exactly when their rendered prompts start alike. The router cannot tokenize (it has no model), so
it hashes fixed-size character chunks of the text the worker will render: chunk i's hash covers the
whole text up to the end of chunk i, and the longest hash the router has seen before names the worker
holding the longest shared prefix. A conversation's next call resends the earlier turns, so it maps to
the worker that served them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

RoutingKey = tuple[bytes, ...]  # chained chunk hashes, shortest prefix first


def prompt_text(body: bytes) -> str | None:
    """The prompt a worker would see (messages in order, or the prompt), or None if the body has none."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    parts: list[str] = []
    if isinstance(obj.get("system"), str):  # Ollama /api/generate
        parts.append(obj["system"])
    messages = obj.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                # Separators that cannot occur in text keep "ab"+"c" and "a"+"bc" apart.
                parts.append(f"{m.get('role', '')}\x1f{_content(m.get('content'))}\x1e")
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list) and prompt:
        # A batch of prompts routes by its first; token ids route by their decimal text.
        first = prompt[0]
        if isinstance(first, str):
            parts.append(first)
        elif isinstance(first, list):
            parts.append(" ".join(map(str, first)))
        else:
            parts.append(" ".join(map(str, prompt)))
    return "".join(parts) or None


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def routing_key(text: str | None, chunk_chars: int, max_chunks: int) -> RoutingKey:
    """Chained hashes of the text's first `max_chunks` chunks of `chunk_chars` characters (a last partial
    chunk included, so that a repeated short prompt finds its worker again)."""
    if not text:
        return ()
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, min(len(text), chunk_chars * max_chunks), chunk_chars):
        h = hashlib.blake2b(parent + text[start:start + chunk_chars].encode(), digest_size=16).digest()
        hashes.append(h)
        parent = h
    return tuple(hashes)
