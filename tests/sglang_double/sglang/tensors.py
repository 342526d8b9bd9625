"""`/update_weights_from_tensor` as SGLang 0.5.23 checks it, short of loading anything (tests only).

SGLang decodes each entry of `serialized_named_tensors` from base64 (`validate=True`,
srt/utils/common.py `normalize_serialized_named_tensor_payload`), has TP rank i unpickle entry i
with its SafeUnpickler (managers/tp_worker.py `deserialize_own_rank`), whose allowed globals are
data containers and torch's rebuild functions, and loads the `[(name, tensor), ...]` it gets
(model_executor/model_runner_components/weight_updater.py). The double unpickles nothing: it
walks each pickle's opcodes (`pickletools.genops`, which runs no code) and checks that every
global it would import is one of SafeUnpickler's that a tensor pickle uses. It also records the
control calls it serves, in order (`SGLANG_SHIM_CALLS`), so that tests can assert a sequence.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import pickletools
from typing import Any

# srt/utils/common.py SafeUnpickler.ALLOWED_GLOBALS, the part a ForkingPickler pickle of tensors
# (CPU or CUDA) uses.
TENSOR_GLOBALS = {
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("copyreg", "__newobj__"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "dtype"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
} | {("torch", name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")}


def pickle_globals(data: bytes) -> set[tuple[str, str]]:
    """The globals a pickle would import, read from its opcodes (nothing is executed). A
    STACK_GLOBAL takes the two values the ops before it pushed: strings, or memo entries that
    were strings (MEMOIZE pushes nothing); anything else cannot be told and is refused."""
    found: set[tuple[str, str]] = set()
    pushed: list[str | None] = []  # what each op pushed: a string, or None for anything else
    memo: dict[int, str | None] = {}
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            found.add((module, name))
        elif op.name == "STACK_GLOBAL":
            if len(pushed) < 2 or None in pushed[-2:]:
                raise ValueError("a STACK_GLOBAL whose names are not plain strings")
            found.add((pushed[-2], pushed[-1]))
        if op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = pushed[-1] if pushed else None
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            pushed.append(arg)
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        else:
            pushed.append(None)
    return found


def payload_error(req: dict[str, Any], tp_size: int) -> str | None:
    """Why SGLang would refuse (or fail on) this body; None when it would load it."""
    entries = req.get("serialized_named_tensors")
    if not isinstance(entries, list) or len(entries) != tp_size:
        return f"serialized_named_tensors must hold one entry per TP rank ({tp_size}), got {type(entries).__name__}"
    for rank, entry in enumerate(entries):
        if not isinstance(entry, str):
            return f"serialized_named_tensors[{rank}]: a base64 string expected over HTTP"
        try:
            data = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError) as exc:
            return f"serialized_named_tensors[{rank}]: not base64 ({exc})"
        if len(data) < 2 or data[0] != 0x80:
            return f"serialized_named_tensors[{rank}]: not a pickle"
        try:
            used = pickle_globals(data)
        except (ValueError, IndexError) as exc:  # a truncated or malformed pickle
            return f"serialized_named_tensors[{rank}]: a broken pickle ({exc})"
        if blocked := sorted(used - TENSOR_GLOBALS):
            return f"Blocked unsafe global ({'.'.join(blocked[0])}) during pickle deserialization"
    if req.get("load_format") not in (None, "direct", "flattened_bucket"):
        return f"Unknown load_format={req.get('load_format')}"
    return None


def record_call(path: str, body: bytes) -> None:
    """Append `{"path", "tags"?, "entries"?}` to `SGLANG_SHIM_CALLS` when set."""
    where = os.environ.get("SGLANG_SHIM_CALLS")
    if not where:
        return
    try:
        req = json.loads(body) if body else {}
    except ValueError:
        req = {}
    line: dict[str, Any] = {"path": path}
    if isinstance(req, dict) and "tags" in req:
        line["tags"] = req["tags"]
    if isinstance(req, dict) and isinstance(req.get("serialized_named_tensors"), list):
        line["entries"] = len(req["serialized_named_tensors"])
    with open(where, "a") as f:
        f.write(json.dumps(line) + "\n")
