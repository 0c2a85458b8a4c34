#!/bin/sh
# Shared final-stage hardening for every role image (run once at build time).
# - strips setuid/setgid bits (CIS Docker Benchmark 4.8): minbase ships su, mount, chfn...
# - adds the unprivileged role user (uid/gid 10001) without needing useradd
# - removes package-manager state a runtime image never uses
set -eu
find / -xdev \( -perm -4000 -o -perm -2000 \) -type f -exec chmod a-s {} + 2>/dev/null || true
grep -q '^cyclebox:' /etc/group  || echo 'cyclebox:x:10001:' >> /etc/group
grep -q '^cyclebox:' /etc/passwd || echo 'cyclebox:x:10001:10001:cyclebox role:/nonexistent:/usr/sbin/nologin' >> /etc/passwd
rm -rf /var/cache/apt/* /var/lib/apt/lists/* /root/.cache 2>/dev/null || true
# Fail the build if anything setuid/setgid survived.
if find / -xdev \( -perm -4000 -o -perm -2000 \) -type f 2>/dev/null | grep -q .; then
    echo "setuid/setgid files remain" >&2; exit 1
fi
