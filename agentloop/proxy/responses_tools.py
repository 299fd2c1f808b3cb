"""The tools of a Responses request as the chat template's function tools, and the model's calls of
them as the Responses items the client expects.

Codex CLI declares more than plain functions. Each tool type becomes (``ToolMap.build``):

- ``function``: itself;
- ``namespace`` (``name``, ``description``, ``tools``): each member (a function or a custom tool)
  flattened to the function ``<namespace>__<name>``; its calls are answered with ``namespace`` and the
  member's own name, as the Responses API answers them (Codex dispatches on the pair);
- ``custom`` (free-form input, optionally a grammar): a function with one string argument ``input``
  (the grammar quoted in its description); a call is answered as a ``custom_tool_call`` item whose
  ``input`` is that string;
- ``local_shell``: a function ``local_shell`` (``command`` as a list of strings, ``workdir``,
  ``timeout_ms``); a call is answered as a ``local_shell_call`` item with an ``exec`` action;
- ``tool_search`` run by the client (``execution: "client"``): a function ``tool_search`` with its
  parameters; a call is answered as a ``tool_search_call`` item (``arguments`` an object). The tools
  a ``tool_search_output`` brings are shown to the model as that result's text and become callable
  (their calls are answered as above) without changing the tools in the system prompt, so the token
  ledger still extends;
- what runs on OpenAI's servers (``web_search*``, ``file_search``, ``code_interpreter``,
  ``image_generation``, ``computer_use*``, ``mcp``, a ``tool_search`` run by the server) and any type
  this module does not know: not offered to the model (``ToolMap.dropped``; the request parser logs
  them once per conversation: ``hosted tools not offered to the model``).

A call's arguments are what the model wrote; ``chat_call`` turns the item the client sends back into
the chat tool call again, with the model's own arguments when the client's item is the one the proxy
answered (``CallMemory``): a round trip through ``input`` or an ``exec`` action loses nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from agentloop.proxy.schemas import JSONDict, ProxyError, bad_request

SEPARATOR = "__"  # <namespace>__<name>: the flat name of a namespaced tool (MCP's convention)
LOCAL_SHELL, TOOL_SEARCH = "local_shell", "tool_search"
_LOCAL_SHELL_PARAMETERS: JSONDict = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"},
                    "description": 'The program and its arguments, e.g. ["bash", "-lc", "ls -la"]'},
        "workdir": {"type": "string", "description": "The directory to run it in"},
        "timeout_ms": {"type": "integer", "description": "Kill it after this many milliseconds"},
    },
    "required": ["command"],
}  # fmt: skip
_SEARCH_PARAMETERS: JSONDict = {
    "type": "object",
    "properties": {"query": {"type": "string"}},
    "required": ["query"],
}


@dataclass(frozen=True)
class ToolRef:
    """What the client calls a tool the model sees under a flat name."""

    kind: str  # "function" | "custom" | "local_shell" | "tool_search"
    name: str
    namespace: str | None = None


def flat_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


def _text(tool: JSONDict, key: str, where: str, required: bool = True) -> str | None:
    value = tool.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(
            f"{where}: a {tool.get('type')} tool needs a non-empty string {key!r}", f"{where}.{key}"
        )
    return value


def _parameters(tool: JSONDict, where: str) -> JSONDict:
    value = tool.get("parameters")
    if value is None:
        return {"type": "object", "properties": {}}
    if not isinstance(value, dict):
        raise bad_request(f"{where}: parameters must be a JSON schema object", f"{where}.parameters")
    return value


def _custom_description(tool: JSONDict) -> str:
    text = tool.get("description") or ""
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        text += (f"\n\nThis tool takes free-form text, not JSON: put it in `input`. The text follows this "
                 f"{fmt.get('syntax', 'lark')} grammar:\n{fmt['definition']}")  # fmt: skip
    return text.strip()


def _custom_parameters() -> JSONDict:
    return {"type": "object", "properties": {"input": {"type": "string", "description": "The tool's free-form input"}},
            "required": ["input"]}  # fmt: skip


@dataclass
class ToolMap:
    """The functions offered to the model and, per flat name, what the client calls it."""

    # the chat tools, {"type": "function", "function": {...}}, in the order the request declared them
    functions: list[JSONDict] = field(default_factory=list)
    refs: dict[str, ToolRef] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # hosted or unknown tool types, not offered

    @classmethod
    def build(cls, tools: Any, discovered: Iterable[Any] = ()) -> ToolMap:
        """From the request's ``tools`` (400 on a malformed one) and the tools that
        ``tool_search_output`` items brought (callable, not offered)."""
        out = cls()
        if tools is not None and not isinstance(tools, list):
            raise bad_request("tools must be a list of tool objects", "tools")
        for i, tool in enumerate(tools or []):
            out._add(tool, f"tools.{i}", offer=True)
        for tool in discovered:
            try:
                out._add(tool, "tool_search_output", offer=False)
            except ProxyError:  # the model reads it as text; a malformed one is just not callable
                continue
        return out

    def _add(self, tool: Any, where: str, offer: bool, namespace: str | None = None) -> None:
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise bad_request(f"{where}: a tool must be an object with a string 'type'", where)
        kind = tool["type"]
        if kind == "namespace" and namespace is None:
            ns = _text(tool, "name", where)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise bad_request(f"{where}: a namespace tool needs a list 'tools'", f"{where}.tools")
            for j, member in enumerate(members):
                self._add(member, f"{where}.tools.{j}", offer, ns)
        elif kind == "function":
            name = _text(tool, "name", where)
            assert name is not None
            self._offer(ToolRef("function", name, namespace), tool.get("description"), _parameters(tool, where),
                        where, offer)  # fmt: skip
        elif kind == "custom":
            name = _text(tool, "name", where)
            assert name is not None
            self._offer(ToolRef("custom", name, namespace), _custom_description(tool), _custom_parameters(),
                        where, offer)  # fmt: skip
        elif kind == LOCAL_SHELL and namespace is None:
            self._offer(ToolRef(LOCAL_SHELL, LOCAL_SHELL), "Runs a command on the user's machine.",
                        _LOCAL_SHELL_PARAMETERS, where, offer)  # fmt: skip
        elif kind == TOOL_SEARCH and namespace is None and tool.get("execution", "client") == "client":
            params = _parameters(tool, where) if tool.get("parameters") is not None else _SEARCH_PARAMETERS
            self._offer(ToolRef(TOOL_SEARCH, TOOL_SEARCH), tool.get("description"), params, where, offer)
        else:
            self.dropped.append(f"{namespace}.{kind}" if namespace else kind)

    def _offer(self, ref: ToolRef, description: Any, parameters: JSONDict, where: str, offer: bool) -> None:
        name = flat_name(ref.name, ref.namespace)
        if name in self.refs:
            if not offer:
                return  # a discovered tool the request already declares
            raise bad_request(f"{where}: the tool name {name!r} is declared twice", where)
        self.refs[name] = ref
        if offer:
            spec: JSONDict = {"name": name, "parameters": parameters}
            if isinstance(description, str) and description:
                spec["description"] = description
            self.functions.append({"type": "function", "function": spec})

    def ref(self, name: str) -> ToolRef:
        """The client's name for a flat name the model called (an undeclared name: a plain function)."""
        return self.refs.get(name) or ToolRef("function", name)

    @staticmethod
    def discovered_text(tools: Any) -> str:
        """A ``tool_search_output``'s tools as the model reads them: one JSON function per line."""
        found = ToolMap()
        for tool in tools if isinstance(tools, list) else []:
            try:
                found._add(tool, "tool_search_output", offer=True)
            except ProxyError:  # shown as text: a malformed one is left out
                continue
        return "\n".join(json.dumps(f["function"], ensure_ascii=False) for f in found.functions)

    def restrict(self, allowed: list[Any]) -> None:
        """Offer only the tools ``tool_choice: {"type": "allowed_tools"}`` names."""
        keep = set()
        for t in allowed:
            if isinstance(t, dict):
                name = t.get("name") if t.get("type") not in (LOCAL_SHELL, TOOL_SEARCH) else t["type"]
                if isinstance(name, str):
                    keep.add(
                        flat_name(name, t.get("namespace") if isinstance(t.get("namespace"), str) else None)
                    )
        self.functions = [f for f in self.functions if f["function"]["name"] in keep]


