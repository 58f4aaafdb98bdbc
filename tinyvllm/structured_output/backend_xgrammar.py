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


# Keywords that only annotate: xgrammar and a validator both ignore them, so they may sit next to anything.
_ANNOTATIONS = frozenset({
    "title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated", "readOnly",
    "writeOnly", "$anchor", "$defs", "definitions", "contentEncoding", "contentMediaType", "format", "strict",
})
# Keywords that constrain one JSON type; xgrammar applies them only where it knows the node's type.
_TYPE_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
}


def _subschemas(node: dict, path: str):
    """``(subschema, path)`` for every direct subschema of ``node`` (the walk of :func:`find_unsupported_keyword`)."""
    for k, v in node.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            for name, sub in v.items():
                yield sub, f"{path}/{k}/{name}"
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            for i, sub in enumerate(v):
                yield sub, f"{path}/{k}/{i}"
        elif k in _SCHEMA_ONE and isinstance(v, dict):
            yield v, f"{path}/{k}"


def _types(node: dict) -> set[str] | None:
    """The JSON types ``node`` allows as xgrammar sees them: ``type``, or inferred from ``properties``
    (object) or ``items``/``prefixItems`` (array); None where it is untyped."""
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if "properties" in node:
        return {"object"}
    if "items" in node or "prefixItems" in node:
        return {"array"}
    return None


