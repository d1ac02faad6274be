"""Writing a capture: the writer (`writer`) and its process beside the engine (`writer_process`, `process`),
the transport from the engine thread (`ring`, `wire`, `image_frames`, `image_batch`), compression and I/O off the
recording thread (`emitter`), and who may read the file (`filemode`)."""
