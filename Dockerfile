# GPU image for slimish on a cluster: CUDA, SGLang (engines), Megatron-Core with TransformerEngine
# (trainer), Ray (placement), slimish itself. Built from the repository root:
#
#   docker build -t slimish:gpu .
#
# SGLang pins its own torch and CUDA build, so the image starts from SGLang's and adds the rest
# on top of that torch (nothing here reinstalls torch). SGLANG_TAG must carry sglang >= 0.5.23
# (the weight-update routes slimish uses, ../shared/PROTOCOL.md); check the tags on Docker Hub
# (lmsysorg/sglang) for one matching your CUDA driver.
ARG SGLANG_TAG=v0.5.23-cu129
FROM lmsysorg/sglang:${SGLANG_TAG}

ARG TE_VERSION=2.9.0
ARG MEGATRON_CORE_VERSION=0.16.1
ARG RAY_VERSION=2.60.0
# TransformerEngine compiles CUDA kernels against the image's torch: bound the parallel jobs,
# and name the GPU architectures you run on (9.0: H100 / H200) to keep the build short.
ARG MAX_JOBS=8
ARG TORCH_CUDA_ARCH_LIST="9.0"
ENV MAX_JOBS=${MAX_JOBS} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} NVTE_FRAMEWORK=pytorch \
    PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore

RUN pip install --no-build-isolation "transformer_engine[pytorch]==${TE_VERSION}" \
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
