"""A step's stored form, both ways: in-memory contracts <-> what a chunk stores (`stepcodec`, with its per-request
passes in `passes`), logprob columns (`columns`), another engine's steps kept as images (`step_image`)."""
