"""Writing a capture: the writer (`writer`) and its process beside the engine (`writer_process` starts it,
`writer_child` runs in it), the frames it takes (`frame_protocol`) and their transport from the engine thread
(`shm_channel`, `wire`, `image_frames`, `image_batch`), the shadow request table it folds into keyframes
(`keyframe_maker`), compression and I/O off the recording thread (`emitter`), and who may read the file
(`filemode`)."""
