"""Tokenizer: HF `tokenizer.json` through the `tokenizers` library, incremental detokenizing, chat templates."""
from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from .errors import ArtifactError

# Tokens of context re-decoded with each new token: enough for decoders that look at neighbours (metaspace,
# byte fallback) without re-decoding the whole output every step.
_DETOKENIZE_CONTEXT = 5


def token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, tokenizer: Any, config: dict | None = None,
                 generation_config: dict | None = None) -> None:
        self._tok = tokenizer
        self.config = config or {}
        self.generation_config = generation_config or {}
        self.bos_token = token_text(self.config.get("bos_token"))
        self.eos_token = token_text(self.config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        # A tokenizer.json without a post-processor relies on tokenizer_config's add_bos_token (slow-tokenizer
        # checkpoints); one with a post-processor already adds what it should.
        self._prepend_bos = bool(self.config.get("add_bos_token")) and self.bos_token_id is not None \
            and self._tok.post_processor is None
        # Incremental detokenizing decodes the same one-token windows over and over: cache them, per flag.
        self._piece_cache: dict[bool, dict[int, str]] = {True: {}, False: {}}
        # A plain byte-level decoder maps each token to bytes on its own and decodes their concatenation, so a
        # token whose bytes are complete UTF-8 adds exactly its own text (the detokenizer's fast path).
        from tokenizers.decoders import ByteLevel
        self.concatenates_pieces = isinstance(self._tok.decoder, ByteLevel)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)

        def read(name: str) -> dict:
            f = path / name
            return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}

        config = read("tokenizer_config.json")
        if (path / "chat_template.jinja").is_file():  # transformers' own file wins over tokenizer_config's
            config["chat_template"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), config, read("generation_config.json"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Seq[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_piece(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """`decode([token_id])`, cached."""
        cache = self._piece_cache[bool(skip_special_tokens)]
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self._tok.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` underneath, for libraries that read the whole vocabulary (xgrammar)."""
        return self._tok

    # Chat templates ---------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: HF uses "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        return template

    @cached_property
    def _compiled_chat_template(self) -> Any:
        if self.chat_template is None:
            from .errors import RequestError
            raise RequestError("this model's tokenizer has no chat template; send a plain prompt instead")
        return _jinja_env().from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Renders like transformers' `apply_chat_template(tokenize=False)`: same sandbox, globals and
        variables (the special tokens of tokenizer_config.json, `add_generation_prompt`, `tools`)."""
        special = {k: token_text(v) for k, v in self.config.items()
                   if k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                            "mask_token") and token_text(v) is not None}
        return self._compiled_chat_template.render(messages=messages, tools=tools, documents=None,
                                                   add_generation_prompt=add_generation_prompt,
                                                   **{**special, **kwargs})


def _jinja_env() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class IncrementalDetokenizer:
    """Streams the text of generated tokens. Text is emitted only when it does not end in U+FFFD, so a
    byte-level BPE token carrying half a UTF-8 character is held back until the rest arrives.

    Decodes a sliding window `[prefix_offset, end)` rather than the whole output: the text of tokens before
    `read_offset` was already emitted, and decoding from `prefix_offset` gives the new tokens their context.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Seq[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_DETOKENIZE_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add_tokens(self, new_token_ids: Seq[int]) -> str:
        """Appends tokens; returns the newly completed text (possibly empty)."""
        token_ids = self.token_ids
        if len(new_token_ids) == 1 and self.read_offset == len(token_ids) and self.tokenizer.concatenates_pieces:
            # Fast path: nothing held back, so the window's text so far ends on a character boundary and a
            # byte-level token whose own text is clean appends exactly that text (as the slow path would).
            piece = self.tokenizer.decode_piece(new_token_ids[0], self.skip_special_tokens)
            if piece and "\ufffd" not in piece:
                token_ids.append(new_token_ids[0])
                self.prefix_offset = self.read_offset
                self.read_offset = len(token_ids)
                self.text += piece
                return piece
        token_ids.extend(new_token_ids)
        return self._decode_window()

    def _decode_window(self) -> str:
        """The general path: decode `[prefix_offset, read_offset)` and `[prefix_offset, end)`; the difference
        is the new text, unless it ends inside a character."""
        token_ids, skip = self.token_ids, self.skip_special_tokens
        if self.read_offset - self.prefix_offset == 1:
            prefix_text = self.tokenizer.decode_piece(token_ids[self.prefix_offset], skip)
        else:
            prefix_text = self.tokenizer.decode(token_ids[self.prefix_offset:self.read_offset], skip)
        full_text = self.tokenizer.decode(token_ids[self.prefix_offset:], skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(token_ids)
        self.text += delta
        return delta


def open_tokenizer(tok_dir: str | Path, vocab_size: int) -> Any:
    """The artifact's tokenizer in `tok_dir`, checked against the model's vocabulary (`ArtifactError` if unusable)."""
    tok_dir = Path(tok_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        raise ArtifactError(f"{tok_dir}: manifest.json names a tokenizer, but there is no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_dir(tok_dir)
    except Exception as e:  # tokenizers raises bare Exceptions; json, UnicodeDecodeError
        raise ArtifactError(f"{tok_dir}: the tokenizer does not load ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if tokenizer.vocab_size > vocab_size:
        raise ArtifactError(f"{tok_dir}: the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                            f"vocabulary of {vocab_size}")
    return tokenizer
