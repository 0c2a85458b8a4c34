#!/bin/sh
# Shared final-stage hardening for every role image (run once at build time).
# - strips setuid/setgid bits (CIS Docker Benchmark 4.8): minbase ships su, mount, chfn...
# - strips file capabilities (the security.capability xattr: a .deb's postinst may setcap,
#   e.g. iputils-ping's cap_net_raw=ep on /usr/bin/ping)
# - adds the unprivileged role user (uid/gid 10001) without needing useradd
# - removes package-manager state a runtime image never uses
set -eu
# The system's tools only: the image's PATH puts /opt/venv/bin first, where an agent's
# wheels install console scripts (a `find` or `python3` of theirs would run here as root).
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
find / -xdev \( -perm -4000 -o -perm -2000 \) -type f -exec chmod a-s {} + 2>/dev/null || true
# No getcap/setcap in a minbase image; python3 is in every base (the role venvs need it).
# Walks the root filesystem only (like find -xdev), removes the xattr from every regular
# file, then walks again and fails the build if any file still has one.
# -I -S: no site directory, no .pth file, no environment variable of the image's
PY=/usr/bin/python3
[ -x "$PY" ] || PY=/usr/local/bin/python3   # python:3.11-slim (BASE_IMAGE) keeps it there
"$PY" -I -S - <<'PY'
import errno, os, stat, sys

CAP = "security.capability"


def files_with_caps():
    top = os.lstat("/").st_dev
    def fail(exc):  # an unreadable directory is never skipped silently
        raise exc

    for root, dirs, files in os.walk("/", onerror=fail):
        dirs[:] = [d for d in dirs if os.lstat(os.path.join(root, d)).st_dev == top]
        for name in files:
            p = os.path.join(root, name)
            try:
                if not stat.S_ISREG(os.lstat(p).st_mode):
                    continue
                os.getxattr(p, CAP, follow_symlinks=False)
            except OSError as exc:
                if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
                    continue
                raise
            yield p


for p in list(files_with_caps()):
    print("harden.sh: removing file capabilities of", p, file=sys.stderr)
    os.removexattr(p, CAP, follow_symlinks=False)
left = list(files_with_caps())
if left:
    print("file capabilities remain:", *left[:20], file=sys.stderr)
    sys.exit(1)
PY
grep -q '^cyclebox:' /etc/group  || echo 'cyclebox:x:10001:' >> /etc/group
grep -q '^cyclebox:' /etc/passwd || echo 'cyclebox:x:10001:10001:cyclebox role:/nonexistent:/usr/sbin/nologin' >> /etc/passwd
rm -rf /var/cache/apt/* /var/lib/apt/lists/* /root/.cache 2>/dev/null || true
# Fail the build if anything setuid/setgid survived.
if find / -xdev \( -perm -4000 -o -perm -2000 \) -type f 2>/dev/null | grep -q .; then
    echo "setuid/setgid files remain" >&2; exit 1
fi
