# The analyst image plus a project's own pip requirements (cycle.yaml project.requirements;
# docs/agent-dependencies.md). Built by runner/isolation/docker/agent_image.py with
# --network none FROM the analyst image's id, from a context holding requirements.txt
# (the checked requirement lines) and wheels/ (downloaded on the host). Multi-stage: the
# wheels and the installer never reach the final image.
ARG ANALYST_IMAGE
FROM ${ANALYST_IMAGE} AS build
USER 0:0
COPY requirements.txt /build/requirements.txt
COPY wheels/ /build/wheels/
# The analyst venv has no pip; a throwaway venv's pip installs into it (--python). The
# venv's own packages are constraints: no agent requirement can move openai or its
# dependencies, which the gateway client relies on (a conflict fails the build).
RUN python3 -m venv /build/pip \
 && /build/pip/bin/pip --python /opt/venv/bin/python freeze --all > /build/constraints.txt \
 && /build/pip/bin/pip --python /opt/venv/bin/python install --no-index --no-cache-dir \
        --disable-pip-version-check --find-links /build/wheels \
        -c /build/constraints.txt -r /build/requirements.txt \
 && /opt/venv/bin/python -m compileall -q /opt/venv

FROM ${ANALYST_IMAGE}
COPY --from=build /opt/venv /opt/venv
# harden.sh ran in the analyst image; nothing setuid/setgid may come in with a wheel
RUN ! find /opt/venv -xdev \( -perm -4000 -o -perm -2000 \) -type f | grep -q .
