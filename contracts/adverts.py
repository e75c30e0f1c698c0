"""A service's advert of a kind, read as untrusted input: the manager treats what another
process wrote in ``services.kinds`` as the API treats a request body.

- **Bounded**: an advert over ``MAX_ADVERT_BYTES`` or nested deeper than ``MAX_ADVERT_DEPTH`` is
  refused before anything looks into it.
- **Nothing fetched**: a ``$ref`` (``$dynamicRef``, ``$recursiveRef``) is a pointer into the
  schema itself (``#/…``) or the advert is refused; a ``$id`` is refused (it would move the base
  of every reference), and the validator's registry retrieves nothing.
- **Linear time**: ``pattern`` and ``patternProperties`` are matched by pydantic-core's Rust
  regex (no backtracking; a pattern it cannot compile refuses the advert), ``uniqueItems`` by
  hashing, and a check spends at most ``CHECK_STEPS_PER_NODE`` keyword steps per node of the
  params and of the schema. Masking visits each param once with a capped set of subschemas
  (``masked``).

A refused advert raises ``AdvertRefused``; its reader logs it, naming the service, and leaves
that advert out (``orch_manager.runtime``).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import orjson
import referencing
import referencing.exceptions
from jsonschema import Draft202012Validator, ValidationError
from pydantic_core import SchemaError, SchemaValidator
from pydantic_core import core_schema as cs

from orch_contracts.errors import AdvertRefused, InvalidParams
from orch_contracts.masking import SECRET

#: The largest advert of one kind read, in bytes of its JSON (a params model of a few hundred
#: fields is some tens of KiB).
MAX_ADVERT_BYTES = 256 << 10
#: Nesting of an advert (objects in arrays in objects …) beyond this is refused.
MAX_ADVERT_DEPTH = 64
#: Keyword steps a params check may spend per node of the params and of the schema together:
#: a check is linear in both, whatever the schema's unions; one that needs more is refused (a
#: pydantic model's schema spends about 2 a node; 8 nested unions of 8 are refused in ~25 ms).
CHECK_STEPS_PER_NODE = 8
#: The schema dialect adverts are read in (pydantic's); an advert naming another is refused.
DIALECT = "https://json-schema.org/draft/2020-12/schema"
#: Subschemas that may apply to one param at once while masking; past it, that param is
#: masked whole (no union of unions can make masking slower than this).
MAX_MASK_SET = 64
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")


def read_advert(text: str) -> dict[str, Any]:
    """One kind's advert from the JSON text a service wrote: an object, bounded in size and
    depth, its params schema checked (``check_schema``). Raises AdvertRefused saying why."""
    if len(text) > MAX_ADVERT_BYTES:
        raise AdvertRefused(f"it is over {MAX_ADVERT_BYTES} bytes")
    try:
        advert = orjson.loads(text)
    except orjson.JSONDecodeError as exc:  # orjson refuses nesting past 1,024 levels itself
        raise AdvertRefused(f"it is not JSON that can be read ({exc})") from None
    if not isinstance(advert, dict):
        raise AdvertRefused(f"it is a JSON {type(advert).__name__}, not an object")
    _check_depth(advert)
    schema = advert.get("params_schema")
    if schema is not None:
        check_schema(schema)
    return advert


def _check_depth(value: Any) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_ADVERT_DEPTH:
            raise AdvertRefused(f"it is nested deeper than {MAX_ADVERT_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def check_schema(schema: Any) -> None:
    """Refuse a params schema that is not an object, names another dialect, could make the
    manager fetch anything, holds a pattern no linear-time engine takes, or is not a valid
    schema of its dialect."""
    if not isinstance(schema, dict):
        raise AdvertRefused("its params schema is not an object")
    if schema.get("$schema", DIALECT) != DIALECT:
        raise AdvertRefused(f"its params schema is not of the dialect {DIALECT}")
    for node in _nodes(schema):
        for key in _REFS:
            ref = node.get(key)
            if isinstance(ref, str) and not ref.startswith("#/") and ref != "#":
                raise AdvertRefused(f"its params schema has a {key} outside itself: refused")
            if isinstance(ref, str) and _pointer(schema, ref) is None:
                raise AdvertRefused(f"its params schema has a {key} that points nowhere")
        if isinstance(node.get("$id"), str) or isinstance(node.get("$anchor"), str):
            raise AdvertRefused("its params schema sets a $id or $anchor: refused")
        patterns = [node.get("pattern")]
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            if isinstance(pattern, str):
                try:
                    _regex(pattern)
                except SchemaError:
                    raise AdvertRefused(
                        "its params schema has a pattern a linear-time engine cannot match "
                        "(look-around or back-references)"
                    ) from None
    try:
        Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise AdvertRefused(f"its params schema is not valid: {exc.message[:200]}") from None


def _nodes(value: Any) -> Iterator[dict[str, Any]]:
    """Every object in ``value`` (the schema's nodes, and objects that are not: harmless)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _pointer(root: dict[str, Any], ref: str) -> Any:
    """What a ``#/a/b`` reference names in ``root``, or None."""
    node: Any = root
    for raw in ref[2:].split("/") if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


@functools.lru_cache(maxsize=1024)
def _regex(pattern: str) -> SchemaValidator:
    """``pattern`` compiled by pydantic-core's Rust regex: a search (JSON Schema's meaning), in
    time linear in the text."""
    return SchemaValidator(cs.str_schema(pattern=pattern, regex_engine="rust-regex"))


def _matches(pattern: str, text: str) -> bool:
    return _regex(pattern).isinstance_python(text)


class _Spent(Exception):
    """A check ran out of its steps."""


_steps: contextvars.ContextVar[list[int]] = contextvars.ContextVar("advert_check_steps")


def _counted(keyword: Callable[..., Iterator[ValidationError]]) -> Callable[..., Any]:
    def step(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
        left = _steps.get()
        left[0] -= 1
        if left[0] < 0:
            raise _Spent
        yield from keyword(validator, value, instance, schema)

    return step


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _matches(pattern, instance):
        yield ValidationError(f"does not match {pattern!r}")


def _matched(schema: dict[str, Any], key: str) -> bool:
    return any(_matches(p, key) for p in schema.get("patternProperties") or {})


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _matches(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(
    validator: Any, allowed: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    props = schema.get("properties") or {}
    extras = [k for k in instance if k not in props and not _matched(schema, k)]
    if validator.is_type(allowed, "object"):
        for key in extras:
            yield from validator.descend(instance[key], allowed, path=key)
    elif allowed is False and extras:
        yield ValidationError("additional properties are not allowed")


def _canonical(value: Any) -> Any:
    """``value`` with numbers as JSON Schema compares them (``1`` equals ``1.0``)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _unique_items(
    validator: Any, unique: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if unique is True and validator.is_type(instance, "array"):
        seen = {orjson.dumps(_canonical(v), option=orjson.OPT_SORT_KEYS) for v in instance}
        if len(seen) < len(instance):
            yield ValidationError("has non-unique elements")


_KEYWORDS = {
    **Draft202012Validator.VALIDATORS,
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "uniqueItems": _unique_items,
}
_Checker: Any = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    Draft202012Validator, {k: _counted(v) for k, v in _KEYWORDS.items()}
)
#: References resolve inside the schema alone: this registry retrieves nothing.
_NOTHING_FETCHED: referencing.Registry[Any] = referencing.Registry()


def _size(value: Any) -> int:
    return sum(1 for _ in _nodes_and_leaves(value))


def _nodes_and_leaves(value: Any) -> Iterator[Any]:
    stack = [value]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def check_params(kind: str, schema: dict[str, Any], params: dict[str, Any]) -> None:
    """Raise InvalidParams unless ``params`` meet ``schema``: where and which rule failed, never
    the value (the API does not echo what a client sent). Linear in the schema and the params
    (see the module's docstring)."""
    token = _steps.set([CHECK_STEPS_PER_NODE * (_size(schema) + _size(params)) + 1000])
    try:
        checker = _Checker(schema, registry=_NOTHING_FETCHED)
        problems = [_problem(e) for e in sorted(checker.iter_errors(params), key=_where)]
    except _Spent:
        raise InvalidParams(
            f"invalid params for kind {kind!r}: its advertised schema is too costly to check "
            "these params"
        ) from None
    except referencing.exceptions.Unresolvable:
        raise InvalidParams(
            f"invalid params for kind {kind!r}: its advertised schema has a reference that "
            "cannot be resolved here"
        ) from None
    finally:
        _steps.reset(token)
    if problems:
        raise InvalidParams(f"invalid params for kind {kind!r}: {'; '.join(problems)}")


def _where(error: ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "params"


def _problem(error: ValidationError) -> str:
    where = _where(error)
    if error.validator == "required":
        given: Any = error.instance if isinstance(error.instance, dict) else {}
        wanted: Any = error.validator_value
        missing = [str(r) for r in wanted if r not in given]
        return f"{where}: missing {', '.join(missing)}"
    if error.validator == "additionalProperties":
        return f"{where}: an unknown field"
    return f"{where}: fails {error.validator!r} ({str(error.validator_value)[:200]!r})"


def masked(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` with every part its JSON schema marks secret (``writeOnly``, ``format:
    password``: a pydantic secret type; ``secret: true``: marked so) as ``***``. Each part of
    ``value`` is visited once, with the set of subschemas that may apply to it (each union's
    branches merged, at most ``MAX_MASK_SET``: past that, or past 32 levels, it is masked
    whole)."""
    return _walk(value, [schema], schema, 0)


def mask_all(value: Any) -> Any:
    """``value`` with every string and number in it as ``***`` (what a ``read`` token sees
    where nothing tells which params are secret); its keys, booleans and nulls stay."""
    if isinstance(value, dict):
        return {k: mask_all(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_all(v) for v in value]
    if isinstance(value, bool) or value is None or value == "":
        return value
    return SECRET if isinstance(value, str | int | float) else value


def _expanded(schemas: list[Any], root: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every subschema that applies with ``schemas``: references followed, union branches
    added; None past MAX_MASK_SET."""
    out: dict[int, dict[str, Any]] = {}
    stack = list(schemas)
    while stack:
        schema = stack.pop()
        if not isinstance(schema, dict) or id(schema) in out:
            continue
        out[id(schema)] = schema
        if len(out) > MAX_MASK_SET:
            return None
        for key in _REFS:
            ref = schema.get(key)
            if isinstance(ref, str) and ref.startswith("#"):
                stack.append(_pointer(root, ref))
        for key in ("anyOf", "oneOf", "allOf"):
            branches = schema.get(key)
            if isinstance(branches, list):
                stack.extend(branches)
    return list(out.values())


def _secret(schema: dict[str, Any]) -> bool:
    return (
        schema.get("writeOnly") is True
        or schema.get("format") == "password"
        or schema.get("secret") is True
    )


def _walk(value: Any, schemas: list[Any], root: dict[str, Any], depth: int) -> Any:
    if value is None or value == "":
        return value
    full = _expanded(schemas, root) if depth <= 32 else None
    if full is None:
        return mask_all(value)
    if any(_secret(s) for s in full):
        return SECRET
    if isinstance(value, dict):
        out = dict(value)
        for key, v in value.items():
            inner = []
            for s in full:
                props = s.get("properties")
                extra = s.get("additionalProperties")
                if isinstance(props, dict) and key in props:
                    inner.append(props[key])
                elif isinstance(extra, dict):
                    inner.append(extra)
            if inner:
                out[key] = _walk(v, inner, root, depth + 1)
        return out
    if isinstance(value, list):
        items = []
        for i, v in enumerate(value):
            inner = []
            for s in full:
                prefix = s.get("prefixItems")
                if isinstance(prefix, list) and i < len(prefix):
                    inner.append(prefix[i])
                elif isinstance(s.get("items"), dict):
                    inner.append(s["items"])
            items.append(_walk(v, inner, root, depth + 1) if inner else v)
        return items
    return value
