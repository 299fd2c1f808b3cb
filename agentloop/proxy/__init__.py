"""The proxy: OpenAI Chat, Anthropic Messages and OpenAI Responses APIs over one token ledger, recording LLM calls."""

from agentloop.proxy.ledger import LedgerEntry, PromptPlan, TokenLedger
from agentloop.proxy.schemas import ProxyError
from agentloop.proxy.server import Proxy, ProxyState
from agentloop.proxy.sessions import SessionRecord, SessionTable
from agentloop.proxy.tool_parser import ParsedOutput, parse_tool_calls

__all__ = [
    "LedgerEntry",
    "ParsedOutput",
    "PromptPlan",
    "Proxy",
    "ProxyError",
    "ProxyState",
    "SessionRecord",
    "SessionTable",
    "TokenLedger",
    "parse_tool_calls",
]
