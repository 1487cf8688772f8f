# Shared by setup.sh and setup_vllm.sh (sourced): a venv reinstalled only when its inputs change.

# venv_ready VENV KEY: create VENV when missing; succeed when it is already set up for KEY.
venv_ready() {
  [ -x "$1/bin/python" ] || "${PYTHON:-python3}" -m venv "$1"
  [ -f "$1/.magrpo-setup" ] && [ "$(cat "$1/.magrpo-setup")" = "$2" ]
}

# venv_done VENV KEY: record that VENV is set up for KEY (last, so a failed install is redone).
venv_done() { echo "$2" > "$1/.magrpo-setup"; }

# venv_key SPEC: what a venv depends on: pyproject, the setup scripts, SPEC and this checkout's path
# (magrpo is installed editable).
venv_key() { echo "$(cat pyproject.toml "scripts/$(basename "$0")" scripts/venv_lib.sh | sha256sum | cut -c1-16) $1 $(pwd)"; }

# pip_install VENV ARGS...: quiet pip; some machines warn once per missing local index folder: noise.
pip_install() {
  local venv=$1
  shift
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}
