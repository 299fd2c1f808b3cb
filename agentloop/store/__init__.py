"""Rollout stores: one protocol, one state machine, three backends (memory, SQLite, HTTP)."""

from agentloop.store.base import Store
from agentloop.store.client import StoreClient
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer
from agentloop.store.sqlite import SQLiteStore

__all__ = ["MemoryStore", "SQLiteStore", "Store", "StoreClient", "StoreServer"]