def _disjoint_branches(branches: list) -> bool:
    """Whether no value can match two of ``oneOf``'s branches, as far as a syntactic look tells: each
    branch one distinct ``type`` (``integer`` and ``number`` overlap), or each a ``const``/``enum`` with
    no value in common."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    if all(isinstance(b.get("type"), str) for b in branches):
        ts = [b["type"] for b in branches]
        return len(set(ts)) == len(ts) and not {"integer", "number"} <= set(ts)
    seen: set[str] = set()
    for b in branches:
        vals = [b["const"]] if "const" in b else b.get("enum") if isinstance(b.get("enum"), list) else None
        if vals is None:
            return False
        keys = {json.dumps(v, sort_keys=True) for v in vals}
        if keys & seen:
            return False
        seen |= keys
    return True


def _value_fails(value: Any, rest: dict, root: Any) -> str | None:
    """jsonschema's message if ``value`` does not validate against ``rest`` (``root``'s ``$defs`` and
    ``definitions`` kept so that ``$ref`` resolves), else None."""
    import jsonschema

    doc = dict(rest)
    if isinstance(root, dict):
        for k in ("$defs", "definitions"):
            if isinstance(root.get(k), dict):
                doc.setdefault(k, root[k])
    try:
        err = jsonschema.exceptions.best_match(_validator_class(root)(doc).iter_errors(value))
    except Exception as e:  # noqa: BLE001 - a $ref that does not resolve here: the value cannot be checked
        return f"it cannot be checked: {e}"
    return None if err is None else err.message


def _validator_class(schema: Any) -> Any:
    """jsonschema's validator for ``schema``'s ``$schema`` (draft 2020-12 if absent or unknown)."""
    import jsonschema

    default = jsonschema.Draft202012Validator
    if not isinstance(schema, dict) or not isinstance(schema.get("$schema"), str):
        return default
    return jsonschema.validators.validator_for(schema, default=default)


def find_unenforceable(schema: Any, root: Any = None, path: str = "") -> str | None:
    """Why xgrammar 0.2.9 would not enforce ``schema`` (``"<path>/<keyword>: <reason>"``), or None.

    xgrammar compiles these schemas without an error but its grammar lets through values that fail
    the schema (each found by trying it; see ``tests/test_structured_output.py``'s property test):

    * a ``required`` name not in ``properties`` (it generates only listed properties: nothing, or an
      object without the name, can satisfy the grammar and the schema at once);
    * ``allOf`` with more than one subschema, ``oneOf`` whose branches may overlap (it is read as
      ``anyOf``), and assertions next to ``anyOf``/``oneOf``/``allOf``/``$ref`` (ignored there);
    * a ``const`` or ``enum`` value that fails the keywords next to it (the value is allowed as is);
    * ``minLength``/``maxLength`` together with ``pattern`` or ``format`` (the bounds are dropped);
    * ``multipleOf`` other than a whole number on an ``integer`` (not enforced on numbers), or next to
      a lower bound without an upper one or the other way round;
    * ``minProperties`` above the number of ``required`` names where ``additionalProperties`` or
      ``patternProperties`` allow other keys (the grammar lets a key repeat, which counts once);
    * type-specific keywords (``minLength``, ``minimum``, ``required``, ...) on a node without a ``type``
      xgrammar can see (ignored).
    """
    if root is None:
        root = schema
    if not isinstance(schema, dict):
        return None
    keys = set(schema) - _ANNOTATIONS
    for comb in ("$ref", "anyOf", "oneOf", "allOf"):
        if comb in schema and (others := sorted(keys - {comb})):
            return (f"{path}/{comb}: the keywords next to {comb} ({', '.join(others)}) are not enforced; "
                    f"move them into the {'referenced schema' if comb == '$ref' else comb + ' subschemas'}")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{path}/allOf: allOf with more than one subschema is not enforced"
    if isinstance(schema.get("oneOf"), list) and len(schema["oneOf"]) > 1 and not _disjoint_branches(schema["oneOf"]):
        return (f"{path}/oneOf: oneOf is enforced only where its branches cannot overlap (one distinct type "
                f"or distinct const/enum values each); use anyOf")
    types = _types(schema)
    if types is None and "const" not in schema and "enum" not in schema:
        for kws in _TYPE_KEYWORDS.values():
            for kw in kws:
                if kw in schema:
                    return f"{path}/{kw}: {kw} is enforced only on a schema with a 'type'"
    if ("minLength" in schema or "maxLength" in schema) and ("pattern" in schema or "format" in schema):
        which = "pattern" if "pattern" in schema else "format"
        return f"{path}/{which}: minLength/maxLength together with {which} are not enforced"
    if "multipleOf" in schema:
        m = schema["multipleOf"]
        whole = isinstance(m, int) or (isinstance(m, float) and m.is_integer())
        if not (whole and types is not None and types <= {"integer"}):
            return f"{path}/multipleOf: multipleOf is enforced only as a whole number on type integer"
        lower = sum(k in schema for k in ("minimum", "exclusiveMinimum"))
        upper = sum(k in schema for k in ("maximum", "exclusiveMaximum"))
        if (lower, upper) not in ((0, 0), (1, 1)):
            return (f"{path}/multipleOf: multipleOf is enforced only with no bounds or with one lower and one "
                    f"upper bound (minimum or exclusiveMinimum, maximum or exclusiveMaximum)")
    extra = schema.get("additionalProperties", False) is not False or "patternProperties" in schema
    n_req = len(req) if isinstance(req := schema.get("required"), list) else 0
    if extra and isinstance(schema.get("minProperties"), int) and schema["minProperties"] > n_req:
        return (f"{path}/minProperties: minProperties is not enforced where additionalProperties or "
                f"patternProperties allow other keys (a key may be repeated)")
    req = schema.get("required")
    if isinstance(req, list) and req:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for name in req:
            if name not in props:
                return (f"{path}/required: {name!r} is required but not in properties (only the properties "
                        f"listed are generated)")
    for kw in ("const", "enum"):
        if kw not in schema:
            continue
        rest = {k: v for k, v in schema.items() if k != kw and k not in _ANNOTATIONS}
        if not rest:
            continue
        values = [schema[kw]] if kw == "const" else schema[kw] if isinstance(schema[kw], list) else []
        for v in values:
            if (why := _value_fails(v, rest, root)) is not None:
                return f"{path}/{kw}: the value {json.dumps(v)} fails the keywords next to {kw} ({why})"
    for sub, sub_path in _subschemas(schema, path):
        if (hit := find_unenforceable(sub, root, sub_path)) is not None:
            return hit
    return None


def check_json_schema(schema: Any, param: str) -> None:
    """Refuse (``GrammarError`` naming ``param``) a schema that is not a valid JSON schema (by its
    meta-schema), uses a keyword xgrammar ignores, or that xgrammar would not enforce."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{param}: a JSON schema must be an object or a boolean", param)
    if (kw := find_unsupported_keyword(schema)) is not None:
        raise GrammarError(f"{param}: unsupported JSON schema keyword at {kw or '/'}", param)
    if isinstance(schema, dict) and "$schema" in schema and not isinstance(schema["$schema"], str):
        raise GrammarError(f"{param}: invalid JSON schema at /$schema: must be a string (a URI)", param)
    try:
        _validator_class(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        where = "/" + "/".join(str(p) for p in e.path)
        raise GrammarError(f"{param}: invalid JSON schema at {where}: {e.message}", param) from None
    if (why := find_unenforceable(schema)) is not None:
        raise GrammarError(f"{param}: JSON schema keyword that cannot be enforced at {why}", param)


def _tag_schemas(tag: Any):
    """Every JSON schema inside an xgrammar structural tag (``{"type": "json_schema", "json_schema": S}``)."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            yield tag["json_schema"]
        for v in tag.values():
            yield from _tag_schemas(v)
    elif isinstance(tag, list):
        for v in tag:
            yield from _tag_schemas(v)


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
            check_json_schema(schema, param)
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
            try:
                tag = json.loads(spec)
            except ValueError:
                tag = None  # xgrammar reports it
            for schema in _tag_schemas(tag):
                check_json_schema(schema, param)
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
