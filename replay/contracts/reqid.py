"""The request-id type parameter shared by the step contracts.

In memory a request id is vLLM's string (`"cmpl-<32 hex>-0"`, or `"0-bf63b3db"` from `LLM.generate`). On disk
the capture writes each id once and refers to it by a small int handle: a decode step names every running id four
times (cached req_ids, `num_scheduled_tokens` keys, `req_ids`, `req_id_to_index` keys), which was about 40 KB of
a 59 KB frame in our measurements. The step contracts are therefore generic in the id type: `SchedulerOutput`
(= `SchedulerOutput[str]`) is what engines and users see; `SchedulerOutput[int]` is what the capture stores.
"""

from typing import TypeVar

RID = TypeVar("RID", str, int)
