#!/usr/bin/env bash
# Installs what the test suite needs: the package with its test extras, and sshfs + sftp-server
# (the suite runs ranks on separate sshfs mounts, like nodes on a network filesystem).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v sshfs >/dev/null || [ ! -x /usr/lib/openssh/sftp-server ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sshfs openssh-sftp-server fuse3 >/dev/null
  else
    echo "setup-dev: sshfs tests need 'sshfs' and 'openssh-sftp-server' (apt); they will be skipped" >&2
  fi
fi
python3 -m pip install -q -e '.[test]'
