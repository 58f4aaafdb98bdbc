"""The xgrammar backend: compile a :class:`~tinyvllm.sampling_params.StructuredOutputsParams` into a
token-level grammar, and match a request's tokens against it.

xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models", https://github.com/mlc-ai/xgrammar) compiles a JSON schema, regex, EBNF grammar or
structural tag against the tokenizer's vocabulary (``GrammarCompiler``); a ``GrammarMatcher`` per
request then walks the grammar token by token and fills the *token bitmask*: an int32 array of
``ceil(vocab_size / 32)`` words per row, bit ``t % 32`` of word ``t // 32`` set where token ``t`` may
come next (xgrammar's layout, ``xgrammar.get_bitmask_shape``). Stop tokens (EOS) are allowed only
where the grammar accepts the output so far.

xgrammar is imported lazily (it imports torch): the API process pays for it only when a request
with a constraint arrives, in a thread (see :func:`validate`).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from tinyvllm.sampling_params import StructuredOutputsParams

# JSON-schema keywords that xgrammar 0.2.9 does not enforce (it ignores them silently): a schema that
# uses one is refused (400) rather than producing output that does not validate.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset({
    "if", "then", "else", "not", "dependentSchemas", "dependentRequired", "dependencies", "contains",
    "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
    "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "uniqueItems",
})
# Keys whose value is a map of name -> subschema, or a list of subschemas, or one subschema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties")


def xgr():  # noqa: ANN201 - the xgrammar module
    import xgrammar

    return xgrammar


class GrammarError(ValueError):
    """A constraint that cannot be compiled; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def find_unsupported_keyword(schema: Any, path: str = "") -> str | None:
    """The JSON pointer-ish path of the first keyword in :data:`UNSUPPORTED_SCHEMA_KEYWORDS`, or None."""
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k in UNSUPPORTED_SCHEMA_KEYWORDS:
                return f"{path}/{k}"
            if k in _SCHEMA_MAPS and isinstance(v, dict):
                for name, sub in v.items():
                    if (hit := find_unsupported_keyword(sub, f"{path}/{k}/{name}")) is not None:
                        return hit
            elif k in _SCHEMA_LISTS and isinstance(v, list):
                for i, sub in enumerate(v):
                    if (hit := find_unsupported_keyword(sub, f"{path}/{k}/{i}")) is not None:
                        return hit
            elif k in _SCHEMA_ONE and isinstance(v, (dict, list)):
                subs = v if isinstance(v, list) else [v]
                for i, sub in enumerate(subs):
                    if (hit := find_unsupported_keyword(sub, f"{path}/{k}")) is not None:
                        return hit
    return None


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are xgrammar's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean_error(e: BaseException) -> str:
    """xgrammar's C++ errors start with ``[time] file:line:``; keep the message."""
    msg = str(e).strip()
    if msg.startswith("[") and "] " in msg:
        msg = msg.split("] ", 1)[1]
        head, sep, rest = msg.partition(": ")
        if sep and (".cc:" in head or ".h:" in head):
            msg = rest
    return msg.strip()


def _grammar(so: StructuredOutputsParams, param: str) -> Any:
    """Build the (tokenizer-independent) ``xgrammar.Grammar``: fast, used both to validate and compile.

    Raises:
        GrammarError: malformed or unsupported constraint (``param`` names the field).
    """
    G = xgr().Grammar
    kind, spec = so.key
    try:
        if kind == "json":
            try:
                schema = json.loads(spec)
            except ValueError as e:
                raise GrammarError(f"{param}: the JSON schema is not valid JSON: {e}", param) from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"{param}: a JSON schema must be an object or a boolean", param)
            if (kw := find_unsupported_keyword(schema)) is not None:
                raise GrammarError(f"{param}: unsupported JSON schema keyword at {kw or '/'}", param)
            return G.from_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return G.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return G.from_regex(spec)
        if kind == "choice":
            return G.from_ebnf(choice_ebnf(so.choice or []))
        if kind == "grammar":
            return G.from_ebnf(spec)
        if kind == "structural_tag":
            return G.from_structural_tag(spec)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / its own errors with the parser's message
        raise GrammarError(f"{param}: invalid {kind.replace('_', ' ')}: {_clean_error(e)}", param) from None
    raise GrammarError(f"{param}: unknown constraint kind {kind!r}", param)


def validate(so: StructuredOutputsParams, param: str = "structured_outputs") -> None:
    """Check that ``so`` compiles (grammar construction only, no token masks: well under a millisecond
    for typical schemas, measured). The first call imports xgrammar (~1-3 s): call it in a thread.

    Raises:
        GrammarError: with ``param`` set to the field to blame.
    """
    _grammar(so, param)


class XgrammarBackend:
    """A ``GrammarCompiler`` over one vocabulary.

    Args:
        tokenizer_info: an ``xgrammar.TokenizerInfo`` whose ``vocab_size`` is the model's logits width
            (it may exceed the tokenizer's own vocabulary; the tail is never allowed).
        max_threads: xgrammar's compile threads.
    """

    def __init__(self, tokenizer_info: Any, max_threads: int = 1) -> None:
        self.tokenizer_info = tokenizer_info
        self.vocab_size = int(tokenizer_info.vocab_size)
        self.compiler = xgr().GrammarCompiler(tokenizer_info, max_threads=max_threads)

    @classmethod
    def from_hf_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None,
                          max_threads: int = 1) -> XgrammarBackend:
        info = xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                     stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        return cls(info, max_threads)

    @classmethod
    def from_vocab(cls, vocab: Sequence[str], stop_token_ids: Sequence[int], vocab_size: int | None = None,
                   max_threads: int = 1) -> XgrammarBackend:
        """A raw vocabulary (token id ``i`` is the text ``vocab[i]``): tiny test models."""
        info = xgr().TokenizerInfo(list(vocab), xgr().VocabType.RAW, vocab_size=vocab_size or len(vocab),
                                   stop_token_ids=list(stop_token_ids))
        return cls(info, max_threads)

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``so`` (token masks precomputed: milliseconds to seconds)."""
        return self.compiler.compile_grammar(_grammar(so, "structured_outputs"))

    def matcher(self, compiled: Any, stop_token_ids: Sequence[int] | None) -> Any:
        return xgr().GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) if stop_token_ids else None)


BackendFactory = Callable[[], XgrammarBackend]
