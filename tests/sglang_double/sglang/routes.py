"""SGLang 0.5.23's HTTP surface as data, for the strict layer (strict.py): its routes, the fields
each control route's request schema has, and the replies the layer copies. Paths are SGLang's,
under python/sglang/srt/.
"""

# entrypoints/http_server.py's routes (and entrypoints/v1_loads.py's /v1/loads).
ROUTES = {
    "/ready",
    "/health",
    "/health_generate",
    "/get_model_info",
    "/model_info",
    "/get_server_info",
    "/server_info",
    "/set_internal_state",
    "/generate",
    "/encode",
    "/classify",
    "/flush_cache",
    "/add_external_corpus",
    "/remove_external_corpus",
    "/list_external_corpora",
    "/hicache/storage-backend/clear",
    "/hicache/storage-backend",
    "/get_hicache_l3_cache_layout",
    "/start_profile",
    "/stop_profile",
    "/set_trace_level",
    "/freeze_gc",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/update_weights_from_disk",
    "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance",
    "/get_remote_instance_transfer_engine_info",
    "/remote_instance_transfer_engine_info",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_tensor",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_distributed",
    "/update_weights_from_ipc",
    "/update_weight_version",
    "/get_weights_by_name",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/weights_checker",
    "/slow_down",
    "/pd_role_switch",
    "/load_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
    "/open_session",
    "/close_session",
    "/configure_logging",
    "/abort_request",
    "/parse_function_call",
    "/separate_reasoning",
    "/pause_generation",
    "/continue_generation",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/classify",
    "/v1/tokenize",
    "/tokenize",
    "/v1/detokenize",
    "/detokenize",
    "/v1/audio/transcriptions",
    "/v1/models",
    "/v1/score",
    "/v1/decisions",
    "/v1/responses",
    "/v1/rerank",
    "/",
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/systemone",
    "/ping",
    "/invocations",
    "/vertex_generate",
    "/v1/loads",
}
ROUTE_PREFIXES = ("/v1/models/", "/v1/responses/")

# managers/io_struct.py: each control route's schema (BaseReq adds rid and http_worker_ipc, :86).
BASE_FIELDS = {"rid", "http_worker_ipc"}
FIELDS = {
    "/update_weights_from_distributed": {
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "load_format",
        "selector",
        "torch_empty_cache",
    },  # :2002
    "/update_weights_from_disk": {
        "model_path",
        "load_format",
        "abort_all_requests",
        "weight_version",
        "is_async",
        "torch_empty_cache",
        "keep_pause",
        "recapture_cuda_graph",
        "token_step",
        "flush_cache",
        "manifest",
    },  # :1970
    "/update_weights_from_tensor": {
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "selector",
        "torch_empty_cache",
    },  # :2027
    "/init_weights_update_group": {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    },  # :2126
    "/destroy_weights_update_group": {"group_name"},  # :2146
    "/begin_weight_update": {"selector"},  # :2197
    "/end_weight_update": set(),  # :2208
    "/pause_generation": {"mode"},  # :1927
    "/continue_generation": {"torch_empty_cache"},  # :1949
    "/update_weight_version": {"new_version", "abort_all_requests"},  # :2155
    "/get_weights_by_name": {"name", "truncate_size"},  # :2166
    "/load_lora_adapter": {"lora_name", "lora_path", "pinned", "lora_id"},  # :2516
    "/unload_lora_adapter": {"lora_name", "lora_id"},  # :2535
    "/abort_request": {"abort_all", "finished_reason", "abort_message", "weight_versions"},  # :2285
}

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # constants.py GPU_MEMORY_TYPE_*
# The control calls recorded in order when SGLANG_SHIM_CALLS names a file (sglang/tensors.py).
RECORDED = {
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
}

FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)  # weight_updater.py:127
