"""`replay trainer`: a capture's sequences scored as an RL trainer scores them (one teacher-forced `transformers`
forward, `log_softmax(logits / temperature)` over the whole vocabulary), against the logprobs vLLM returned."""

from replay.trainer.score import TrainerOptions, TrainerReport, score_capture

__all__ = ["TrainerOptions", "TrainerReport", "score_capture"]
