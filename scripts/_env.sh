# Sourced by scripts/demo and scripts/test: create or refresh the project's own
# virtual environment in .venv. Re-installs only when pyproject.toml, setup.py, the C sources (_native*.c, .h) or this file change.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"
# (the C extension's source too: the editable install builds it once, so a changed _native.c means a rebuild)
stamp_want="$(cat "$root/pyproject.toml" "$root/setup.py" "$root/scripts/_env.sh" "$root"/gradwatch/publisher/_native*.[ch] \
  | sha256sum | cut -c1-16)"
stamp_file="$venv/.gradwatch-stamp"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp_want" ]; then
  echo "gradwatch: setting up $venv (first run takes a minute or two)..." >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  # torch==2.13.0 is pinned so that pip takes the CPU build on disk instead of a multi-GB CUDA build.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" >&2
  # then the project, its test tools and the frameworks of gradwatch.integrations, torch held where it is
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
      "torch==2.13.0" -e "$root[test,frameworks]" >&2
  echo "$stamp_want" > "$stamp_file"
fi
# tmux drives the end-to-end test of the viewer in a real terminal
if ! command -v tmux >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q tmux >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q tmux >/dev/null 2>&1; }) \
    || echo "gradwatch: could not install tmux; its end-to-end test will be skipped" >&2
fi
# a real sshd on 127.0.0.1 drives the tests of `gradwatch ssh` (the tests start it themselves, on a free port)
if [ ! -x /usr/sbin/sshd ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server >/dev/null 2>&1; }) \
    || echo "gradwatch: could not install openssh-server; the tests of gradwatch ssh will be skipped" >&2
fi
export PATH="$venv/bin:$PATH"
