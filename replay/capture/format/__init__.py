"""The capture format: its records, limits and version (`records`), zstd frame boundaries (`frames`), request-id
handles (`ids`), and a stored record's tag read without decoding it (`peek`). Both other rooms build on it."""
