#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment: CPU torch first, then magrpo with a
# constraint that keeps that torch (a bare `torch` requirement would pull a multi-GB CUDA build).
#   MAGRPO_VENV   where the venv lives (default: .venv)
#   MAGRPO_TORCH  the torch requirement to install first (default: torch==2.13.0; on a CUDA machine
#                 e.g. "torch" or a wheel index line of your choice)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MAGRPO_VENV:-.venv}
TORCH_SPEC=${MAGRPO_TORCH:-torch==2.13.0}

# bubblewrap isolates the code env's programs (env.sandbox=bwrap, the default): installed here where
# we may (root with apt-get); otherwise said once, with the command for this machine.
if ! command -v bwrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q bubblewrap >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } || true
    fi
    command -v bwrap >/dev/null || echo "setup: the code env needs bubblewrap: sudo apt-get install bubblewrap" \
        "(Fedora: sudo dnf install bubblewrap; Arch: sudo pacman -S bubblewrap)" >&2
fi

# libseccomp builds the sandbox's system-call filter (envs/code/syscalls.py, through PyPI pyseccomp):
# installed the same way where it is missing.
if ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q libseccomp2 >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libseccomp2 >/dev/null 2>&1; } || true
    fi
    ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || echo "setup: the code env needs libseccomp:" \
        "sudo apt-get install libseccomp2 (Fedora: sudo dnf install libseccomp; Arch: sudo pacman -S libseccomp)" >&2
fi

. scripts/venv_lib.sh
want=$(venv_key "$TORCH_SPEC")
venv_ready "$VENV" "$want" && exit 0  # already set up for this pyproject and this checkout
echo "setup: installing into $VENV (torch: $TORCH_SPEC)" >&2
pip_install "$VENV" "$TORCH_SPEC"
"$VENV/bin/python" -m pip freeze | grep -iE '^torch(==| @)' > "$VENV/torch-constraint.txt"
pip_install "$VENV" -c "$VENV/torch-constraint.txt" -e ".[dev]"
venv_done "$VENV" "$want"