# ---------------------------------------------------------------- calls: model -> client and back


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def custom_input(arguments: str) -> str:
    """The free-form input of a custom tool call: ``input`` (or the one string argument the model wrote);
    else the arguments as the model wrote them."""
    args = _arguments(arguments)
    if isinstance(args, dict):
        if isinstance(args.get("input"), str):
            return str(args["input"])
        strings = [v for v in args.values() if isinstance(v, str)]
        if len(args) == 1 and strings:
            return strings[0]
    return arguments


def shell_action(arguments: str) -> JSONDict:
    """A ``local_shell`` call's arguments as a ``local_shell_call`` exec action (a command written as
    one string runs under ``bash -lc``)."""
    args = _arguments(arguments)
    args = args if isinstance(args, dict) else {"command": args}
    command = args.get("command")
    if isinstance(command, str):
        command = ["bash", "-lc", command]
    elif not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        command = ["bash", "-lc", arguments]
    workdir, timeout = args.get("workdir") or args.get("working_directory"), args.get("timeout_ms")
    return {"type": "exec", "command": command, "timeout_ms": timeout if isinstance(timeout, int) else None,
            "working_directory": workdir if isinstance(workdir, str) else None, "env": {}, "user": None}  # fmt: skip


def call_item(call: JSONDict, ref: ToolRef) -> tuple[JSONDict, Any]:
    """The output item for one chat tool call, and what of it the client will send back (``CallMemory``)."""
    call_id, arguments = call["id"], call["function"]["arguments"]
    suffix = call_id.removeprefix("call_")
    ns = {"namespace": ref.namespace} if ref.namespace else {}
    if ref.kind == "custom":
        text = custom_input(arguments)
        item = {"type": "custom_tool_call", "id": "ctc_" + suffix, "call_id": call_id, **ns, "name": ref.name,
                "input": text, "status": "completed"}  # fmt: skip
        return item, text
    if ref.kind == LOCAL_SHELL:
        action = shell_action(arguments)
        item = {"type": "local_shell_call", "id": "lsh_" + suffix, "call_id": call_id, "status": "completed",
                "action": action}  # fmt: skip
        return item, action
    if ref.kind == TOOL_SEARCH:
        args = _arguments(arguments)
        args = args if isinstance(args, dict) else {"query": arguments}
        item = {"type": "tool_search_call", "id": "tsc_" + suffix, "call_id": call_id, "execution": "client",
                "status": "completed", "arguments": args}  # fmt: skip
        return item, args
    item = {"type": "function_call", "id": "fc_" + suffix, "call_id": call_id, **ns, "name": ref.name,
            "arguments": arguments, "status": "completed"}  # fmt: skip
    return item, arguments


