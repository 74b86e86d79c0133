"""Tokenizer: a `tokenizers.Tokenizer` plus what transformers keeps beside it (special ids, chat template).

Built from a Hugging Face folder (tokenizer.json + tokenizer_config.json) or from GGUF metadata
(`tokenloom.models.gguf`). Encoding matches `transformers.AutoTokenizer` for the same files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from tokenloom.errors import InvalidRequest, ModelLoadError

Message = dict[str, Any]


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    # Extra end-of-turn ids (generation_config.json, GGUF eot) that also end generation.
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    # Prepend BOS in `encode` when the backend's post-processor does not already add it
    # (GGUF `tokenizer.ggml.add_bos_token`, tokenizer_config `add_bos_token` on legacy Llama).
    add_bos_token: bool = False
    _template: jinja2.Template | None = field(default=None, init=False, repr=False)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation unless `ignore_eos` is set."""
        ids = [i for i in (self.eos_token_id, *self.eos_token_ids) if i is not None]
        return tuple(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: the backend's encode holds the GIL for the whole call (seconds for a
        # prompt of a few MB), encode_batch releases it, so a server's event loop runs on while a worker
        # thread tokenizes (serve/frontend.py). Same ids.
        ids: list[int] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """An incremental detokenizer: `.step(backend, token_id)` returns new text or None."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` to prompt text the way transformers' `apply_chat_template` does."""
        if not self.chat_template:
            raise InvalidRequest("this model has no chat template; use a plain completion prompt", "messages")
        if not messages:
            raise InvalidRequest("messages must not be empty", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidRequest(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"chat template failed: {e}", "messages") from e

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        # The template writes BOS itself where the model wants one, so no special tokens are added.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> "Tokenizer":
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json")
        backend = HFTokenizer.from_file(str(tj))
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        extra_eos: list[int] = []
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            extra_eos = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        return cls(
            backend=backend,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            eos_token_ids=tuple(int(i) for i in extra_eos),
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
        )


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):  # AddedToken serialised form
        return tok.get("content")
    return tok


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    # Same environment transformers uses: sandboxed, trim_blocks + lstrip_blocks, loopcontrols.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
