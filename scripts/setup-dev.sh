#!/usr/bin/env bash
# Installs what the test suite needs: the package with its test extras, sshfs + sftp-server
# (the suite runs ranks on separate sshfs mounts, like nodes on a network filesystem), and
# iproute2 (`ip netns`: ranks in their own network namespaces), fuse3 (the fault-injecting
# filesystem, tests/faultfs.py) and a C compiler (tests/clock_skew.c). Python packages come at the
# exact versions of constraints.txt, the ones the suite last passed with.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v sshfs >/dev/null || [ ! -x /usr/lib/openssh/sftp-server ] || ! command -v ip >/dev/null || ! command -v fusermount3 >/dev/null || ! command -v cc >/dev/null || ! command -v strace >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sshfs openssh-sftp-server fuse3 iproute2 gcc strace >/dev/null
  else
    echo "setup-dev: sshfs and netns tests need 'sshfs', 'openssh-sftp-server' and 'iproute2' (apt); they will be skipped" >&2
  fi
fi
python3 -m pip install -q -c constraints.txt -e '.[test]'
