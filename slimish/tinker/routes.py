"""The Tinker API's routes, one router per flow of the SDK (tinker 0.38.0: resources/*.py, types/*.py):
the session (config, heartbeats, futures), training, checkpoints and sampling. Every long call
answers a future at once; `Api.ordered_call` puts a training client's calls in its seq_id order.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from slimish.tinker.config import TinkerConfig
from slimish.tinker.futures import Futures, Ordered, Result, UserError
from slimish.tinker.runs import Runs
from slimish.tinker.sampling import Sampler
from slimish.tinker.training import AdamParams, TinkerModels
from slimish.tinker.wire import PROTOBUF, forward_backward_output, parse, read_forward_backward

HEALTH = "/api/v1/healthz"


def future(rid: str, **extra: Any) -> JSONResponse:
    """The SDK's untyped future (tinker 0.38.0: types/shared/untyped_api_future.py)."""
    return JSONResponse({"request_id": rid, **extra})


@dataclass
class Api:
    """What the routes share: the models, their runs, the futures and their order, the sampler."""

    cfg: TinkerConfig
    models: TinkerModels
    runs: Runs
    futures: Futures
    ordered: Ordered
    sampler: Sampler
    # (model_id, seq_id) -> its request id: a call the SDK sends again gets the first one's future
    known: dict[tuple[str, int], str] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.cfg.model_name or self.cfg.model

    def check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in (self.model_name, self.cfg.model):
            raise UserError(f"base_model: {base_model!r} is not served here; this server trains {self.model_name!r}")

    def ordered_call(self, model_id: str, seq_id: int | None, work: Any, then: Any = None) -> JSONResponse:
        """`work()` (on the worker thread) in `model_id`'s seq_id order; its Result, or `then(its future)`'s."""
        self.runs.of(model_id)
        if seq_id is None:
            raise UserError("seq_id: required for a training client's call")
        if (model_id, seq_id) not in self.known:
            done = self.ordered.submit(model_id, seq_id, work)
            self.known[(model_id, seq_id)] = self.futures.start(then(done)) if then else self.futures.track(done)
        return future(self.known[(model_id, seq_id)], model_id=model_id)


def session_routes(api: Api) -> APIRouter:
    """Client config, sessions, heartbeats, telemetry and `/retrieve_future` (tinker 0.38.0:
    lib/internal_client_holder.py, lib/api_future_impl.py)."""
    router = APIRouter()

    @router.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False}

    @router.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {}

    @router.get(HEALTH)  # open without a key: process managers and launchers wait on it
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return {"supported_models": [{"model_name": api.model_name, "trainable": True, "sampleable": True}]}

    @router.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, str]:
        parse(types.CreateSessionRequest, await request.json())
        return {"session_id": uuid.uuid4().hex[:12], "type": "create_session"}

    @router.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, str]:
        parse(types.SessionHeartbeatRequest, await request.json())
        return {"type": "session_heartbeat"}

    @router.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @router.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict[str, str]:
        """The session's models leave memory (their adapters, optimizers, engine snapshots); their
        checkpoints stay on disk, loadable by any later session."""
        for model_id in [m for m in api.runs.info if m.startswith(f"{session_id}:train:")]:
            del api.runs.info[model_id]
            await api.ordered.run(lambda m=model_id: api.models.release(m))
            api.ordered.forget(model_id)
            await api.sampler.release(model_id)
        return {}

    @router.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        req = parse(types.FutureRetrieveRequest, await request.json())
        try:
            result = await api.futures.retrieve(req.request_id)
        except KeyError:
            return JSONResponse({"detail": f"request_id: {req.request_id!r} unknown"}, status_code=404)
        if result is None:
            return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"})
        if isinstance(result, Result) and result.proto:
            return Response(result.body, media_type=PROTOBUF)
        return JSONResponse(result.body if isinstance(result, Result) else result)

    return router


def training_routes(api: Api) -> APIRouter:
    """create_model, get_info, forward_backward (protobuf in and out) and optim_step."""
    router = APIRouter()

    @router.post("/api/v1/create_model")
    async def create_model(request: Request) -> JSONResponse:
        req = parse(types.CreateModelRequest, await request.json())
        api.check_base(req.base_model)
        lora = req.lora_config
        if lora is None:
            raise UserError("lora_config: required; this server trains LoRA adapters only")
        if not 1 <= lora.rank <= api.cfg.max_lora_rank:
            raise UserError(f"lora_config.rank: {lora.rank} is outside [1, {api.cfg.max_lora_rank}] (--max-lora-rank)")
        if req.optimizer_config.type != "adamw":
            raise UserError(f"optimizer_config.type: {req.optimizer_config.type!r}; only adamw is served")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        info = {"base_model": api.model_name, "lora": lora.model_dump(), "user_metadata": req.user_metadata}

        async def create() -> Result:
            await api.ordered.run(lambda: api.models.create(model_id, **lora.model_dump()))
            api.runs.add(model_id, info)
            return Result({"model_id": model_id, "type": "create_model"})

        return future(api.futures.start(create()), model_id=model_id)

    @router.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        req = parse(types.GetInfoRequest, await request.json())
        info = api.runs.of(req.model_id)
        return {
            "type": "get_info",
            "model_id": req.model_id,
            "model_data": {"model_name": api.model_name, "tokenizer_id": api.cfg.model, "arch": "lora"},
            "model_name": api.model_name,
            "is_lora": True,
            "lora_rank": info["lora"]["rank"],
        }

    @router.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> JSONResponse:
        call = read_forward_backward(await request.body())

        def work() -> Result:
            outputs, metrics = api.models.forward_backward(
                call.model_id, call.data, call.loss_fn, call.config, call.forward_only
            )
            return Result(forward_backward_output(outputs, metrics))

        return api.ordered_call(call.model_id, call.seq_id, work)

    @router.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> JSONResponse:
        req = parse(types.OptimStepRequest, await request.json())
        if not isinstance(req.optim_params, types.AdamParams):
            raise UserError(f"optimizer_params.type: {req.optim_params.type!r}; only adam_params (AdamW) is served")
        try:
            params = AdamParams(**req.optim_params.model_dump())
        except ValueError as exc:
            raise UserError(str(exc)) from None
        return api.ordered_call(
            req.model_id, req.seq_id, lambda: Result({"metrics": api.models.optim_step(req.model_id, params)})
        )

    return router


