"""sql_agent: a LangGraph agent answering questions over a generated SQLite database."""