CallMemory = Callable[[str, Any], "str | None"]  # (call_id, the client's view) -> the model's arguments


def chat_call(item: JSONDict, memory: CallMemory) -> JSONDict:
    """A call item the client sent back (function_call, custom_tool_call, local_shell_call,
    tool_search_call; checked by the caller) as the chat tool call the model made."""
    kind, call_id = item["type"], item["call_id"]
    ns = item.get("namespace") if isinstance(item.get("namespace"), str) else None
    if kind == "function_call":
        name, view, arguments = flat_name(item["name"], ns), item["arguments"], item["arguments"]
    elif kind == "custom_tool_call":
        name, view = flat_name(item["name"], ns), item["input"]
        arguments = json.dumps({"input": view}, ensure_ascii=False)
    elif kind == "local_shell_call":
        name, view = LOCAL_SHELL, item["action"]
        act = view if isinstance(view, dict) else {}
        args = {"command": act.get("command")}
        args.update({k: v for k, v in (("workdir", act.get("working_directory")),
                                        ("timeout_ms", act.get("timeout_ms"))) if v is not None})  # fmt: skip
        arguments = json.dumps(args, ensure_ascii=False)
    else:  # tool_search_call
        name, view = TOOL_SEARCH, item["arguments"]
        arguments = view if isinstance(view, str) else json.dumps(view, ensure_ascii=False)
    remembered = memory(call_id, view) if kind != "function_call" else None
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": remembered or arguments},
    }


def tool_choice(choice: Any, tools: ToolMap) -> Any:
    """``tool_choice`` as the chat request's (400 when it forces a tool the proxy does not run)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        ns = choice.get("namespace") if isinstance(choice.get("namespace"), str) else None
        return {"type": "function", "function": {"name": flat_name(choice["name"], ns)}}
    if kind in (LOCAL_SHELL, TOOL_SEARCH) and kind in tools.refs:
        return {"type": "function", "function": {"name": kind}}
    if kind == "allowed_tools" and isinstance(choice.get("tools"), list):
        tools.restrict(choice["tools"])
        mode = choice.get("mode", "auto")
        return mode if mode in ("auto", "required") else "auto"
    if isinstance(kind, str) and kind not in ("function", "custom", "allowed_tools"):
        raise bad_request(
            f"tool_choice forces the tool {kind!r}, which is not offered to this model (hosted tools run on "
            'OpenAI\'s servers); use "auto", "required", "none" or a function the request declares',
            "tool_choice",
        )
    raise bad_request(
        'tool_choice must be "auto", "none", "required", {"type": "function", "name": ...}, '
        '{"type": "custom", "name": ...} or {"type": "allowed_tools", "mode": ..., "tools": [...]}',
        "tool_choice",
    )
