"""JSON views: field names for array-like Structs, arrays as values, non-finite floats spelled out."""

import json

import numpy as np

from replay.contracts import Array, FinishReason, LogprobsLists, ModelRunnerOutput
from replay.jsonable import dumps, to_jsonable


def test_structs_get_field_names_and_arrays_values():
    lp = LogprobsLists(Array.from_numpy(np.array([[3, 3]], np.int32)),
                       Array.from_numpy(np.array([[-np.inf, np.nan]], np.float32)),
                       Array.from_numpy(np.array([1], np.int64)))
    out = json.loads(dumps(ModelRunnerOutput(["a"], {"a": 0}, [[3]], lp)))
    assert out["req_ids"] == ["a"] and out["req_id_to_index"] == {"a": 0}
    assert out["logprobs"]["logprobs"] == {"dtype": "float32", "shape": [1, 2], "values": [["-inf", "nan"]]}
    assert to_jsonable(FinishReason.LENGTH) == "LENGTH"
    assert to_jsonable({3, 1, 2}) == [1, 2, 3]
