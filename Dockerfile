# GPU image for slimish on a cluster: CUDA, SGLang (engines), Megatron-Core with TransformerEngine
# (trainer), Ray (placement), slimish itself. Built from the repository root:
#
#   docker build -t slimish:gpu .
#
# SGLang pins its own torch and CUDA build, so the image starts from SGLang's and adds the rest
# on top of that torch (nothing here reinstalls torch). SGLANG_TAG must carry sglang >= 0.5.23
# (the weight-update sessions slimish uses). sglang 0.5.23 is built for CUDA 13 (torch 2.14.1):
# its images are tagged vX.Y.Z and need a CUDA 13 driver; CUDA 12 images stopped at v0.5.19-cu129.
# The versions below are resolved together with pyproject.toml's by tests/test_gpu_deps.py.
ARG SGLANG_TAG=v0.5.23
FROM lmsysorg/sglang:${SGLANG_TAG}

# megatron-core 0.16.1 asks for transformer-engine[core_cu13,pytorch] >=2.9,<2.12.
ARG TE_VERSION=2.11.0
ARG MEGATRON_CORE_VERSION=0.16.1
ARG RAY_VERSION=2.60.0
# TransformerEngine's CUDA kernels come built (the core_cu13 wheel); its torch extension is
# compiled here against the image's torch (--no-build-isolation), which also makes it ask for the
# CUDA 13 core. MAX_JOBS bounds that compile.
ARG MAX_JOBS=8
ENV MAX_JOBS=${MAX_JOBS} NVTE_FRAMEWORK=pytorch \
    PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore

RUN pip install --no-build-isolation "transformer_engine[core_cu13,pytorch]==${TE_VERSION}" \
 && pip install "megatron-core==${MEGATRON_CORE_VERSION}" "ray==${RAY_VERSION}" \
 && python -c "import torch, sglang, megatron.core, transformer_engine.pytorch, ray; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

WORKDIR /opt/slimish
COPY pyproject.toml README.md ./
COPY slimish slimish
COPY megatron_bridge megatron_bridge
COPY rollout_plugins rollout_plugins
COPY configs configs
COPY benchmarks benchmarks
# The extras' GPU packages are installed above, so pip only adds slimish and its light deps.
RUN pip install -e ".[gpu,ray]" && python -m slimish.cli --help > /dev/null

# NCCL across nodes: set NCCL_SOCKET_IFNAME / NCCL_IB_HCA for your fabric at `docker run` time.
ENV OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
CMD ["bash"]
