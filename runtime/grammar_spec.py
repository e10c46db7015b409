"""What a request constrains its output to (`GrammarSpec`): plain text — a kind and its schema, pattern or
grammar — so that it travels from the API server to the engine core inside `SamplingParams` and equal specs
share one compiled grammar there (core/structured_output.GrammarBackend); and `validate()`, with which the API
server rejects what xgrammar cannot convert. xgrammar is imported only inside the functions that use it: this
module is imported wherever SamplingParams is."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

from .errors import RequestError

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
# The longest spec (schema JSON, pattern, EBNF) a request may carry. xgrammar's conversion grows faster than
# the text (a 260 KB nested schema converts in about 1 s, an 820 KB one in 36 s), so a larger one could not
# compile within the core's compile_timeout: it is refused before any work.
MAX_GRAMMAR_CHARS = 256 * 1024
# How much whitespace a JSON grammar (json_object, json_schema) allows between tokens (`kiln serve
# --json-whitespace`, vLLM's disable_any_whitespace): "compact" none, separators "," and ":" (OpenAI's strict
# output); "bounded" at most BOUNDED_WHITESPACE characters in a row; "any" what the engine core allows
# (GrammarBackend.max_whitespace: 8 by default). A small or unsure model sampled at temperature 1 spends its
# max_tokens on whitespace wherever a grammar allows it.
JSON_WHITESPACE = ("compact", "bounded", "any")
BOUNDED_WHITESPACE = 2
JSON_KINDS = ("json_object", "json_schema")


class GrammarError(RequestError):
    """A grammar the request asked for cannot be used: malformed, unsupported by xgrammar (its message is
    kept), or its compilation timed out. The server answers it with a 400."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What to constrain one request to. `spec` is text (compact JSON for schemas and structural tags, in
    the request's key order — property order is part of a schema's meaning to xgrammar —, the pattern, the
    EBNF), so equal requests share one compiled grammar: the cache key is (kind, spec, strict, whitespace).
    `whitespace` (JSON_WHITESPACE) matters to the JSON kinds only."""

    kind: str
    spec: str = ""
    strict: bool = True  # json_schema: properties not in the schema are rejected (xgrammar strict_mode)
    whitespace: str = "compact"

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (known: {', '.join(GRAMMAR_KINDS)})")
        if self.whitespace not in JSON_WHITESPACE:
            raise GrammarError(f"unknown JSON whitespace policy {self.whitespace!r} (known: "
                               f"{', '.join(JSON_WHITESPACE)})")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the {self.kind} is {len(self.spec)} characters long, over the limit of "
                               f"{MAX_GRAMMAR_CHARS}; simplify it")

    @property
    def key(self) -> tuple[str, str, bool, str]:
        return (self.kind, self.spec, self.strict, self.whitespace)

    def with_whitespace(self, whitespace: str) -> GrammarSpec:
        """This spec under another JSON whitespace policy (itself when it is not a JSON kind)."""
        return replace(self, whitespace=whitespace) if self.kind in JSON_KINDS else self

    @classmethod
    def json_object(cls, whitespace: str = "compact") -> GrammarSpec:
        return cls("json_object", whitespace=whitespace)

    @classmethod
    def json_schema(cls, schema: dict | str | bool, strict: bool = True, whitespace: str = "compact") -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), bool(strict), whitespace)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Seq[str]) -> GrammarSpec:
        if (not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, ebnf: str) -> GrammarSpec:
        """xgrammar's EBNF (GBNF-like, rule `root`), or Lark (rule `start`) when it has no `::=`."""
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise GrammarError("grammar must be a non-empty string")
        return cls("grammar", ebnf)

    @classmethod
    def structural_tag(cls, tag: dict | Any) -> GrammarSpec:
        """An xgrammar structural tag (a `StructuralTag` or its JSON form)."""
        if hasattr(tag, "model_dump"):
            tag = tag.model_dump(mode="json", by_alias=True)
        if not isinstance(tag, dict):
            raise GrammarError(f"a structural tag must be a JSON object, got {type(tag).__name__}")
        return cls("structural_tag", json.dumps(tag, ensure_ascii=False))


