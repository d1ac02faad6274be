"""Integrations with other engines (they import those engines lazily; the core never imports them)."""
