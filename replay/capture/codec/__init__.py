"""A step's stored form, both ways: in-memory contracts <-> what a chunk stores (`stepcodec`), logprob columns
(`columns`), another engine's steps kept as images (`step_image`), a prompt encoded once (`prompts`), and the
per-request passes in Python or compiled (`fastwire`, `_wire.c`, `_pack.c`)."""
