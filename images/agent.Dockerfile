# The analyst image plus a project's own toolchains (cycle.yaml project.requirements,
# project.apt, project.npm; docs/agent-dependencies.md). Built by
# runner/isolation/docker/agent_image.py with --network none FROM the analyst image's id,
# from a context holding (each empty when the project does not declare it):
#   apt.txt + debs/           Debian packages apt resolved and downloaded on the host
#   requirements.txt + wheels/ the checked pip lines and their wheels
#   node_modules/             laid out on the host from package-lock.json (no scripts run)
#   harden.sh                 the shared final-stage hardening
# Multi-stage: the .debs, wheels and installers never reach the final image; only the
# files the installs created or changed do (found by ctime against a stamp).
ARG ANALYST_IMAGE
FROM ${ANALYST_IMAGE} AS build
# Fresh per build: this stage's step images are this build's alone, and the builder
# removes them afterwards (runner/isolation/docker/backend.py, drop_other_stages).
ARG BUILD_NONCE
LABEL io.cyclebox.build_stage=${BUILD_NONCE}
USER 0:0
# dpkg wants ldconfig and start-stop-daemon (sbin); this stage's PATH stays in this stage
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY apt.txt requirements.txt /build/
COPY debs/ /build/debs/
COPY wheels/ /build/wheels/
RUN touch /build/.stamp && sleep 1
# dpkg only (apt already resolved the set on the host): maintainer scripts run here, in
# the image build with no network, never on the host.
RUN set -eu; if [ -s /build/apt.txt ]; then \
      DEBIAN_FRONTEND=noninteractive dpkg -i --force-confold /build/debs/*.deb; \
      dpkg-query -W -f='${Package}=${Version}\n' > /build/dpkg.txt; \
      while read -r pin; do grep -qxF "$pin" /build/dpkg.txt \
        || { echo "CYCLEBOX-REFUSED $pin not installed" >&2; exit 1; }; done < /build/apt.txt; \
    fi
# The analyst venv has no pip; a throwaway venv's pip installs into it (--python). The
# venv's own packages are constraints: no agent requirement can move openai or its
# dependencies, which the gateway client relies on (a conflict fails the build).
RUN set -eu; if [ -s /build/requirements.txt ]; then \
      python3 -m venv /build/pip \
      && /build/pip/bin/pip --python /opt/venv/bin/python freeze --all > /build/constraints.txt \
      && /build/pip/bin/pip --python /opt/venv/bin/python install --no-index --no-cache-dir \
          --disable-pip-version-check --find-links /build/wheels \
          -c /build/constraints.txt -r /build/requirements.txt \
      && /opt/venv/bin/python -m compileall -q /opt/venv; \
    fi
# What the installs created or changed, as a tree to lay over the analyst image.
RUN mkdir /build/delta \
 && find / -xdev -cnewer /build/.stamp \( -type f -o -type l \) \
      ! -path '/build/*' ! -path '/tmp/*' ! -path '/root/*' ! -path '/var/cache/*' \
      ! -path '/var/log/*' ! -path '/etc/hostname' ! -path '/etc/hosts' \
      ! -path '/etc/resolv.conf' -print0 \
    | xargs -0 -r cp -a --parents -t /build/delta

FROM ${ANALYST_IMAGE}
USER 0:0
COPY --from=build /build/delta/ /
COPY node_modules/ /node_modules/
COPY harden.sh /tmp/harden.sh
# harden.sh ran in the analyst image; again here: nothing setuid/setgid may come in with
# a .deb, a wheel or a tarball (it strips the bits and fails the build if any survive).
RUN sh /tmp/harden.sh && rm -f /tmp/harden.sh
# Node resolves packages by walking up from the script (/src/agent.mjs -> /node_modules),
# for ESM and CommonJS alike; the packages' bin links come first on PATH.
ENV PATH=/node_modules/.bin:/opt/venv/bin:/usr/local/bin:/usr/bin:/bin
USER 10001:10001
