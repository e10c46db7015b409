# Sourced by scripts/test.sh and scripts/demo.sh (from the repository root): creates the project's virtual
# environment once (.venv/, or $KILN_VENV), installs the pinned CPU stack and kiln (editable) into it, and puts
# it first on PATH. Nothing is installed into the python3 that runs it, so a system Python that refuses pip
# installs (Debian's "externally-managed-environment") and a global interpreter whose numpy must not change
# are both left as they are.
KILN_VENV=${KILN_VENV:-.venv}
if [ ! -x "$KILN_VENV/bin/python" ]; then
    echo "== creating the project venv $KILN_VENV (python3 -m venv)"
    if ! python3 -m venv "$KILN_VENV"; then
        rm -rf "$KILN_VENV"
        echo "error: 'python3 -m venv' failed; on Debian/Ubuntu install it with: sudo apt install python3-venv" >&2
        exit 1
    fi
fi
echo "== installing the pinned CPU stack and kiln into $KILN_VENV"
"$KILN_VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
"$KILN_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
VIRTUAL_ENV=$(cd "$KILN_VENV" && pwd)
export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"
hash -r
