"""Integrations of agentloop with agent frameworks (LangGraph, the openai client)."""
