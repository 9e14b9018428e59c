#!/bin/bash
# The GPU half of issue 5 in one prepared run on a lent device (docs/engine.md, "CUDA"): the CUDA
# engine tests, then bench/generate.py on random weights of the SmolLM2-135M shape (1, 64 and 256
# requests beside transformers generate and generate_batch). Logs land in $OUT.
#
# The device image has torch, transformers, tokenizers, msgpack, safetensors, pytest and
# pytest-timeout, but not gguf (gpu_worker/pack/gguf.py imports it), llguidance (engine/grammar.py)
# or rfc8785 (contract/structured.py). Before the run, here, in the repo's root:
#
#   grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1 rfc8785==0.1.4
#
# then: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540), and give_back.
set -o pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
# the device's native code (gpu_worker/native: g++, the Python headers, zlib's and OpenSSL's
# headers) first: without it nothing of gpu_worker imports, and this says why in one line
python3 -m gpu_worker.native 2>&1 | tail -3 | tee "$OUT/native.txt" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    2>&1 | tee -a "$OUT/gpu.txt"
# correctness first: graphs against eager, CUDA float32 against CPU, reproducible sampling, the Triton
# kernels (compiled) against PyTorch and as the forward against transformers, and
# bfloat16 logits (graphs) against transformers' float32 reference on the tiny random model
# (and memory: recall's GPU path against the CPU answer; the state tables' writes on CUDA against
# the host's)
timeout 240 python3 -m pytest tests/engine/test_cuda.py tests/engine/test_triton_ops.py -p no:cacheprovider \
    tests/gpu_worker/memory/test_recall.py::test_the_gpu_path_gives_the_cpu_answer \
    tests/gpu_worker/test_state_tables.py::test_tables_on_cuda_hold_what_host_tables_do \
    "tests/engine/test_model_logits.py::test_bfloat16_logits_are_as_close_to_float32_as_transformers_own" \
    2>&1 | tee "$OUT/test_cuda.log"
tests=$?
# then the benchmark (the targets: >= 20x eager generate at 1 request, >= 10x generate_batch at 256)
timeout 270 python3 bench/generate.py --device cuda --random-weights 2>&1 | tee "$OUT/generate.log"
bench=$?
echo "test_cuda exit $tests, generate exit $bench" | tee -a "$OUT/gpu.txt"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
