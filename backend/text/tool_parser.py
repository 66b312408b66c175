"""MiniMax-M3 tool-call parser (non-streaming and streaming).

Markup (formats.md 5.2), every tag prefixed by NS:
  NS<tool_call>\\n NS<invoke name="fn"> NS<arg>value NS</arg> ... NS</invoke>\\n NS</tool_call>
Nested objects are child tags, arrays are repeated NS<item> tags. A block that does not
parse is returned verbatim as content; nothing here raises on model output.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .reasoning import THINK_END
from .stop_strings import partial_suffix_len

NS = "]<]minimax[>["
CALL_START = NS + "<tool_call>"
CALL_END = NS + "</tool_call>"

_TAG = re.compile(r"<(/?)([^\s<>/]+)([^<>]*)>")
_NAME_ATTR = re.compile(r"""\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))\s*""")
_INT = re.compile(r"[+-]?\d+")


class _Malformed(Exception):
    pass


# ---------------------------------------------------------------- markup -> tree

def _events(inner: str) -> list[tuple]:
    """Split block text into ("text", s) / ("open", name, attrs) / ("close", name)."""
    pieces = inner.split(NS)
    events: list[tuple] = [("text", pieces[0])] if pieces[0] else []
    for piece in pieces[1:]:
        m = _TAG.match(piece)
        if m is None:
            raise _Malformed("namespace prefix without a tag")
        closing, name, attrs = m.groups()
        if closing:
            if attrs.strip():
                raise _Malformed("attributes on a closing tag")
            events.append(("close", name))
        else:
            events.append(("open", name, attrs))
        if piece[m.end():]:
            events.append(("text", piece[m.end():]))
    return events


def _parse_content(events: list[tuple], i: int, close: str) -> tuple[Any, int]:
    """Parse up to the matching close tag: a str leaf or a list of (name, node) children."""
    texts: list[str] = []
    children: list[tuple[str, Any]] = []
    while i < len(events):
        ev = events[i]
        if ev[0] == "text":
            texts.append(ev[1])
            i += 1
        elif ev[0] == "close":
            if ev[1] != close:
                raise _Malformed(f"</{ev[1]}> closes <{close}>")
            if children:
                if any(t.strip() for t in texts):
                    raise _Malformed("text mixed with child tags")
                return children, i + 1
            return "".join(texts), i + 1
        else:
            if ev[2].strip():
                raise _Malformed("attributes on an argument tag")
            node, i = _parse_content(events, i + 1, ev[1])
            children.append((ev[1], node))
    raise _Malformed(f"unclosed <{close}>")


def _parse_block(block: str) -> list[tuple[str, Any]]:
    """Block text (with its start/end tags) -> [(function name, argument tree)]."""
    events = _events(block[len(CALL_START):len(block) - len(CALL_END)])
    calls, i = [], 0
    while i < len(events):
        ev = events[i]
        if ev[0] == "text" and not ev[1].strip():
            i += 1
            continue
        if ev[0] != "open" or ev[1] != "invoke":
            raise _Malformed("expected <invoke>")
        m = _NAME_ATTR.fullmatch(ev[2])
        name = m and next(g for g in m.groups() if g is not None).strip()
        if not name:
            raise _Malformed("invoke without a name")
        args, i = _parse_content(events, i + 1, "invoke")
        if isinstance(args, str):
            if args.strip():
                raise _Malformed("bare text inside <invoke>")
            args = []
        calls.append((name, args))
    return calls


# ---------------------------------------------------------------- schema coercion

def _variants(schema: Any) -> list[dict]:
    if not isinstance(schema, dict):
        return []
    out = [schema]
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            out.extend(_variants(sub))
    return out


def _types(schema: Any) -> list[str]:
    """Declared JSON types of a schema, in order; [] when unknown."""
    types: list[str] = []
    for s in _variants(schema):
        t = s.get("type")
        found = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] \
            if isinstance(t, list) else []
        if not found and "enum" in s:
            found = [_json_type(v) for v in s["enum"]]
        if not found and "properties" in s:
            found = ["object"]
        if not found and "items" in s:
            found = ["array"]
        types.extend(x for x in found if x not in types)
    return types


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return {dict: "object", list: "array"}.get(type(v), "string")


def _sub(schema: Any, key: str, name: str | None = None) -> Any:
    """Schema of property `name` (key="properties") or of array items (key="items")."""
    for s in _variants(schema):
        val = s.get(key)
        if key == "properties" and isinstance(val, dict) and name in val:
            return val[name]
        if key == "items" and isinstance(val, dict):
            return val
    return None


def _coerce_one(text: str, t: str) -> tuple[bool, Any]:
    s = text.strip()
    if t in ("integer", "number"):
        if _INT.fullmatch(s):
            return True, int(s)
        try:
            f = float(s)
        except ValueError:
            return False, None
        if not math.isfinite(f):
            return False, None
        return (f.is_integer(), int(f)) if t == "integer" else (True, f)
    if t == "boolean":
        return (s.lower() in ("true", "false")), s.lower() == "true"
    if t in ("object", "array"):
        if not s:
            return True, {} if t == "object" else []
        try:
            v = json.loads(s)
        except ValueError:
            return False, None
        return isinstance(v, dict if t == "object" else list), v
    return False, None


def _coerce_leaf(text: str, schema: Any) -> Any:
    types = _types(schema)
    for t in types:
        if t not in ("string", "null"):
            ok, v = _coerce_one(text, t)
            if ok:
                return v
    if "null" in types and "string" not in types and text.strip() == "null":
        return None
    return text


def _to_value(node: Any, schema: Any) -> Any:
    if isinstance(node, str):
        return _coerce_leaf(node, schema)
    types = _types(schema)
    as_array = all(k == "item" for k, _ in node) and ("object" not in types or "array" in types)
    if as_array:
        item_schema = _sub(schema, "items")
        return [_to_value(child, item_schema) for _, child in node]
    return {k: _to_value(child, _sub(schema, "properties", k)) for k, child in node}


def _schemas(tools: list[dict] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters")
    return out


def _calls_from_block(block: str, schemas: dict[str, Any]) -> list[dict] | None:
    """Parsed calls of one complete block, or None if it is malformed."""
    try:
        parsed = _parse_block(block)
        calls = []
        for name, args in parsed:
            schema = schemas.get(name)
            calls.append({"name": name, "arguments": {
                k: _to_value(v, _sub(schema, "properties", k)) for k, v in args}})
        return calls
    except (_Malformed, RecursionError, ValueError, TypeError):
        return None


# ---------------------------------------------------------------- public API

def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """Split a full output into (content, [{"name", "arguments": dict}])."""
    schemas = _schemas(tools)
    content: list[str] = []
    calls: list[dict] = []
    pos = 0
    while True:
        i = text.find(CALL_START, pos)
        j = text.find(CALL_END, i + len(CALL_START)) if i >= 0 else -1
        if j < 0:
            content.append(text[pos:])
            return "".join(content), calls
        end = j + len(CALL_END)
        content.append(text[pos:i])
        parsed = _calls_from_block(text[i:end], schemas)
        if parsed is None:
            content.append(text[i:end])
        else:
            calls.extend(parsed)
        pos = end


def forced_call_prefix(thinking_mode: str | None, name: str | None = None) -> tuple[str, str]:
    """A reply that must be a tool call (tool_choice "required", or the function `name`): (the text to put
    after the chat template's generation prompt, the part of it the tool parser reads before the output).
    The reply opens as an assistant turn without reasoning that calls a tool renders in history: `</mm:think>`
    (the generation prompt already ends with it when thinking is "disabled"; after the `<mm:think>` it ends
    with when "enabled", the reasoning is empty), then `NS<tool_call>` and a newline, then for a named function
    `NS<invoke name="...">`; the model writes the rest."""
    call = CALL_START + "\n" + (f'{NS}<invoke name="{name}">' if name is not None else "")
    return ("" if thinking_mode == "disabled" else THINK_END) + call, call


class ToolCallStreamParser:
    """Streaming `parse_tool_calls`: content flows until a possible block start, then
    the block is held and released as calls (or as text, if malformed) when it closes."""

    def __init__(self, tools: list[dict] | None = None):
        self._schemas = _schemas(tools)
        self._buf = ""
        self._inside = False
        self._scanned = 0  # inside a block: CALL_END not found in _buf[:_scanned]

    @property
    def in_tool_call(self) -> bool:
        return self._inside

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """Add text; return (content delta, calls completed by this delta)."""
        self._buf += delta
        content: list[str] = []
        calls: list[dict] = []
        while True:
            buf = self._buf
            if not self._inside:
                i = buf.find(CALL_START)
                if i >= 0:
                    content.append(buf[:i])
                    self._buf, self._inside, self._scanned = buf[i:], True, len(CALL_START)
                    continue
                keep = partial_suffix_len(buf, (CALL_START,))
                content.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
            j = buf.find(CALL_END, max(len(CALL_START), self._scanned - len(CALL_END) + 1))
            if j < 0:
                self._scanned = len(buf)
                break
            end = j + len(CALL_END)
            parsed = _calls_from_block(buf[:end], self._schemas)
            if parsed is None:
                content.append(buf[:end])
            else:
                calls.extend(parsed)
            self._buf, self._inside = buf[end:], False
        return "".join(content), calls

    def flush(self) -> tuple[str, list[dict]]:
        """End of output: an unterminated block or partial prefix becomes content."""
        out, self._buf, self._inside = self._buf, "", False
        return out, []
