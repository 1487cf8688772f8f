#!/usr/bin/env bash
# Create (or refresh) a virtual environment with the reference CoMLRL, for experiments/parity.py.
#   MAGRPO_COMLRL_VENV   where the venv lives (default: ~/.cache/magrpo/comlrl-venv)
#   MAGRPO_COMLRL        the CoMLRL requirement (default: comlrl==1.4.3, the version docs/porting.md
#                        and docs/results/parity.md describe)
#   MAGRPO_TORCH         the torch requirement installed first (default: torch==2.13.0, the CPU wheel)
# CoMLRL does not list torch; a torch pulled in by anything else would be a multi-GB CUDA build, so
# torch goes first and every later install keeps it (a constraint). magrpo itself is installed
# editable (no extras) because the parity runner takes its envs, feedback and tiny model from it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MAGRPO_COMLRL_VENV:-$HOME/.cache/magrpo/comlrl-venv}
COMLRL_SPEC=${MAGRPO_COMLRL:-comlrl==1.4.3}
TORCH_SPEC=${MAGRPO_TORCH:-torch==2.13.0}

. scripts/venv_lib.sh
want=$(venv_key "$COMLRL_SPEC $TORCH_SPEC")
venv_ready "$VENV" "$want" && exit 0  # already set up for this pyproject, these specs and this checkout
echo "setup_comlrl: installing $COMLRL_SPEC into $VENV (about a minute the first time)" >&2
pip_install "$VENV" "$TORCH_SPEC"
"$VENV/bin/python" -m pip freeze | grep -iE '^torch(==| @)' > "$VENV/torch-constraint.txt"
pip_install "$VENV" -c "$VENV/torch-constraint.txt" "$COMLRL_SPEC"
pip_install "$VENV" -c "$VENV/torch-constraint.txt" -e .
"$VENV/bin/python" -c "from comlrl.trainers.reinforce import MAGRPOTrainer; import magrpo.tiny" >/dev/null
venv_done "$VENV" "$want"
