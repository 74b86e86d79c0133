"""Which request fields become a grammar the output must follow (a StructuredOutput for the engine).

OpenAI: `response_format` json_object / json_schema; vLLM: `structured_outputs` and the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`; Ollama: `format` ("json" or a schema). A request may give
at most one of them (two are a 400 naming the second). Tool choices that force a call (`required`, a named
function) are grammars too: their output is the call as JSON, held to the functions' parameter schemas, as
vLLM does it (`tool_choice_constraint`).
"""

from __future__ import annotations

import json
from typing import Any

from tokenloom.errors import InvalidRequest
from tokenloom.sampling_params import StructuredOutput
from tokenloom.serve.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, Tool

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _schema_text(schema: dict[str, Any] | str, field: str) -> str:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"{field}: not valid JSON: {e}", field) from None
        return schema
    return json.dumps(schema)


def request_constraint(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
    """The one output constraint a request's fields ask for, or None."""
    found: list[StructuredOutput] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(StructuredOutput("json_object", field="response_format"))
    elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = fmt.json_schema.json_schema or ANY_OBJECT
        found.append(StructuredOutput("json_schema", json.dumps(schema), field="response_format.json_schema"))
    so = body.structured_outputs
    if so is not None:
        found += _guided("structured_outputs.", so.json_, so.regex, so.choice, so.grammar)
        if so.json_object:
            found.append(StructuredOutput("json_object", field="structured_outputs.json_object"))
    found += _guided("guided_", body.guided_json, body.guided_regex, body.guided_choice, body.guided_grammar)
    if len(found) > 1:
        raise InvalidRequest(f"{found[1].field}: only one output constraint per request (already "
                             f"{found[0].field})", found[1].field)
    return found[0] if found else None


def _guided(prefix: str, schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None,
            grammar: str | None) -> list[StructuredOutput]:
    """vLLM's json / regex / choice / grammar constraints, named `{prefix}json` and so on: the fields of
    `structured_outputs` ("structured_outputs.") and the older `guided_*` ones ("guided_")."""
    found = []
    if schema is not None:
        field = prefix + "json"
        found.append(StructuredOutput("json_schema", _schema_text(schema, field), field=field))
    if regex is not None:
        found.append(StructuredOutput("regex", regex, field=prefix + "regex"))
    if choice is not None:
        found.append(StructuredOutput("choice", choices=tuple(choice), field=prefix + "choice"))
    if grammar is not None:
        found.append(StructuredOutput("grammar", grammar, field=prefix + "grammar"))
    return found


def ollama_constraint(fmt: str | dict[str, Any] | None) -> StructuredOutput | None:
    """Ollama's `format`: "json" (a JSON object: what clients asking for JSON parse) or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return StructuredOutput("json_object", field="format")
    return StructuredOutput("json_schema", json.dumps(fmt), field="format")


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_choice_constraint(tools: list[Tool], choice: str | NamedToolChoice, parallel: bool) -> StructuredOutput:
    """`required`: a JSON array of calls [{"name": ..., "parameters": {...}}] (one call unless parallel
    tool calls are allowed), each held to its function's schema; a named function: its arguments object."""
    if isinstance(choice, NamedToolChoice):
        i, tool = next((i, t) for i, t in enumerate(tools) if t.function.name == choice.function.name)
        return StructuredOutput("json_schema", json.dumps(_parameters(tool)), field=f"tools.{i}.function.parameters")
    call = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                       "parameters": _parameters(t)},
                       "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput("json_schema", json.dumps(schema), field="tools")
