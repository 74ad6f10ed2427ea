//! QStash-compatible dev server.
