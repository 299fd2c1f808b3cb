# Sourced by the GPU scripts: the vLLM kit in /tmp/vsite, carried wheels in /tmp/site, this repo.
export PYTHONPATH=/tmp/vsite:/tmp/site:$PWD
export AGENTLOOP_CACHE_DIR=$PWD/.gpucache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
card() { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1; }
