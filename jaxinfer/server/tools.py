"""Tool calls for the chat API: the constraint that forces a call, and the parser that finds calls
in the generated text, for the two formats the supported chat templates use:

- "hermes" (Qwen2.5, Qwen3, Hermes, and ChatML models such as SmolLM2): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- "llama3_json" (Llama 3.1 / 3.2 / 3.3): the whole reply is one JSON object
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.

`tool_choice` "auto" lets the model answer or call (the text is parsed afterwards); "none" keeps
the tools out of the prompt and parses nothing; "required" and a named function are enforced
with a grammar (a `StructuredOutputsParams`): the output is then always a well-formed call whose
arguments follow the function's `parameters` schema.
"""

from __future__ import annotations

import json
import re
import uuid

from jaxinfer.sampling_params import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")


class ToolError(ValueError):
    """A malformed `tools` / `tool_choice` (the message names the field)."""


def detect_parser(chat_template: str | None) -> str:
    """The call format a chat template teaches its model: llama3_json for Llama 3's templates
    (they mention <|python_tag|> or "parameters" of a JSON call), hermes otherwise."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return "llama3_json"
    return "hermes"


def check_tools(tools, tool_choice) -> tuple[list[dict], str | dict]:
    """Validated (tools, tool_choice); the choice defaults to "auto" with tools, "none" without."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolError("'tools' must be an array")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}].function.name must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise ToolError(f"tool_choice={tool_choice!r}: expected 'auto', 'none', 'required' or a named function")
        if tool_choice == "required" and not tools:
            raise ToolError("tool_choice='required' needs 'tools'")
    else:
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in {t["function"]["name"] for t in tools}:
            raise ToolError(f"tool_choice names function {name!r}, which is not in 'tools'")
    return tools, tool_choice


def _call_schema(fn: dict, parser: str) -> dict:
    args = "parameters" if parser == "llama3_json" else "arguments"
    parameters = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args: parameters},
            "required": ["name", args], "additionalProperties": False}


def forced_call_constraint(tools: list[dict], tool_choice, parser: str, *, parallel: bool = True) -> StructuredOutputsParams | None:
    """The grammar that makes the output a call, for tool_choice "required" or a named function
    (None for "auto" and "none"); `parallel` (OpenAI's parallel_tool_calls): Hermes replies may
    hold several calls."""
    if tool_choice in ("auto", "none"):
        return None
    fns = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        fns = [f for f in fns if f["name"] == tool_choice["function"]["name"]]
    schemas = [_call_schema(f, parser) for f in fns]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if parser == "llama3_json":
        return StructuredOutputsParams(json=schema)
    # hermes: one or more <tool_call> blocks, each holding one call object, its JSON without free
    # whitespace (as StructuredOutputsParams' JSON: a small model can pad it with spaces forever)
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    lark = (('start: call ("\\n" call)*\n' if parallel else "start: call\n") +
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema)}\n")
    return StructuredOutputsParams(grammar=lark)


def _new_call(name: str, arguments) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str, parser: str, tool_names: set[str]) -> tuple[str | None, list[dict]]:
    """(content left, tool calls) found in a reply. A reply with no well-formed call of a known
    function is all content."""
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        calls = call if isinstance(call, list) else [call]
        if calls and all(isinstance(c, dict) and c.get("name") in tool_names and isinstance(c.get("parameters", c.get("arguments")), dict)
                         for c in calls):
            return None, [_new_call(c["name"], c.get("parameters", c.get("arguments"))) for c in calls]
        return text, []
    calls, kept = [], []
    last = 0
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in tool_names and isinstance(call.get("arguments", {}), dict):
            calls.append(_new_call(call["name"], call.get("arguments", {})))
            kept.append(text[last:m.start()])
            last = m.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls
