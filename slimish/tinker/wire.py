"""The Tinker SDK's wire formats, in and out: protobuf `ForwardBackwardRequest` -> `Datum`s, results ->
protobuf `ForwardBackwardOutput` / `SampleResponse`, and the JSON requests checked against the SDK's
own request models (tinker 0.38.0: types/*.py), so a field the SDK would reject is rejected here too.

The protobuf messages are the SDK's (tinker 0.38.0: proto/tinker_public_pb2.py); the layouts follow
its readers and writers (tinker 0.38.0: proto/request_conv.py, proto/response_conv.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pydantic
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from slimish.tinker.training import Datum

PROTOBUF = "application/x-protobuf"
M = TypeVar("M", bound=pydantic.BaseModel)

# proto DType -> numpy; bfloat16 arrives as the upper 16 bits of a float32 (response_conv.py:36-41)
DTYPES = {
    pb.DTYPE_FLOAT32: np.float32,
    pb.DTYPE_INT64: np.int64,
    pb.DTYPE_INT32: np.int32,
    pb.DTYPE_BFLOAT16: np.uint16,
}


class WireError(ValueError):
    """A request the SDK could not have meant; the message names the field."""


def parse(model: type[M], body: Any) -> M:
    """A JSON body as the SDK's request model `model`; a 400-worthy WireError naming each bad field."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        where = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise WireError(f"{model.__name__}: {where}") from None


def read_tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    """A proto `Tensor` (dense, or 2-D sparse CSR as the SDK writes 2-D torch inputs) as a dense array."""
    if msg.dtype not in DTYPES:
        raise WireError(f"{where}.dtype: unsupported proto dtype {msg.dtype}")
    dtype, shape = np.dtype(DTYPES[msg.dtype]), tuple(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype)
        crow, col = np.frombuffer(csr.crow_indices, np.int64), np.frombuffer(csr.col_indices, np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise WireError(f"{where}: a sparse CSR tensor needs a 2-D shape, rows+1 crow_indices, one col per value")
        array = np.zeros(shape, dtype)
        array[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
    else:
        array = np.frombuffer(msg.dense, dtype).copy()
        if shape:
            if int(np.prod(shape)) != array.size:
                raise WireError(f"{where}: shape {list(shape)} does not hold the {array.size} values sent")
            array = array.reshape(shape)
    if msg.dtype == pb.DTYPE_BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.int64) if msg.dtype == pb.DTYPE_INT32 else array


def read_tokens(chunks: Sequence[pb.Chunk], where: str) -> list[int]:
    """The token ids of a datum's `model_input`: its encoded_text chunks in order."""
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"{where}.model_input[{j}]: {kind} chunks are not supported, only encoded_text (token ids)")
        tokens += np.frombuffer(chunk.encoded_text.tokens, np.int32).tolist()
    return tokens


@dataclass
class ForwardBackwardCall:
    """One `/forward_backward` (or `/forward`) chunk, decoded."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool


def read_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A protobuf `ForwardBackwardRequest` (tinker 0.38.0: proto/request_conv.py:93-129); `loss_fn_config_v2`
    (numbers and strings) wins over the legacy float map, which the SDK writes as a mirror."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireError(f"ForwardBackwardRequest: not a protobuf message ({exc})") from None
    if not msg.model_id:
        raise WireError("ForwardBackwardRequest.model_id: missing")
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = [
        Datum(
            tokens=read_tokens(d.model_input, f"data[{i}]"),
            inputs={k: read_tensor(t, f"data[{i}].loss_fn_inputs.{k}") for k, t in d.loss_fn_inputs.items()},
        )
        for i, d in enumerate(msg.data)
    ]
    return ForwardBackwardCall(msg.model_id, msg.seq_id, data, msg.loss_fn, config, msg.forward_only)


def _batched(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    """Per-datum arrays of one trailing shape as a `BatchedTensor`: concatenated bytes and N+1 byte offsets."""
    ints = np.issubdtype(arrays[0].dtype, np.integer)
    dtype = np.int64 if ints else np.float32
    parts = [np.ascontiguousarray(a, dtype).tobytes() for a in arrays]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    return pb.BatchedTensor(
        data=b"".join(parts),
        offsets=offsets.tobytes(),
        dtype=pb.DTYPE_INT64 if ints else pb.DTYPE_FLOAT32,
        trailing_shape=list(arrays[0].shape[1:]),
    )


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput` bytes: the per-datum outputs as ArrayRecords, one per run of datums whose
    fields share their trailing shapes (the reader concatenates records, response_conv.py:190-261)."""
    records: list[list[dict[str, np.ndarray]]] = []
    shapes = None
    for out in outputs:
        out = {k: np.asarray(v) for k, v in out.items()}
        key = {k: v.shape[1:] for k, v in out.items()}
        if key != shapes:
            records.append([])
            shapes = key
        records[-1].append(out)
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    for run in records:
        msg.loss_fn_outputs.append(
            pb.ArrayRecord(
                type_tag="ArrayRecord",
                num_datums=len(run),
                fields={k: _batched([o[k] for o in run]) for k in run[0]},
            )
        )
    return msg.SerializeToString()


def _topk(rows: list[list[tuple[int, float]]]) -> pb.TopkLogprobs:
    """`TopkLogprobs` (row-major [length, k]); rows shorter than k are padded with token -1, logprob -inf."""
    k = max((len(r) for r in rows), default=0)
    ids = np.full((len(rows), k), -1, np.int32)
    lps = np.full((len(rows), k), -np.inf, np.float32)
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate(row):
            ids[i, j], lps[i, j] = token, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


@dataclass
class Sampled:
    """One sampled sequence as the server hands it to `sample_response`."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # False: it ran to max_tokens
    topk: list[list[tuple[int, float]]] | None = None


def sample_response(
    sequences: list[Sampled],
    prompt_logprobs: list[float] | None = None,
    topk_prompt: list[list[tuple[int, float]]] | None = None,
) -> bytes:
    """`SampleResponse` bytes (tinker 0.38.0: proto/response_conv.py:62-124); prompt logprobs carry NaN
    where no logprob exists (position 0)."""
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, np.float32).tobytes()
        if s.topk is not None:
            seq.topk_sampled_logprobs.CopyFrom(_topk(s.topk))
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    if topk_prompt is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt))
    return msg.SerializeToString()
