"""The writer process's side of image frames (`writer_child`): a step's images kept as they are until the step
ends, then stored (`StepImage`); arrivals converted into contracts. Frame kinds and payloads: `frame_protocol`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from replay.capture.codec.step_image import OutputParts
from replay.capture.format import records as fmt
from replay.capture.writing import frame_protocol as fp
from replay.contracts import EngineCoreRequest, GrammarOutput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from replay.capture.writing.writer import CaptureWriter

_RAW = msgspec.Raw
# Image frames decoded as far as their envelope: the images stay raw bytes for `ImageDecoder`
_P = msgspec.msgpack.Decoder(tuple[int, _RAW, int, int])  # index, SchedulerOutput, start_ns, schedule_ns
_G = msgspec.msgpack.Decoder(tuple[int, _RAW])  # index, GrammarOutput
_O = msgspec.msgpack.Decoder(tuple[int, _RAW, int, int])  # index, ModelRunnerOutput (or nil), execute_ns, update_ns
_L = msgspec.msgpack.Decoder(tuple[int, OutputParts, int, int])  # the same, the output in parts
_E = msgspec.msgpack.Decoder(tuple[int, str, str, str])  # index, error type, message, traceback
_V = msgspec.msgpack.Decoder(tuple[int, _RAW, _RAW, _RAW, list[int] | None])  # output and grammar may be nil

_R = msgspec.msgpack.Decoder(tuple[int, _RAW])  # step, request


class ImageFrames:
    """The child's side of image frames: steps stored as the images they are (`StepImage`), arrivals converted
    into contracts (`ImageDecoder`: typed, else tolerant)."""

    def __init__(self):
        self.dec = None
        self.pending: dict[int, list] = {}  # index -> [scheduler_output image, grammar image, start, schedule_ns]
        self.crash: fmt.Crash | None = None

    def crash_status(self) -> str:
        """The footer status once the engine raised during a step ("" when it did not)."""
        return self.crash.status() if self.crash else ""

    def warm(self) -> None:
        """Import and compile the decoders now, before the engine's first step rather than during it."""
        if self.dec is None:
            from replay.contracts.image_decoder import ImageDecoder

            self.dec = ImageDecoder()
            self.dec.prepare(SchedulerOutput[str], ModelRunnerOutput[str], GrammarOutput[str], EngineCoreRequest)

    def write(self, writer: CaptureWriter, kind: bytes, payload: bytes) -> None:
        """Hand what one image frame completes to `writer`."""
        self.warm()
        writer.image_decoder = self.dec
        if kind == fp.REQUEST_IMAGE:
            step, request = _R.decode(payload)
            writer.add_request(self.dec.decode(request, EngineCoreRequest), step)
            return
        if kind == fp.SCHEDULED:
            index, so, start, schedule_ns = _P.decode(payload)
            self.pending[index] = [so, None, start, schedule_ns]
            return
        if kind == fp.GRAMMAR:
            index, go = _G.decode(payload)
            if index in self.pending:
                self.pending[index][1] = go
            return
        if kind in (fp.OUTPUT, fp.OUTPUT_PARTS, fp.STEP_FAILED):
            head = (_O.decode(payload) if kind == fp.OUTPUT else _L.decode(payload) if kind == fp.OUTPUT_PARTS
                    else _E.decode(payload))
            index = head[0]
            so, go, start, schedule_ns = self.pending.pop(index)
            if kind == fp.STEP_FAILED:  # the step raised: a Crash record, then the step as scheduled, with no output
                self.crash = fmt.Crash(*head)
                writer.write_crash(self.crash)
                writer.write_step_image(index, so, None, go, fmt.StepTiming(start, schedule_ns))
                return
            _, mro, execute_ns, update_ns = head
            writer.write_step_image(index, so, mro, go, fmt.StepTiming(start, schedule_ns, execute_ns, update_ns))
            return
        index, so, mro, go, timing = _V.decode(payload)
        writer.write_step_image(index, so, mro, go, None if timing is None else fmt.StepTiming(*timing))

