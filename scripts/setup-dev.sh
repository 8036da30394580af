#!/usr/bin/env bash
# Installs what the test suite needs: the package with its test extras, sshfs + sftp-server
# (the suite runs ranks on separate sshfs mounts, like nodes on a network filesystem), and
# iproute2 (`ip netns`: ranks in their own network namespaces), fuse3 (the fault-injecting
# filesystem, tests/faultfs.py), a C compiler (tests/clock_skew.c) and Slurm with munge (a
# real single-machine Slurm cluster, tests/slurm.py). Python packages come at the
# exact versions of constraints.txt, the ones the suite last passed with.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v sshfs >/dev/null || [ ! -x /usr/lib/openssh/sftp-server ] || ! command -v ip >/dev/null || ! command -v fusermount3 >/dev/null || ! command -v cc >/dev/null || ! command -v strace >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sshfs openssh-sftp-server fuse3 iproute2 gcc strace >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
  else
    echo "setup-dev: sshfs, netns and Slurm tests need 'sshfs', 'openssh-sftp-server', 'iproute2', 'slurm-wlm' and 'munge' (apt); they will be skipped" >&2
  fi
fi
python3 -m pip install -q -c constraints.txt -e '.[test]'
