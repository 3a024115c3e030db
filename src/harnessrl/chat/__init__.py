"""The chat layer: messages and tools to prompt ids, completion ids to an assistant message (DESIGN.md §2, §5)."""
