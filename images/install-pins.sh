#!/bin/sh
# install-pins.sh EXTRAS: a virtualenv at /opt/lazarus with exactly the versions pyproject.toml
# pins for those extras (images/pins.py reads them), the one place both images install from.
set -eu
here=$(dirname "$0")
python3 -m venv /opt/lazarus
python3 "$here/pins.py" "$1" > /opt/lazarus-pins/requirements.txt
/opt/lazarus/bin/pip install --no-cache-dir -r /opt/lazarus-pins/requirements.txt
