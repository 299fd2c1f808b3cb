"""The tables of app sessions in a SQLite store (what each holds: agentloop.store.sessions).

A module of its own that imports nothing, so that ``SQLiteStore`` (agentloop.store.sqlite) creates
them with its own tables and ``SessionJournal`` (agentloop.store.sessions), which writes them
through a ``SQLiteStore``, sits above both.
"""

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    rewards TEXT NOT NULL DEFAULT '[]') WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS session_calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS session_calls_by_session ON session_calls(session_id, id);
CREATE TABLE IF NOT EXISTS session_owners (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS store_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS session_trained (
    session_id TEXT PRIMARY KEY, update_index INTEGER NOT NULL, run TEXT NOT NULL, trained_at REAL NOT NULL,
    outcome TEXT NOT NULL DEFAULT 'training', version INTEGER) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS session_trained_by_update ON session_trained(run, update_index);
"""