_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def grammar_spec_from_response_format(response_format: dict | None,
                                      whitespace: str = "compact") -> GrammarSpec | None:
    """OpenAI's `response_format` (`text`, `json_object`, `json_schema`) plus kiln's `regex`, `choice`,
    `grammar` and `structural_tag` types; None when the output is free text. `whitespace`: the JSON kinds'
    policy (the server's). Raises GrammarError on a malformed value (a 400)."""
    spec = _response_format_spec(response_format)
    return spec.with_whitespace(whitespace) if spec is not None else None


def _response_format_spec(response_format: dict | None) -> GrammarSpec | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict):
            raise GrammarError("response_format.json_schema must be an object with a name and a schema")
        name = js.get("name")
        if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
            raise GrammarError("response_format.json_schema.name must match [a-zA-Z0-9_-]{1,64}")
        strict = js.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise GrammarError("response_format.json_schema.strict must be a boolean")
        schema = js.get("schema")
        if schema is None:  # OpenAI: without a schema, any JSON object
            return GrammarSpec.json_object()
        return GrammarSpec.json_schema(schema, strict=bool(strict))
    if kind in ("regex", "choice", "grammar"):
        if kind not in response_format:
            raise GrammarError(f"response_format of type {kind!r} needs a {kind!r} field")
        return getattr(GrammarSpec, kind)(response_format[kind])
    if kind == "structural_tag":
        return GrammarSpec.structural_tag({k: v for k, v in response_format.items()})
    raise GrammarError(f"unknown response_format type {kind!r} (known: text, json_object, json_schema, regex, "
                       "choice, grammar, structural_tag)")


# Validation with xgrammar (imported inside the functions: importing this module stays cheap) -------------------

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # "[08:43:10] /project/cpp/x.cc:83: " on xgrammar errors


def xgrammar_message(e: BaseException) -> str:
    return _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are what xgrammar's EBNF string literals accept
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.8 writes the comma of free-form arrays and objects (a value the schema leaves open: json_object,
# {"type": "object"}) as ", " even with separators=(",", ":"); under "compact" it becomes ",". tests/structured
# checks that xgrammar still needs this.
_ANY_VALUE_COMMA = ('(", " basic_any)', '(", " basic_string ":" basic_any)')


def json_grammar(spec: GrammarSpec, max_whitespace: int | None = 8) -> Any:
    """The xgrammar Grammar of a JSON kind under its whitespace policy; `max_whitespace`: what "any" allows in
    a row (None: unbounded). Raises what xgrammar raises."""
    import xgrammar as xgr

    schema = spec.spec if spec.kind == "json_schema" else '{"type": "object"}'  # OpenAI: json_object's root
    if spec.whitespace == "compact":  # is an object (xgrammar's builtin JSON grammar allows arrays)
        grammar = xgr.Grammar.from_json_schema(schema, strict_mode=spec.strict, any_whitespace=False,
                                               separators=(",", ":"))
        text = fixed = str(grammar)
        for rule in _ANY_VALUE_COMMA:
            fixed = fixed.replace(rule, rule.replace('", "', '","'))
        return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)
    ws = BOUNDED_WHITESPACE if spec.whitespace == "bounded" else max_whitespace
    return xgr.Grammar.from_json_schema(schema, strict_mode=spec.strict, max_whitespace_cnt=ws)


def validate(spec: GrammarSpec, max_whitespace: int | None = 8) -> None:
    """Converts `spec` to an xgrammar Grammar without a tokenizer (cheap: no token-mask precomputation), so the
    API server rejects what the engine could not compile, with xgrammar's reason. Raises GrammarError."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_object":
            return
        if spec.kind == "json_schema":
            json_grammar(spec, max_whitespace)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.spec)))
        elif spec.kind == "grammar":
            if "::=" in spec.spec:
                xgr.Grammar.from_ebnf(spec.spec)
            else:
                xgr.Grammar.from_lark(spec.spec)
        else:
            xgr.Grammar.from_structural_tag(spec.spec)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / pydantic errors with the reason
        raise GrammarError(f"invalid {spec.kind}: {xgrammar_message(e)}") from None
