# Sourced on the TPU machine (the device tool), from the repository root:
#     source benchmarks/tpu_env.sh && python3 benchmarks/bench_resume.py ...
# Installs what the benchmarks need beside the machine's own JAX: flax, optax, orbax-checkpoint,
# tensorstore from the machine's package index, and the wheels carried in .whl-tpu/ (crc32c, zstandard,
# msgpack: cp311 manylinux, fetched here with `pip download` as the device README says); then puts
# flax_ckpt on PYTHONPATH as installed (callbacks/ as flax_ckpt.callbacks), without building it.
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
_pip() { PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-compile --no-cache-dir "$@"; }
_pip --no-index --no-deps --upgrade --target /tmp/site .whl-tpu/*.whl \
  && _pip --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site2 \
       flax optax orbax-checkpoint tensorstore ml_dtypes tqdm \
  && rm -rf /tmp/shim && mkdir -p /tmp/shim && cp -r flax_ckpt /tmp/shim/ \
  && cp -r callbacks /tmp/shim/flax_ckpt/callbacks \
  && export PYTHONPATH=/tmp/shim:$PYTHONPATH:/tmp/site:/tmp/site2 \
  && (cd /tmp && python3 -c "import jax, flax, optax, orbax.checkpoint, flax_ckpt.callbacks; print('tpu env:', jax.__version__, flax.__version__, orbax.checkpoint.__version__)")