def checkpoint_routes(api: Api) -> APIRouter:
    """State checkpoints (save_state, load_state, resume) and the REST client's runs."""
    router = APIRouter()

    @router.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> JSONResponse:
        req = parse(types.SaveWeightsRequest, await request.json())
        path, where = api.runs.path(req.model_id, "weights", req.path)
        if where.exists() and not req.overwrite:
            raise UserError(f"path: {path} exists; pass overwrite=True to replace it")

        def work() -> Result:
            api.models.save_state(req.model_id, where, optimizer=True)
            return Result({"path": path, "type": "save_weights"})

        return api.ordered_call(req.model_id, req.seq_id, work)

    @router.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> JSONResponse:
        req = parse(types.LoadWeightsRequest, await request.json())
        run_id, where = api.runs.find(req.path, "weights")
        if req.model_id is not None:  # into an existing model, in its order
            return api.ordered_call(
                req.model_id,
                req.seq_id,
                lambda: api.models.load_state(req.model_id, where, req.optimizer) or Result({"path": req.path}),
            )
        if req.session_id is None or req.model_seq_id is None:
            raise UserError("load_weights: give model_id and seq_id, or session_id and model_seq_id")
        api.check_base(req.base_model)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        saved = api.runs.saved_info(run_id)

        async def load() -> Result:  # a new model, made from the checkpoint's LoRA spec
            await api.ordered.run(lambda: api.models.load_state(model_id, where, req.optimizer))
            lora = asdict(api.models.spec(model_id))
            api.runs.add(
                model_id, {**saved, "lora": lora, "user_metadata": req.user_metadata or saved["user_metadata"]}
            )
            return Result({"path": req.path, "model_id": model_id, "type": "load_weights"})

        return future(api.futures.start(load()), model_id=model_id)

    @router.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str) -> Response:
        try:
            return JSONResponse(api.runs.training_run(run_id))
        except OSError:
            return JSONResponse({"detail": f"training run {run_id!r} unknown"}, status_code=404)

    @router.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> dict[str, Any]:
        _, where = api.runs.find(f"tinker://{run_id}/{checkpoint_id}")
        shutil.rmtree(where)
        return {}

    return router


def sampling_routes(api: Api) -> APIRouter:
    """Sampler weights, sampling sessions and `asample`."""
    router = APIRouter()

    @router.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> JSONResponse:
        req = parse(types.SaveWeightsForSamplerRequest, await request.json())
        if req.path is not None:  # a named, durable adapter: loaded when a sampling session names it
            path, where = api.runs.path(req.model_id, "sampler_weights", req.path)

            async def saved(exported: Any) -> Result:
                await exported
                api.sampler.forget(where)  # the next session on this path loads the new weights
                return Result({"path": path, "type": "save_weights_for_sampler"})

            return api.ordered_call(
                req.model_id, req.seq_id, lambda: api.models.export_adapter(req.model_id, where), saved
            )
        # a snapshot for save_weights_and_get_sampling_client: the server opens the session itself
        where = Path(api.cfg.root) / "snapshots" / f"{req.model_id}-{req.seq_id}"

        async def snapshot(exported: Any) -> Result:
            await exported
            name = await api.sampler.snapshot(req.model_id, where)
            shutil.rmtree(where, ignore_errors=True)  # the engine holds the tensors
            return Result({"sampling_session_id": api.sampler.open(name, None), "type": "save_weights_for_sampler"})

        return api.ordered_call(
            req.model_id, req.seq_id, lambda: api.models.export_adapter(req.model_id, where), snapshot
        )

    @router.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, str]:
        req = parse(types.CreateSamplingSessionRequest, await request.json())
        api.check_base(req.base_model)
        if req.model_path is None:
            if req.base_model is None:
                raise UserError("create_sampling_session: give model_path or base_model")
            return {"sampling_session_id": api.sampler.open(None, None), "type": "create_sampling_session"}
        name = await api.sampler.load(api.runs.find(req.model_path)[1])  # a state checkpoint holds the adapter too
        return {"sampling_session_id": api.sampler.open(name, req.model_path), "type": "create_sampling_session"}

    @router.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        api.sampler.adapter_of(sampler_id)
        return {"sampler_id": sampler_id, "base_model": api.model_name, "model_path": api.sampler.source[sampler_id]}

    @router.post("/api/v1/asample")
    async def asample(request: Request) -> JSONResponse:
        req = parse(types.SampleRequest, await request.json())
        api.check_base(req.base_model)
        if req.sampling_session_id is not None:
            adapter = api.sampler.adapter_of(req.sampling_session_id)
        elif req.model_path is not None:
            adapter = await api.sampler.load(api.runs.find(req.model_path)[1])
        else:
            adapter = None

        async def sample() -> Result:
            return Result(await api.sampler.sample(req, adapter))

        rid = api.futures.start(sample())
        return future(rid, sample_sequence_ids=[f"{rid}:{i}" for i in range(req.num_samples)])

    return router


ROUTERS = (session_routes, training_routes, checkpoint_routes, sampling_routes)
